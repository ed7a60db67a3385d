"""`inspect` warns about the serving pitfalls users of the pair have hit, on configs crafted like theirs (issue 25)."""

from __future__ import annotations

import json
import shutil

import pytest

from matrix.synthetic import (fp8_quantization_config, modelopt_nvfp4_config, tiny_preset,
                                         write_checkpoint, write_pair)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    root = tmp_path_factory.mktemp("pitfalls")
    write_pair(root, preset=tiny_preset("31b"))
    return root


def _edited(source, tmp_path, role: str, edit) -> object:
    out = tmp_path / role
    shutil.copytree(source / role, out)
    config = json.loads((out / "config.json").read_text())
    edit(config)
    (out / "config.json").write_text(json.dumps(config))
    return out


def _warnings(run_cli, path) -> list[str]:
    result = run_cli("inspect", path, "--json")
    assert result.code == 0, result.err
    return json.loads(result.out)["warnings"]


def test_the_published_pair_has_no_warning(source, run_cli):
    assert _warnings(run_cli, source / "target") == [] and _warnings(run_cli, source / "assistant") == []


def test_a_quantized_assistant_is_a_warning(tmp_path, run_cli):
    # its tensors quantized too, by compressed-tensors' own code: a config alone would be a malformed input (exit 3)
    path = write_checkpoint(tmp_path / "assistant", preset=tiny_preset("31b"), role="assistant",
                            quantization=fp8_quantization_config("channel"))
    warnings = _warnings(run_cli, path)
    assert len(warnings) == 1 and "accepts ~0 %" in warnings[0] and "#47091" in warnings[0]
    text = run_cli("inspect", path)
    assert text.code == 0 and "WARNING: the assistant is quantized (compressed-tensors)" in text.out
    # convert says it too, before writing (issue 53), beside a bf16 target and alone
    target = write_checkpoint(tmp_path / "target", preset=tiny_preset("31b"), role="target")
    for sources in (("--target", target, "--assistant", path), (path,)):
        converted = run_cli("convert", *sources, "--out", tmp_path / "out", "--dry-run")
        assert converted.code == 0, converted.err
        assert f"WARNING: {warnings[0]}" in converted.err.splitlines()


def test_a_hand_edited_num_kv_shared_layers_is_a_warning(source, tmp_path, run_cli):
    path = _edited(source, tmp_path, "assistant", lambda c: c["text_config"].update(num_kv_shared_layers=0))
    warnings = _warnings(run_cli, path)
    assert len(warnings) == 1 and "num_kv_shared_layers=0 of 4 layers" in warnings[0]


def test_an_assistant_relabelled_as_a_target_is_a_warning(source, tmp_path, run_cli):
    path = _edited(source, tmp_path, "assistant", lambda c: c.update(model_type="gemma4"))
    result = run_cli("inspect", path, "--json")
    # read as a multimodal target, its tensors are where no target keeps them (problems, exit 3); the warning says why
    assert result.code == 3
    warnings = json.loads(result.out)["warnings"]
    assert any("name an assistant but model_type is 'gemma4'" in w and "gemma4_assistant" in w for w in warnings)


@pytest.mark.parametrize("kv_cache", [
    {"kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}},
    {"kv_cache_quant_algo": "FP8"},
])
def test_a_quantized_kv_cache_on_the_target_is_a_warning(source, tmp_path, run_cli, kv_cache):
    base = fp8_quantization_config("channel") if "kv_cache_scheme" in kv_cache else modelopt_nvfp4_config()
    path = _edited(source, tmp_path, "target", lambda c: c.update(quantization_config={**base, **kv_cache}))
    result = run_cli("inspect", path, "--json")
    warnings = json.loads(result.out)["warnings"]
    assert any("quantized KV cache" in w and "#49262" in w for w in warnings), (result.err, warnings)

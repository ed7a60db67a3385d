"""`inspect`: geometry from config, shapes checked against headers, dialect, vLLM 0.27 prediction, costs."""

import json

import pytest

from conftest import read_config, text_config

LAYOUT_CASES = [("31b", {}), ("26b-a4b", {"multimodal": False}), ("e2b", {"multimodal": False}),
                ("e4b", {"multimodal": False})]


@pytest.mark.parametrize("dialect", ["legacy", "per_layer_config", "both"])
@pytest.mark.parametrize("preset, options", LAYOUT_CASES)
def test_geometry_matches_config(synthetic_cache, run_cli, preset, options, dialect):
    src = synthetic_cache(preset, "pair", dialect=dialect, **options)
    for role in ("target", "assistant"):
        result = run_cli("inspect", "--json", src / role)
        assert result.code == 0, result.err
        report = json.loads(result.out)
        config = text_config(read_config(src / role))
        assert report["role"] == role and report["dialect"]["name"] == dialect
        assert report["dialect"]["wins"] == ("legacy" if dialect == "legacy" else "per_layer_config")
        assert report["problems"] == [] and report["geometry"]["head_dim"] == config["head_dim"]
        assert [row["type"] for row in report["layers"]] == config["layer_types"]
        for row in report["layers"]:
            full = row["type"] == "full_attention"
            assert row["head_dim"] == report["geometry"]["global_head_dim" if full else "head_dim"]
            assert row["shape_mismatches"] == []
            q_rows = row["tensors"]["q_proj.weight"][0]
            assert q_rows == config["num_attention_heads"] * row["head_dim"]
            if "k_proj.weight" in row["tensors"]:
                assert row["tensors"]["k_proj.weight"][0] == row["kv_heads"] * row["head_dim"]
        old = report["vllm_0_27"]["transformers<5.15"]
        new = report["vllm_0_27"]["transformers>=5.15"]
        assert old["outcome"] == ("loads" if dialect == "legacy" else "fails")
        assert (new["outcome"], new["error"]) == ("fails", "AmbiguousGlobalPerLayerAttributeError")
        assert (report["vllm_0_27"]["silent_truncation_risk"] is not None) == (dialect == "per_layer_config")


def test_attention_forms_are_named(synthetic_cache, run_cli):
    target = json.loads(run_cli("inspect", "--json", synthetic_cache("31b", "pair") / "target").out)
    assert [r["attention"] for r in target["layers"]] == ["split q/k/v"] * 5 + ["k_eq_v (no v_proj)"]
    fused = json.loads(run_cli("inspect", "--json",
                               synthetic_cache("31b", "target", fused_qkv=True, multimodal=False)).out)
    assert {r["attention"] for r in fused["layers"]} == {"fused qkv_proj"}
    assert fused["vllm_0_27"]["transformers<5.15"]["outcome"] == "fails"
    assistant = json.loads(run_cli("inspect", "--json", synthetic_cache("31b", "pair") / "assistant").out)
    assert {r["attention"] for r in assistant["layers"]} == {"Q-only (KV shared)"}
    e2b = json.loads(run_cli("inspect", "--json", synthetic_cache("e2b", "pair", multimodal=False) / "target").out)
    assert [r["attention"] for r in e2b["layers"]] == ["split q/k/v"] * 5 + ["KV shared (own k/v unused)"] * 5


def test_text_output_and_costs_of_the_real_31b_geometry(tmp_path, run_cli):
    """Headers only, so a full-width 31B target costs nothing to inspect; KV numbers match FACTS.md section 4."""
    from converter.io.safetensors_header import encode_header
    from converter.synthetic import scaled_preset, target_config, target_tensors
    preset = scaled_preset("31b")  # 60 layers, real widths
    (tmp_path / "config.json").write_text(json.dumps(target_config(preset, dialect="legacy", multimodal=True)))
    entries, offset = {}, 0
    for spec in target_tensors(preset, multimodal=True):
        size = 2
        for dim in spec.shape:
            size *= dim
        entries[spec.name] = {"dtype": "BF16", "shape": list(spec.shape), "data_offsets": [offset, offset + size]}
        offset += size
    with open(tmp_path / "model.safetensors", "wb") as handle:  # sparse file: header + a hole
        handle.write(encode_header(entries))
        handle.truncate(handle.tell() + offset)
    result = run_cli("inspect", tmp_path)
    assert result.code == 0, result.err
    assert "0-4       sliding_attention       256   16  split q/k/v" in result.out
    assert ("KV cache per token (every layer holds the full context): 880.0 KiB as is and after per-layer (x1.00), "
            "after pad-global 1.9 MiB (x2.18)") in result.out
    report = json.loads(run_cli("inspect", "--json", tmp_path).out)
    costs = {c["context"]: c["ratio"] for c in report["kv_cache_bytes_per_token"]}
    assert costs[None] == pytest.approx(2.18, abs=0.01)
    assert costs[8192] == pytest.approx(2.89, abs=0.01) and costs[131072] == pytest.approx(3.86, abs=0.01)
    assert report["kv_cache_bytes_per_token"][0]["current"] == 880 * 1024
    assert report["kv_cache_bytes_per_token"][0]["per_layer"] == 880 * 1024
    weights = report["weight_bytes"]  # FACTS.md section 4: pad-global adds 6.94 G parameters to the 31B target
    assert weights["per_layer"] == weights["current"]
    assert (weights["pad_global"] - weights["current"]) / 2 == pytest.approx(6.94e9, rel=0.005)
    assert "after per-layer (+0 B), after pad-global" in result.out


def test_shape_contradiction_is_reported(synthetic_cache, tmp_path, run_cli):
    import shutil
    src = tmp_path / "t"
    shutil.copytree(synthetic_cache("31b", "pair") / "target", src)
    config = read_config(src)
    config["text_config"]["global_head_dim"] = 64
    (src / "config.json").write_text(json.dumps(config))
    result = run_cli("inspect", src)
    assert result.code == 0 and "SHAPE MISMATCH" in result.out and "PROBLEM:" in result.out
    convert = run_cli("convert", src, "--out", tmp_path / "o", "--layout", "per-layer")
    assert convert.code == 3 and "config and weights disagree" in convert.err
    assert len(convert.err.strip().splitlines()) == 1


def test_non_boolean_k_eq_v_is_bad_input(synthetic_cache, tmp_path, run_cli):
    import shutil
    src = tmp_path / "t"
    shutil.copytree(synthetic_cache("31b", "pair") / "target", src)
    config = read_config(src)
    config["text_config"]["attention_k_eq_v"] = "false"  # truthy string: would silently mean k_eq_v
    (src / "config.json").write_text(json.dumps(config))
    result = run_cli("inspect", src)
    assert result.code == 3 and "'attention_k_eq_v' must be true or false" in result.err

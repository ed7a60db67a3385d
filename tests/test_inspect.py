"""`inspect`: geometry from config, shapes checked against headers, dialect, vLLM 0.27 prediction, costs."""

import json

import pytest

from _checkpoints import read_config, text_config

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
        assert measured_or_expected(old, "loads" if dialect == "legacy" else "fails")
        assert measured_or_expected(new, "fails")
        assert new["outcome"] == "unknown" or new["error"] == "AmbiguousGlobalPerLayerAttributeError"
        assert (report["vllm_0_27"]["silent_truncation_risk"] is not None) == (dialect == "per_layer_config")
        # `vllm_0_27`: the documented alias of the release-neutral key (docs/CLI.md)
        assert report["stock_vllm"] == report["vllm_0_27"] and report["stock_vllm"]["vllm"] == "0.27.0"


def measured_or_expected(verdict: dict, outcome: str) -> bool:
    """The ledger's measured outcome, or, for a shape it has no row of, "unknown" quoting the rules' expectation."""
    return verdict["outcome"] == outcome or (
        verdict["outcome"] == "unknown" and f"expected from the rules: {outcome}" in verdict["detail"])


def test_attention_forms_are_named(synthetic_cache, run_cli):
    target = json.loads(run_cli("inspect", "--json", synthetic_cache("31b", "pair") / "target").out)
    assert [r["attention"] for r in target["layers"]] == ["split q/k/v"] * 5 + ["k_eq_v (no v_proj)"]
    fused = json.loads(run_cli("inspect", "--json",
                               synthetic_cache("31b", "target", fused_qkv=True, multimodal=False)).out)
    assert {r["attention"] for r in fused["layers"]} == {"fused qkv_proj"}
    assert measured_or_expected(fused["vllm_0_27"]["transformers<5.15"], "fails")
    assistant = json.loads(run_cli("inspect", "--json", synthetic_cache("31b", "pair") / "assistant").out)
    assert {r["attention"] for r in assistant["layers"]} == {"Q-only (KV shared)"}
    e2b = json.loads(run_cli("inspect", "--json", synthetic_cache("e2b", "pair", multimodal=False) / "target").out)
    assert [r["attention"] for r in e2b["layers"]] == ["split q/k/v"] * 5 + ["KV shared (own k/v unused)"] * 5


def test_text_output_and_costs_of_the_real_31b_geometry(tmp_path, run_cli):
    """Headers only, so a full-width 31B target costs nothing to inspect; KV numbers match
    docs/DESIGN.md "The pad-global transform: placement math"."""
    from converter.read.safetensors_header import encode_header
    from matrix.synthetic import scaled_preset, target_config, target_tensors
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
    weights = report["weight_bytes"]  # pad-global adds 6.94 G parameters to the 31B target:
    # docs/DESIGN.md "The pad-global transform: placement math"
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
    assert result.code == 3 and "SHAPE MISMATCH" in result.out and "PROBLEM:" in result.out
    assert result.err.count("\n") == 1 and result.err.startswith("error: 5 problem(s) reported; the first: ")
    assert "layers.5.self_attn.k_norm.weight has shape [32]" in result.err
    report = json.loads(run_cli("inspect", "--json", src).out)
    assert len(report["problems"]) == 5  # every contradicting tensor, not only the first
    verdict = report["vllm_0_27"]["transformers<5.15"]
    assert verdict["outcome"] == "fails" and verdict["outcome"] != "loads"
    # the real loader raises this for such a checkpoint (tests/test_vllm_predictions.py): k_norm is read first
    assert verdict["error"] == "AssertionError: Attempted to load weight (torch.Size([32])) into parameter " \
                               "(torch.Size([64]))"
    assert "k_norm.weight" in verdict["detail"] and "weight_utils.py:1240" in verdict["detail"]
    by_tensor = {w["tensor"].split("self_attn.")[1]: w for w in report["vllm_0_27"]["weights"]}
    assert set(by_tensor) == {"k_norm.weight", "k_proj.weight", "o_proj.weight", "q_norm.weight", "q_proj.weight"}
    assert by_tensor["k_proj.weight"]["error"] == "RuntimeError: start (0) + length (256) exceeds dimension size (128)"
    assert by_tensor["o_proj.weight"]["where"] == "model_executor/parameter.py:222"
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


def _set_text(src, **values):
    config = read_config(src)
    text_config(config).update(values)
    (src / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("role, edit, outcome, fragment", [
    # too few rows for the draft's ColumnParallelLinear q_proj / RowParallelLinear o_proj: torch's narrow raises
    ("assistant", {"num_attention_heads": 64}, "fails", "RuntimeError: start (0) + length (1024) exceeds dimension "
                                                        "size (512)"),
    # too many rows for the target's QKV slots: cut silently, vLLM loads without a word
    ("target", {"num_key_value_heads": 8}, "loads wrong", "silently truncates [256, 336] to its first 128 rows"),
])
def test_prediction_names_the_error_or_the_truncated_tensor(synthetic_cache, tmp_path, run_cli, role, edit, outcome,
                                                           fragment):
    import shutil
    src = tmp_path / role
    shutil.copytree(synthetic_cache("31b", "pair") / role, src)
    _set_text(src, **edit)
    result = run_cli("inspect", "--json", src)
    assert result.code == 3, result.err
    verdict = json.loads(result.out)["vllm_0_27"]["transformers<5.15"]
    assert verdict["outcome"] == outcome
    assert fragment in (verdict["error"] or "") + verdict["detail"]
    text = run_cli("inspect", src)
    assert text.code == 3 and f"with transformers<5.15: {outcome}" in text.out


def test_clean_checkpoints_exit_0_and_mixed_attention_dtypes_exit_3(synthetic_cache, tmp_path, run_cli):
    import shutil
    import struct
    pair = synthetic_cache("31b", "pair")
    assert run_cli("inspect", pair / "target").code == 0
    src = tmp_path / "assistant"
    shutil.copytree(pair / "assistant", src)
    path = src / "model.safetensors"
    blob = path.read_bytes()
    (length,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + length])
    name = next(k for k in sorted(header) if k.endswith("layers.0.self_attn.q_proj.weight"))
    header[name]["dtype"] = "F16"  # same size as BF16: only the header changes
    raw = json.dumps(header, separators=(",", ":")).encode().ljust(length)
    assert len(raw) == length
    path.write_bytes(struct.pack("<Q", length) + raw + blob[8 + length:])
    result = run_cli("inspect", src)
    assert result.code == 3
    assert "attention tensors mix dtypes (BF16 x" in result.err and f"{name} is F16" in result.err


def test_q_only_kv_shared_target_layers_are_predicted_to_fail_in_vllm(synthetic_cache, tmp_path, run_cli):
    """transformers ignores a KV-shared layer's k/v, so no problem (exit 0); vLLM 0.27 builds them anyway and its
    load check names the missing k_norm (ValueError, as tests/test_vllm_loader.py saw the real loader raise)."""
    import shutil
    from safetensors.torch import load_file, save_file
    src = tmp_path / "e2b"
    shutil.copytree(synthetic_cache("e2b", "pair", multimodal=False) / "target", src)
    for path in src.glob("*.safetensors"):
        tensors = load_file(path)
        kept = {n: t for n, t in tensors.items() if not (".layers.9.self_attn." in n and
                                                          any(m in n for m in ("k_proj", "v_proj", "k_norm")))}
        assert len(kept) < len(tensors) or "layers.9." not in " ".join(tensors)
        save_file(kept, path, metadata={"format": "pt"})
    if (src / "model.safetensors.index.json").exists():
        index = json.loads((src / "model.safetensors.index.json").read_text())
        index["weight_map"] = {n: f for n, f in index["weight_map"].items()
                               if not (".layers.9.self_attn." in n and any(m in n for m in ("k_proj", "v_proj", "k_norm")))}
        (src / "model.safetensors.index.json").write_text(json.dumps(index))
    result = run_cli("inspect", "--json", src)
    assert result.code == 0, result.err
    report = json.loads(result.out)
    assert report["problems"] == [] and report["layers"][9]["attention"] == "Q-only (KV shared)"
    verdict = report["vllm_0_27"]["transformers<5.15"]
    assert verdict["outcome"] == "fails" and verdict["error"].startswith(
        "ValueError: Following weights were not initialized from checkpoint: {...layers.9.self_attn.k_norm.weight")


def _scheme_problem_target(tmp_path, case: str):
    """A target breaking one of the scheme checks in many places at once; returns (dir, the tensors at fault)."""
    from matrix.synthetic import modelopt_nvfp4_config, scaled_preset, tiny_preset, write_checkpoint
    src = tmp_path / case
    if case == "modelopt-quantized-attention":
        preset = tiny_preset("31b")
        write_checkpoint(src, preset=preset, role="target", multimodal=False,
                         quantization=modelopt_nvfp4_config(exclude=("lm_head",)))
        config = read_config(src)
        want = set()
        for i, kind in enumerate(config["layer_types"]):
            k_eq_v = kind == "full_attention" and config["attention_k_eq_v"]
            want |= {f"model.layers.{i}.self_attn.{m}_proj is quantized" for m in ("qko" if k_eq_v else "qkvo")}
        return src, want
    preset = scaled_preset("26b-a4b", width_divisor=64, num_layers=6, vocab_size=64)
    write_checkpoint(src, preset=preset, role="target", multimodal=False)
    config = read_config(src)
    config["moe_intermediate_size"] = 12  # every layer's fused experts now contradict the config
    (src / "config.json").write_text(json.dumps(config))
    return src, {f"model.layers.{i}.experts.{p} has shape" for i in range(6) for p in ("gate_up_proj", "down_proj")}


@pytest.mark.parametrize("case", ["modelopt-quantized-attention", "moe-experts-wrong-width"])
def test_every_scheme_problem_is_listed_and_convert_refuses_with_the_first(tmp_path, run_cli, case):
    src, want = _scheme_problem_target(tmp_path, case)
    result = run_cli("inspect", "--json", src)
    assert result.code == 3
    # packed fp4 attention weights also contradict the geometry (half the columns): those are listed besides
    problems = [p for p in json.loads(result.out)["problems"] if any(w in p for w in want)]
    assert {w for w in want for p in problems if w in p} == want and len(problems) == len(want), problems
    convert = run_cli("convert", src, "--out", tmp_path / "out", "--layout", "per-layer")
    assert convert.code == 3 and convert.err.strip() == f"error: {problems[0]}"
    assert not (tmp_path / "out").exists()

"""Compressed-tensors FP8 targets: exact under both layouts, verified; other schemes refused in one line.

Block-quantized weights (strategy "block", RedHatAI/gemma-4-31B-it-FP8-block) come from compressed-tensors itself
(config, scales and fp8 values) and are dequantized here with its own `dequantize`; the tiny preset (head_dim 16)
uses 8x8 blocks, which sit on the head dims the way 128x128 blocks sit on head_dim 256.
"""

import json

import pytest
import torch

from _checkpoints import load_tensors, read_config, same_bytes
from matrix.synthetic import fp8_quantization_config, tiny_preset, write_pair
from converter.transforms import pad_head_columns, pad_head_rows, replicate_kv_heads

IGNORED = r"re:.*layers\.1\.self_attn\.o_proj"
PREFIX = "model.language_model.layers."


BLOCK = (8, 8)
SCHEMES = {"channel": "float8 channel (float-quantized)", "tensor": "float8 tensor (float-quantized)",
           "block": "float8 block 8x8 (float-quantized)"}


@pytest.fixture(scope="module", params=["channel", "tensor", "block"])
def fp8_pair(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"fp8-{request.param}")
    write_pair(root / "src", preset=tiny_preset("31b"), num_shards=2,
               quantization=fp8_quantization_config(request.param, ignore=(IGNORED,), block=BLOCK))
    return root / "src", request.param


def _dequantized(tensors, module):
    weight, scale = tensors[module + ".weight"], tensors.get(module + ".weight_scale")
    if scale is None:
        return weight.float()
    if scale.dim() == 2 and scale.shape[1] > 1:  # block scales: compressed-tensors' own dequantize
        from compressed_tensors.quantization.lifecycle.forward import dequantize
        from matrix.synthetic import preset_scheme
        args = preset_scheme("FP8_BLOCK", block_structure=list(BLOCK)).weights
        return dequantize(weight, scale, None, args, dtype=torch.float32)
    return weight.float() * scale.float()


def test_pad_global_moves_fp8_rows_with_their_scales(fp8_pair, tmp_path, run_cli):
    src, strategy = fp8_pair
    out = tmp_path / "out"
    result = run_cli("convert", "--target", src / "target", "--assistant", src / "assistant", "--out", out,
                     "--layout", "pad-global")
    assert result.code == 0, result.err
    source, output = load_tensors(src / "target"), load_tensors(out / "target")
    assert read_config(out / "target")["quantization_config"] == read_config(src / "target")["quantization_config"]
    for layer in range(5):  # sliding: rows padded with their per-channel scales; per-tensor scales unchanged
        for module, heads in (("q_proj", 32), ("k_proj", 16), ("v_proj", 16)):
            name = f"{PREFIX}{layer}.self_attn.{module}"
            assert output[name + ".weight"].dtype == torch.float8_e4m3fn
            want = pad_head_rows(_dequantized(source, name), num_heads=heads, head_dim=16, target_head_dim=32)
            assert torch.equal(_dequantized(output, name), want), name
            if strategy == "tensor":
                assert torch.equal(output[name + ".weight_scale"], source[name + ".weight_scale"])
        o_proj = f"{PREFIX}{layer}.self_attn.o_proj"
        want = pad_head_columns(_dequantized(source, o_proj), num_heads=32, head_dim=16, target_head_dim=32)
        assert torch.equal(_dequantized(output, o_proj), want)
        if strategy != "block":  # per-row / per-tensor scales do not change; block scale columns spread x2
            assert torch.equal(output.get(o_proj + ".weight_scale", torch.empty(0)),
                               source.get(o_proj + ".weight_scale", torch.empty(0)))
    assert output[f"{PREFIX}1.self_attn.o_proj.weight"].dtype == torch.bfloat16  # ignored: stays bf16, padded
    k_proj = f"{PREFIX}5.self_attn.k_proj"  # full k_eq_v: heads replicated together with their scales
    want = replicate_kv_heads(_dequantized(source, k_proj), num_heads=4, head_dim=32, repeats=4)
    assert torch.equal(_dequantized(output, k_proj), want)


def test_fp8_pair_verifies(fp8_pair, tmp_path, run_cli):
    src, _ = fp8_pair
    out = tmp_path / "out"
    assert run_cli("convert", "--target", src / "target", "--assistant", src / "assistant", "--out", out,
                   "--layout", "pad-global").code == 0
    result = run_cli("verify", "--target", src / "target", "--assistant", src / "assistant", "--converted", out,
                     "--device", "cpu")
    assert result.code == 0, result.out
    report = json.loads((out / "verification.json").read_text())
    assert report["structural"]["transformed"] > 0 and all(layer["passed"] for layer in report["layers"])


def test_per_layer_keeps_fp8_untouched(fp8_pair, tmp_path, run_cli):
    src, _ = fp8_pair
    out = tmp_path / "out"
    assert run_cli("convert", src / "target", "--out", out, "--layout", "per-layer").code == 0
    assert read_config(out)["quantization_config"] == read_config(src / "target")["quantization_config"]
    source, output = load_tensors(src / "target"), load_tensors(out)
    assert source.keys() == output.keys()
    assert all(same_bytes(output[k], source[k]) for k in source)


def test_inspect_reports_the_scheme_per_layer(fp8_pair, run_cli):
    src, strategy = fp8_pair
    report = json.loads(run_cli("inspect", "--json", src / "target").out)
    assert report["quantization"]["method"] == "compressed-tensors"
    assert report["quantization"]["attention_schemes"] == [SCHEMES[strategy]]
    assert report["layers"][1]["quantization"]["o_proj"] == "unquantized (ignored)"
    assert report["layers"][0]["quantization"]["q_proj"] == SCHEMES[strategy]
    assert "v_proj" not in report["layers"][5]["quantization"]  # k_eq_v layer


def _with_quantization(src, tmp_path, config):
    import shutil
    target = tmp_path / "target"
    shutil.copytree(src / "target", target)
    document = read_config(target)
    document["quantization_config"] = config
    (target / "config.json").write_text(json.dumps(document))
    return target


GROUPED_FP8 = {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
               "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                   "type": "float", "num_bits": 8, "strategy": "group", "group_size": 128}}}}
INT4_GROUP = {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
              "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                  "type": "int", "num_bits": 4, "strategy": "group", "group_size": 128}}}}
BLOCK_UNTILED = fp8_quantization_config("block", block=(24, 8))  # 24-row blocks do not tile q_proj's 512 rows
BLOCK_ODD_COLUMNS = fp8_quantization_config("block", block=(8, 7))
NVFP4 = {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "ignore": ["lm_head"],
         "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
             "type": "float", "num_bits": 4, "strategy": "tensor_group", "group_size": 16}}}}


@pytest.mark.parametrize("config, words", [
    (GROUPED_FP8, "float8 group 128 (float-quantized); its scale groups would straddle original and padding"),
    # a group of 128 over 16-wide heads spans 8 of them (issue 53: this said "straddle two halves of a head")
    (INT4_GROUP, "o_proj is quantized as int4 group 128 (pack-quantized); its groups of 128 input columns span "
                 "8 heads of 16 columns each"),
    (NVFP4, "float4 tensor_group 16 (nvfp4-pack-quantized)"),
    (BLOCK_UNTILED, "float8 block 24x8 (float-quantized); its 24-row scale blocks do not tile the 512 rows of "
                    "q_proj (32 heads x 16)"),
    (BLOCK_ODD_COLUMNS, "self_attn.o_proj is quantized as float8 block 8x7 (float-quantized); its 7-column scale "
                        "blocks cannot follow columns spread x2"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128}, "quantized as gptq"),
])
def test_unsupported_schemes_are_refused_in_one_line(fp8_pair, tmp_path, run_cli, config, words):
    src, _ = fp8_pair
    target = _with_quantization(src, tmp_path, config)
    result = run_cli("convert", target, "--out", tmp_path / "out", "--layout", "pad-global")
    assert result.code == 3 and words in result.err
    assert len(result.err.strip().splitlines()) == 1 and "Traceback" not in result.err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("broken, words", [
    ({**GROUPED_FP8, "config_groups": [GROUPED_FP8["config_groups"]["group_0"]]}, "config_groups must be an object"),
    ({**GROUPED_FP8, "ignore": 3}, "ignore must be a list of strings"),
    ({**GROUPED_FP8, "config_groups": {"g": {"targets": "Linear", "weights": {}}}}, "targets must be a list"),
])
def test_malformed_quantization_config_is_bad_input(fp8_pair, tmp_path, run_cli, broken, words):
    src, _ = fp8_pair
    target = _with_quantization(src, tmp_path, broken)
    for args in (("inspect", target), ("convert", target, "--out", tmp_path / "out", "--layout", "pad-global")):
        result = run_cli(*args)
        assert result.code == 3 and words in result.err and len(result.err.strip().splitlines()) == 1


def test_fp8_block_config_is_compressed_tensors_fp8_block_preset():
    """At the published block size the factory's config is the FP8_BLOCK preset compressed-tensors ships."""
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
    config = fp8_quantization_config("block")
    parsed = QuantizationConfig.model_validate({k: v for k, v in config.items()
                                                if k not in ("version", "sparsity_config", "transform_config")})
    assert parsed.config_groups["group_0"] == preset_name_to_scheme("FP8_BLOCK", ["Linear"])
    weights = config["config_groups"]["group_0"]["weights"]
    assert (weights["strategy"], weights["block_structure"]) == ("block", [128, 128])


def test_fp8_block_scales_are_one_per_block(tmp_path):
    from matrix.synthetic import write_checkpoint
    target = write_checkpoint(tmp_path / "t", preset=tiny_preset("31b"), role="target",
                              quantization=fp8_quantization_config("block", block=BLOCK))
    tensors = load_tensors(target)
    q = f"{PREFIX}0.self_attn.q_proj"
    assert tensors[q + ".weight"].dtype == torch.float8_e4m3fn
    assert tuple(tensors[q + ".weight_scale"].shape) == (32 * 16 // 8, 336 // 8)


# ------------------------------------------------------------------ fused qkv_proj with block scales

def _fused_rows(layer: int) -> dict[str, tuple[int, int]]:
    """q/k/v row ranges of the tiny 31B preset's fused qkv_proj (sliding: 32x16 | 16x16 | 16x16; layer 5 full,
    k_eq_v: 32x32 | 4x32)."""
    if layer == 5:
        return {"q_proj": (0, 1024), "k_proj": (1024, 1152)}
    return {"q_proj": (0, 512), "k_proj": (512, 768), "v_proj": (768, 1024)}


@pytest.fixture(scope="module")
def fused_block_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8-block-fused")
    write_pair(root / "src", preset=tiny_preset("31b"), fused_qkv=True, num_shards=2,
               quantization=fp8_quantization_config("block", block=BLOCK))
    return root / "src"


@pytest.mark.parametrize("layout", ["per-layer", "pad-global"])
def test_fused_qkv_block_scales_split_exactly(fused_block_pair, tmp_path, run_cli, layout):
    src, out = fused_block_pair, tmp_path / "out"
    result = run_cli("convert", "--target", src / "target", "--assistant", src / "assistant", "--out", out,
                     "--layout", layout)
    assert result.code == 0, result.err
    source, output = load_tensors(src / "target"), load_tensors(out / "target")
    assert not any(".qkv_proj." in name for name in output)
    for layer in range(6):
        fused = {p: source[f"{PREFIX}{layer}.self_attn.qkv_proj.{p}"] for p in ("weight", "weight_scale")}
        for module, (start, stop) in _fused_rows(layer).items():
            name = f"{PREFIX}{layer}.self_attn.{module}"
            piece = {"weight": fused["weight"][start:stop],
                     "weight_scale": fused["weight_scale"][start // BLOCK[0]:stop // BLOCK[0]]}
            if layout == "per-layer":  # the bytes of the fused rows and of their scale rows, nothing else
                assert same_bytes(output[name + ".weight"], piece["weight"])
                assert torch.equal(output[name + ".weight_scale"], piece["weight_scale"]), name
            elif layer < 5:  # sliding rows padded 16 -> 32 per head, dequantized values kept
                heads = (stop - start) // 16
                want = pad_head_rows(_dequantized({"w.weight": piece["weight"], "w.weight_scale": piece["weight_scale"]},
                                                  "w"), num_heads=heads, head_dim=16, target_head_dim=32)
                assert torch.equal(_dequantized(output, name), want), name
    verify = run_cli("verify", "--target", src / "target", "--assistant", src / "assistant", "--converted", out)
    assert verify.code == 0, verify.err


def test_fused_qkv_block_straddling_projections_is_refused_by_name(tmp_path, run_cli):
    """32-row blocks on sliding layers whose k_proj and v_proj have 16 rows each (1 KV head x 16): one scale row
    would hold k and v rows both, so no exact split exists."""
    from dataclasses import replace
    preset = replace(tiny_preset("31b"), num_kv_heads=1, num_global_kv_heads=1)
    # o_proj and MLP rows (336) are no multiple of 32: left unquantized, only the fused qkv_proj has 32-row blocks
    config = fp8_quantization_config("block", block=(32, 8), ignore=("re:.*mlp.*", r"re:.*o_proj"))
    write_pair(tmp_path / "src", preset=preset, fused_qkv=True, quantization=config)
    words = {"per-layer": "layers.0.self_attn.qkv_proj.weight_scale holds float8 block 32x8 (float-quantized) "
                          "scales of a fused q/k/v weight, but k_proj has 16 rows, not a multiple of the 32-row block",
             # pad-global refuses such blocks before splitting: they do not tile k_proj's rows either
             "pad-global": "layers.0.self_attn.k_proj is quantized as float8 block 32x8 (float-quantized); its "
                           "32-row scale blocks do not tile the 16 rows of k_proj (1 heads x 16)"}
    for layout, want in words.items():
        result = run_cli("convert", "--target", tmp_path / "src" / "target", "--assistant",
                         tmp_path / "src" / "assistant", "--out", tmp_path / layout, "--layout", layout)
        assert result.code == 3 and result.err.count("\n") == 1 and want in result.err, result.err
        assert not (tmp_path / layout).exists()


# ------------------------------------------------------------------ block as tall as the head (issue 25)

@pytest.mark.parametrize("block", [(16, 16), (32, 8)])
def test_pad_global_is_exact_for_blocks_as_tall_as_a_head_or_taller(tmp_path, run_cli, block):
    """16-row blocks on head_dim 16 (as 128-row blocks on head_dim 128) and 32-row blocks spanning two heads: padding
    repeats row j at j*r .. j*r + r - 1, so every output block still reads one source block and its scale."""
    # 32-row blocks do not tile o_proj's or the MLP's 336 rows: those stay bf16, the q/k/v blocks are the subject
    ignore = (IGNORED,) if block[0] == 16 else (IGNORED, "re:.*mlp.*", r"re:.*o_proj")
    write_pair(tmp_path / "src", preset=tiny_preset("31b"), num_shards=1,
               quantization=fp8_quantization_config("block", ignore=ignore, block=block))
    out = tmp_path / "out"
    result = run_cli("convert", "--target", tmp_path / "src" / "target", "--assistant", tmp_path / "src" / "assistant",
                     "--out", out, "--layout", "pad-global")
    assert result.code == 0, result.err
    from compressed_tensors.quantization.lifecycle.forward import dequantize
    from matrix.synthetic import preset_scheme
    scheme = preset_scheme("FP8_BLOCK", block_structure=list(block)).weights
    source, output = load_tensors(tmp_path / "src" / "target"), load_tensors(out / "target")
    for module, heads in (("q_proj", 32), ("k_proj", 16), ("v_proj", 16)):
        name = f"{PREFIX}0.self_attn.{module}"
        src = dequantize(source[name + ".weight"], source[name + ".weight_scale"], None, scheme, dtype=torch.float32)
        got = dequantize(output[name + ".weight"], output[name + ".weight_scale"], None, scheme, dtype=torch.float32)
        assert torch.equal(got, pad_head_rows(src, num_heads=heads, head_dim=16, target_head_dim=32)), name
        assert output[name + ".weight_scale"].shape[0] == 2 * source[name + ".weight_scale"].shape[0]
    assert run_cli("verify", "--target", tmp_path / "src" / "target", "--assistant", tmp_path / "src" / "assistant",
                   "--converted", out, "--device", "cpu").code == 0


@pytest.mark.parametrize("head_dim", [128, 256])
def test_128_row_blocks_move_exactly_at_real_head_dims(head_dim):
    """RedHatAI's FP8-block layout (128x128, compressed-tensors' own quantizer) at head_dim 128 and 256 padded x2:
    codes and scales moved by the pad-global transforms dequantize to the padded original, bit for bit."""
    from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize
    from compressed_tensors.quantization.utils import calculate_qparams
    from matrix.synthetic import preset_scheme
    from converter.transforms import repeat_rows

    heads, hidden = 2, 256
    scheme = preset_scheme("FP8_BLOCK", block_structure=[128, 128]).weights
    weight = torch.randn(heads * head_dim, hidden, generator=torch.Generator().manual_seed(head_dim))
    blocks = weight.reshape(heads * head_dim // 128, 128, hidden // 128, 128).permute(0, 2, 1, 3)
    amax = blocks.abs().amax(dim=(2, 3))
    scale, _ = calculate_qparams(-amax, amax, scheme)  # symmetric: no zero point
    codes = quantize(weight, scale, None, scheme, dtype=torch.float8_e4m3fn)
    original = dequantize(codes, scale, None, scheme, dtype=torch.float32)
    padded_codes = pad_head_rows(codes, num_heads=heads, head_dim=head_dim, target_head_dim=2 * head_dim)
    padded_scale = repeat_rows(scale, repeats=2)
    got = dequantize(padded_codes, padded_scale, None, scheme, dtype=torch.float32)
    assert torch.equal(got, pad_head_rows(original, num_heads=heads, head_dim=head_dim, target_head_dim=2 * head_dim))


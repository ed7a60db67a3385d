"""Google's QAT W4A16 layout (compressed-tensors pack-quantized int4, group 32, weight-only) at the tiny head sizes:
what the factory writes, and pad-global's refusal by name where a group of 32 straddles both halves of a 32-wide
head. At the real head sizes (256 / 512) it moves exactly: tests/test_compressed_tensors_schemes.py, beside the other
schemes. The stock vLLM loader rows are in scripts/matrix/cases.py ("31b-w4a16", "31b-w4a16-real-heads")."""

from __future__ import annotations

import pytest

from _checkpoints import load_tensors, read_config
from matrix.synthetic import tiny_preset, w4a16_quantization_config, write_pair


@pytest.fixture(scope="module")
def w4a16_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("w4a16")
    write_pair(root, preset=tiny_preset("31b", width_divisor=8), num_shards=2, multimodal=False,
               quantization=w4a16_quantization_config())
    return root


def test_the_factory_writes_what_the_qat_checkpoints_hold(w4a16_pair):
    tensors = load_tensors(w4a16_pair / "target")
    q = "model.layers.0.self_attn.q_proj"
    assert tensors[q + ".weight_packed"].dtype.is_floating_point is False
    assert tuple(tensors[q + ".weight_packed"].shape) == (1024, 672 // 8)  # 8 int4 values per int32
    assert tuple(tensors[q + ".weight_scale"].shape) == (1024, 672 // 32)  # one scale per 32 input columns
    assert tensors[q + ".weight_shape"].tolist() == [1024, 672]
    assert "model.layers.5.self_attn.v_proj.weight_packed" not in tensors  # k_eq_v full layer: no v_proj
    weights = read_config(w4a16_pair / "target")["quantization_config"]["config_groups"]["group_0"]["weights"]
    assert (weights["num_bits"], weights["group_size"], weights["symmetric"]) == (4, 32, True)


def test_pad_global_refuses_groups_that_straddle_half_a_head(w4a16_pair, tmp_path, run_cli):
    """32-wide heads: a group of 32 input columns of o_proj spans both halves of a head, so after padding one group
    would mix codes of two source groups; refused by name, nothing written."""
    result = run_cli("convert", "--target", w4a16_pair / "target", "--assistant", w4a16_pair / "assistant",
                     "--out", tmp_path / "out", "--layout", "pad-global")
    assert result.code == 3 and "o_proj is quantized as int4 group 32 (pack-quantized)" in result.err, result.err
    assert "groups of 32 input columns straddle two halves of a 32-wide head" in result.err
    assert "--layout per-layer" in result.err and result.err.count("\n") == 1
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("group, width, said", [
    (32, 8, "its groups of 32 input columns span 4 heads of 8 columns each"),
    (48, 32, "its groups of 48 input columns span 1.50 heads of 32 columns each"),
    (32, 32, "its groups of 32 input columns straddle two halves of a 32-wide head"),
    (16, 24, "its groups of 16 input columns straddle two halves of a 24-wide head"),
])
def test_the_pack_quantized_refusal_states_the_geometry(group, width, said):
    """A group wider than a head spans whole heads (issue 53: "straddle two halves of a 8-wide head" was said of a
    group of 32 over four heads of 8)."""
    from converter.gemma4 import LayerGeometry
    from converter.layouts.pad_global import _packed_problem
    from converter.quantization import COMPRESSED_TENSORS, WeightScheme

    scheme = WeightScheme(method=COMPRESSED_TENSORS, format="pack-quantized", type="int", num_bits=4,
                          strategy="group", group_size=group)
    layer = LayerGeometry(index=0, layer_type="sliding_attention", head_dim=width, num_kv_heads=1, k_eq_v=False,
                          kv_shared=False)
    assert _packed_problem(scheme, "o_proj", layer).startswith(said)
    assert _packed_problem(scheme, "q_proj", layer) is None

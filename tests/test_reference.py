"""converter/proof/reference.py against transformers 5.23's own Gemma 4 modules, an implementation this project does
not own.

Tiny random configs with real Gemma 4 shape rules (sliding d=16 / full D=32, k_eq_v full layers with fewer KV
heads, proportional RoPE 0.25, sliding window shorter than the sequence). Weights are seeded, at realistic scales:
linear weights N(0, 1/fan_in), norm weights U(0.5, 1.5), and q_norm / k_norm weights scaled by head_dim^-1/4 so
that with Gemma 4's attention scaling of 1.0 the attention logits are O(1) as in a trained model (weights near 1
would give logits ~ sqrt(head_dim) and a saturated, argmax-like softmax that hides errors).

Tolerances. The reference mirrors transformers' eager path op by op and dtype by dtype; measured on this CPU
(torch 2.13.0) every bf16 output and most fp32 outputs are BITWISE equal, the rest differ by <= 9e-7 relative
(fp32 matmul blocking). We assert fp32 max_rel <= 1e-5 (an order above the measured worst, far below any real
bug, which shows up at 1e-2..1) and bf16 max_rel <= 1e-2 with cosine >= 0.9999 (room for a few 1-ulp flips, 2^-8
relative each, should another kernel accumulate in another order). transformers runs with
attn_implementation="eager" and experts_implementation="eager" (the paths the reference mirrors; the default
grouped_mm experts kernel rounds bf16 differently, ~2e-2 rel_rms on logits); sdpa is exercised in
tests/test_equivalence.py.
"""

from __future__ import annotations

import pytest
import torch

from _models import cast_like_from_pretrained as to_dtype
from transformers import Gemma4TextConfig
from transformers.cache_utils import KVSharingDict
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.models.gemma4.modeling_gemma4 import Gemma4ForCausalLM
from transformers.models.gemma4_assistant.configuration_gemma4_assistant import Gemma4AssistantConfig
from transformers.models.gemma4_assistant.modeling_gemma4_assistant import Gemma4AssistantForCausalLM

from converter.proof import reference as ref
from matrix import text_model

SEQ = 12
WINDOW = 4
VOCAB = 64
S, F_ = "sliding_attention", "full_attention"

FP32_MAX_REL = 1e-5
BF16_MAX_REL = 1e-2
BF16_COSINE = 0.9999


# ----------------------------------------------------------------------------------------------- helpers


def text_config(**overrides) -> Gemma4TextConfig:
    """31B-style tiny target: k_eq_v full layers, no per-layer embeddings, dense MLP."""
    kwargs = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
        attention_k_eq_v=True, sliding_window=WINDOW, layer_types=[S, S, F_, S, S, F_],
        hidden_size_per_layer_input=0, vocab_size_per_layer_input=0, final_logit_softcapping=30.0,
        attn_implementation="eager",
    )
    kwargs.update(overrides)
    return Gemma4TextConfig(**kwargs)


def e2b_style(**overrides) -> Gemma4TextConfig:
    """E2B-style: own v_proj on full layers, per-layer embeddings, the last layers KV-shared."""
    return text_config(attention_k_eq_v=False, num_global_key_value_heads=None, hidden_size_per_layer_input=8,
                       vocab_size_per_layer_input=VOCAB, num_kv_shared_layers=2, **overrides)


def moe_style(**overrides) -> Gemma4TextConfig:
    """26B-A4B-style: a MoE branch beside the dense MLP in every layer."""
    return text_config(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32,
                       experts_implementation="eager", **overrides)


def randomize_(module: torch.nn.Module, *, seed: int) -> None:
    """Seeded realistic weights in place (see the module docstring)."""
    gen = torch.Generator().manual_seed(seed)
    state = module.state_dict()
    for name in sorted(state):
        tensor = state[name]
        if "inv_freq" in name or "embed_scale" in name:
            continue
        if name.endswith("token_ordering"):
            tensor.copy_(torch.randperm(tensor.numel(), generator=gen))
        elif tensor.dim() >= 2:
            tensor.copy_(torch.randn(tensor.shape, generator=gen) / tensor.shape[-1] ** 0.5)
        elif name.endswith(("q_norm.weight", "k_norm.weight")):
            tensor.copy_((0.5 + torch.rand(tensor.shape, generator=gen)) * tensor.shape[0] ** -0.25)
        elif name.endswith("layer_scalar"):
            tensor.copy_(0.5 + 0.5 * torch.rand(tensor.shape, generator=gen))
        else:
            tensor.copy_(0.5 + torch.rand(tensor.shape, generator=gen))


def store_kv_of_producers(model: Gemma4ForCausalLM) -> None:
    """Make the last non-shared layer of each type publish its K/V into shared_kv_states.

    transformers only marks producers as "store" when num_kv_shared_layers > 0 (Gemma4TextConfig.kv_sharing_modes);
    the 31B target has 0, so nothing would be stored. The flag is the one the module itself reads.
    """
    spec = ref.text_spec_from_config(model.config.to_dict())
    for index in spec.kv_producers.values():
        model.model.layers[index].self_attn.store_full_length_kv = True


def build_target(config: Gemma4TextConfig, *, seed: int, dtype: torch.dtype) -> Gemma4ForCausalLM:
    torch.manual_seed(seed)
    model = Gemma4ForCausalLM(config).eval()
    randomize_(model, seed=seed)
    store_kv_of_producers(model)
    return to_dtype(model, dtype)


def build_assistant(text: Gemma4TextConfig, *, backbone: int, seed: int, dtype: torch.dtype,
                    ordered: bool = False) -> Gemma4AssistantForCausalLM:
    config = Gemma4AssistantConfig(text_config=text.to_dict(), backbone_hidden_size=backbone,
                                   use_ordered_embeddings=ordered, num_centroids=8, centroid_intermediate_top_k=2)
    config.text_config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = Gemma4AssistantForCausalLM(config).eval()
    randomize_(model, seed=seed)
    return to_dtype(model, dtype)


def target_weights(model: Gemma4ForCausalLM) -> dict[str, torch.Tensor]:
    weights = ref.sub_weights(model.state_dict(), "model.")
    weights["lm_head.weight"] = model.lm_head.weight
    return weights


def assert_close(expected: torch.Tensor, actual: torch.Tensor, dtype: torch.dtype) -> ref.ErrorStats:
    stats = ref.compare_outputs(expected, actual)
    if dtype == torch.float32:
        assert stats.max_rel <= FP32_MAX_REL, stats
    else:
        assert stats.max_rel <= BF16_MAX_REL and stats.cosine >= BF16_COSINE, stats
    return stats


DTYPES = [torch.float32, torch.bfloat16]
IDS = ["fp32", "bf16"]


# ------------------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("make_config,layer", [(text_config, 0), (text_config, 2), (e2b_style, 2)],
                         ids=["sliding", "full-k_eq_v", "full-own-v"])
def test_attention_block_matches_transformers(make_config, layer, dtype):
    model = build_target(make_config(), seed=1, dtype=dtype)
    attn = model.model.layers[layer].self_attn
    attn.store_full_length_kv = True
    hidden = torch.randn(2, SEQ, 64, generator=torch.Generator().manual_seed(2)).to(dtype)
    positions = torch.arange(SEQ)[None]
    layer_type = model.config.layer_types[layer]
    make_mask = create_sliding_window_causal_mask if layer_type == S else create_causal_mask
    mask = make_mask(config=model.config, inputs_embeds=hidden, attention_mask=None, past_key_values=None,
                     position_ids=positions)
    shared = KVSharingDict()
    with torch.no_grad():
        expected, _ = attn(hidden_states=hidden, attention_mask=mask, shared_kv_states=shared,
                           position_embeddings=model.model.rotary_emb(hidden, positions, layer_type))
    spec = ref.text_spec_from_config(model.config.to_dict()).layers[layer]
    got = ref.attention_block(hidden, ref.sub_weights(attn.state_dict(), ""), **spec.attention_kwargs())
    assert_close(expected, got.out, dtype)
    assert_close(shared[layer_type][0], got.key, dtype)
    assert_close(shared[layer_type][1], got.value, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("make_config", [text_config, e2b_style, moe_style], ids=["31b", "e2b", "moe"])
def test_text_forward_matches_transformers(make_config, dtype):
    model = build_target(make_config(), seed=3, dtype=dtype)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = model(input_ids=ids, return_shared_kv_states=True, use_cache=False)
    got = text_model.text_forward(target_weights(model), spec=ref.text_spec_from_config(model.config.to_dict()),
                           input_ids=ids)
    assert_close(expected.logits, got.logits, dtype)
    for layer_type in (S, F_):
        assert_close(expected.shared_kv_states[layer_type][0], got.shared_kv[layer_type][0], dtype)
        assert_close(expected.shared_kv_states[layer_type][1], got.shared_kv[layer_type][1], dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("ordered", [False, True], ids=["31b-assistant", "e2b-ordered-embeddings"])
def test_assistant_forward_matches_transformers(all_shared_kv_modes, ordered, dtype):
    target = build_target(text_config(), seed=5, dtype=dtype)
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        out = target(input_ids=ids, return_shared_kv_states=True, output_hidden_states=True, use_cache=False)
    shared = {k: v for k, v in out.shared_kv_states.items()}
    embeds = ref.assistant_inputs(target.model.embed_tokens(ids[:, -1:]), out.hidden_states[-1][:, -1:])
    assistant_text = text_config(hidden_size=32, intermediate_size=64, num_hidden_layers=4, layer_types=[S, S, S, F_])
    assistant = build_assistant(assistant_text, backbone=64, seed=7, dtype=dtype, ordered=ordered)
    positions = torch.tensor([[SEQ - 1]])
    with torch.no_grad():
        expected = assistant(inputs_embeds=embeds, position_ids=positions, shared_kv_states=shared)
    spec = ref.assistant_spec_from_config(assistant.config.to_dict())
    got = ref.assistant_forward(assistant.state_dict(), spec=spec, inputs_embeds=embeds, shared_kv=shared,
                                positions=positions)
    assert_close(expected.last_hidden_state, got.hidden, dtype)
    assert_close(expected.logits, got.logits, dtype)


def test_spec_reads_both_config_dialects():
    legacy = text_config().to_dict()
    legacy.pop("per_layer_config")
    legacy.update(global_head_dim=32, num_global_key_value_heads=1)
    per_layer = text_config().to_dict()
    assert ref.text_spec_from_config(legacy) == ref.text_spec_from_config(per_layer)
    full = ref.text_spec_from_config(per_layer).layers[2]
    assert (full.head_dim, full.num_kv_heads, full.k_eq_v, full.partial_rotary_factor) == (32, 1, True, 0.25)
    sliding = ref.text_spec_from_config(per_layer).layers[0]
    assert (sliding.head_dim, sliding.num_kv_heads, sliding.sliding_window) == (16, 2, WINDOW)


def test_assistant_spec_shares_every_layer():
    config = {"text_config": {**text_config(num_hidden_layers=4, layer_types=[S, S, S, F_]).to_dict(),
                              "num_kv_shared_layers": 0}, "backbone_hidden_size": 64}
    spec = ref.assistant_spec_from_config(config)
    assert all(layer.kv_shared for layer in spec.text.layers)
    assert spec.backbone_hidden_size == 64


def test_compare_outputs_reports_errors():
    a = torch.tensor([1.0, -2.0, 4.0])
    assert ref.compare_outputs(a, a) == ref.ErrorStats(max_abs=0.0, max_rel=0.0, rel_rms=0.0, cosine=1.0)
    stats = ref.compare_outputs(a, torch.tensor([1.0, -2.0, 3.0]))
    assert stats.max_abs == 1.0 and stats.max_rel == 0.25
    with pytest.raises(ValueError, match="shape mismatch"):
        ref.compare_outputs(a, a[:2])


def test_kv_heads_mismatch_raises():
    hidden = torch.randn(1, 4, 8)
    weights = {"q_proj.weight": torch.randn(16, 8), "q_norm.weight": torch.ones(4), "o_proj.weight": torch.randn(8, 16)}
    kv = (torch.randn(1, 3, 4, 4), torch.randn(1, 3, 4, 4))
    with pytest.raises(ValueError, match="key has 3 heads"):
        ref.attention_block(hidden, weights, num_heads=4, num_kv_heads=2, head_dim=4, k_eq_v=False,
                            rope_theta=1e4, kv=kv)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_reference_runs_on_cuda():
    """`verify` runs the reference on the GPU: same numbers as on CPU in fp32 (TF32 off, torch's default)."""
    model = build_target(text_config(), seed=8, dtype=torch.float32)
    weights, spec = target_weights(model), ref.text_spec_from_config(model.config.to_dict())
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(9))
    cpu = text_model.text_forward(weights, spec=spec, input_ids=ids)
    cuda = text_model.text_forward({k: v.cuda() for k, v in weights.items()}, spec=spec, input_ids=ids.cuda())
    assert ref.compare_outputs(cpu.logits, cuda.logits).max_rel <= 1e-4
    assert ref.compare_outputs(cpu.shared_kv[F_][0], cuda.shared_kv[F_][0]).max_rel <= 1e-4

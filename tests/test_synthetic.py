"""The factory writes what Gemma 4 checkpoints hold: transformers 5.23's own modules name the same tensors."""

import json

import pytest
import torch

from converter.gemma4 import read_spec
from matrix.synthetic import (PRESETS, assistant_tensors, target_config, target_tensors, tiny_preset,
                                         write_checkpoint)


def _meta_model(model_class, config):
    with torch.device("meta"):
        return model_class(config)


def _meta_state_dict(model_class, config):
    model = _meta_model(model_class, config)
    return {k: tuple(v.shape) for k, v in model.state_dict().items() if k != "lm_head.weight"}


def _text_config(config_dict):
    from transformers import Gemma4TextConfig
    return Gemma4TextConfig(**{k: v for k, v in config_dict.items() if k not in ("model_type", "dtype")})


@pytest.mark.parametrize("preset", ["31b", "26b-a4b", "e2b", "e4b"])
def test_text_target_names_and_shapes_match_transformers(tmp_path, preset):
    from transformers.models.gemma4.modeling_gemma4 import Gemma4ForCausalLM
    p = tiny_preset(preset)
    path = write_checkpoint(tmp_path / "t", preset=p, role="target", multimodal=False)
    config = json.loads((path / "config.json").read_text())
    model = _meta_model(Gemma4ForCausalLM, _text_config(config))
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items() if k != "lm_head.weight"}
    ours = {s.name: s.shape for s in target_tensors(p, multimodal=False)}
    # Published E2B/E4B targets also carry k_proj/v_proj/k_norm on KV-shared layers; transformers builds no such
    # modules and drops those keys on load (Gemma4TextModel._keys_to_ignore_on_load_unexpected).
    ignored = [name for name in ours if any(name.startswith("model." + key + ".")
                                            for key in model.model._keys_to_ignore_on_load_unexpected)]
    assert bool(ignored) == bool(p.num_kv_shared_layers)
    assert {k: v for k, v in ours.items() if k not in ignored} == expected


@pytest.mark.parametrize("preset", ["31b", "26b-a4b"])
def test_multimodal_target_names_and_shapes_match_transformers(tmp_path, preset):
    from transformers import Gemma4Config
    from transformers.models.gemma4.modeling_gemma4 import Gemma4ForConditionalGeneration
    p = tiny_preset(preset)
    config = json.loads((write_checkpoint(tmp_path / "t", preset=p, role="target") / "config.json").read_text())
    hf_config = Gemma4Config(text_config=_text_config(config["text_config"]),
                             vision_config={k: v for k, v in config["vision_config"].items() if k != "dtype"},
                             audio_config=None)
    expected = _meta_state_dict(Gemma4ForConditionalGeneration, hf_config)
    ours = {s.name: s.shape for s in target_tensors(p, multimodal=True)}
    assert ours == expected


@pytest.mark.parametrize("preset", ["31b", "26b-a4b", "e2b"])
def test_assistant_names_and_shapes_match_transformers(tmp_path, preset, all_shared_kv_modes):
    from transformers.models.gemma4_assistant.configuration_gemma4_assistant import Gemma4AssistantConfig
    from transformers.models.gemma4_assistant.modeling_gemma4_assistant import Gemma4AssistantForCausalLM
    p = tiny_preset(preset)
    config = json.loads((write_checkpoint(tmp_path / "a", preset=p, role="assistant") / "config.json").read_text())
    hf_config = Gemma4AssistantConfig(
        text_config=_text_config(config["text_config"]), backbone_hidden_size=config["backbone_hidden_size"],
        use_ordered_embeddings=config["use_ordered_embeddings"], num_centroids=config["num_centroids"])
    expected = _meta_state_dict(Gemma4AssistantForCausalLM, hf_config)
    ours = {s.name: s.shape for s in assistant_tensors(p)}
    assert ours == expected


def test_moe_block_has_every_tensor_of_transformers_moe_modules():
    """26B-A4B at full size on the meta device: router, fused experts [E, 2I, H] / [E, H, I], the extra norms."""
    from transformers import Gemma4TextConfig
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextDecoderLayer
    p = PRESETS["26b-a4b"]
    config = Gemma4TextConfig(**{k: v for k, v in target_config(p, dialect="legacy", multimodal=False).items()
                                 if k not in ("model_type", "dtype", "architectures", "transformers_version")})
    with torch.device("meta"):
        layer = Gemma4TextDecoderLayer(config, layer_idx=0)
    expected = {f"model.layers.0.{k}": tuple(v.shape) for k, v in layer.state_dict().items()}
    ours = {s.name: s.shape for s in target_tensors(p, multimodal=False) if s.name.startswith("model.layers.0.")}
    assert ours == expected
    assert ours["model.layers.0.experts.gate_up_proj"] == (128, 2 * 704, 2816)
    assert ours["model.layers.0.experts.down_proj"] == (128, 2816, 704)


def test_full_size_31b_assistant_matches_the_published_checkpoint():
    """docs/DESIGN.md "Checkpoints": 48 tensors, 939,037,192 bytes in bf16."""
    specs = assistant_tensors(PRESETS["31b"])
    total = sum(2 * torch.Size(s.shape).numel() for s in specs)
    assert (len(specs), total) == (48, 939_037_192)


@pytest.mark.parametrize("dialect", ["legacy", "per_layer_config", "both"])
def test_every_dialect_resolves_to_the_same_geometry(tmp_path, dialect):
    path = write_checkpoint(tmp_path / dialect, preset=tiny_preset("31b"), role="target", dialect=dialect)
    spec = read_spec(json.loads((path / "config.json").read_text()), source="config.json")
    assert spec.dialect == dialect
    assert [(g.head_dim, g.num_kv_heads) for g in spec.attention.layers] == [(16, 16)] * 5 + [(32, 4)]


@pytest.mark.parametrize("dialect", ["legacy", "per_layer_config"])
def test_the_12b_vision_config_spells_out_its_model_patch_size_as_released(tmp_path, dialect):
    """Google's 12B config.json carries vision_config.model_patch_size (48 = 16 x 3), which transformers'
    save_pretrained drops as derived and SGLang 0.5.23 reads as a plain key (docs/DESIGN.md "The 12B family's floors"):
    the per_layer_config case, written by save_pretrained, gets it back; the legacy one never loses it."""
    from matrix.synthetic import resave_documents, write_pair

    target, _ = write_pair(tmp_path / dialect, preset=tiny_preset("12b"), dialect=dialect, unified=True)
    vision = json.loads((target / "config.json").read_text())["vision_config"]
    assert vision["model_patch_size"] == vision["patch_size"] * vision["pooling_kernel_size"] == 48
    assert vision["num_soft_tokens"] == 280
    _, resaved = resave_documents({"target": json.loads((target / "config.json").read_text())})
    assert "model_patch_size" not in resaved["target"]["vision_config"]  # what the put-back is for


def test_the_qat_target_holds_q4_0_grid_values_and_both_layouts_keep_them(tmp_path):
    """Google's 26B-A4B QAT (bf16 on ggml's Q4_0 grid): every block of 32 inputs of each projection and expert holds
    at most 16 distinct values (4-bit codes times one scale), where the unsnapped factory weights hold 32; per-layer
    copies them byte for byte and pad-global only moves them (its rows and columns hold the same value sets)."""
    from safetensors.torch import load_file

    from matrix.cases import SOURCES, build_loader_case

    def tensors(checkpoint):
        return {k: v for f in sorted(checkpoint.glob("*.safetensors")) for k, v in load_file(str(f)).items()}

    def most_values_per_block(weight):
        blocks = weight.float().reshape(-1, 32)
        return max(len(torch.unique(block)) for block in blocks[:256])

    built = build_loader_case("26b-a4b-qat-q4_0", tmp_path)
    original = tensors(built["original"] / "target")
    snapped = [n for n in original if ".layers." in n and n.endswith(("_proj.weight", "experts.gate_up_proj",
                                                                      "experts.down_proj")) and "vision" not in n]
    assert {n.rsplit(".", 2)[-2] if n.endswith("weight") else n.rsplit(".", 1)[-1] for n in snapped} >= \
        {"q_proj", "k_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "gate_up_proj"}
    assert all(most_values_per_block(original[n]) <= 16 for n in snapped)
    unsnapped = tmp_path / "unsnapped"
    from matrix.synthetic import write_pair
    write_pair(unsnapped, preset=SOURCES["26b-a4b-qat-q4_0"].preset_shape, multimodal=True, num_shards=2)
    assert most_values_per_block(tensors(unsnapped / "target")[snapped[0]]) > 16  # the check can fail
    per_layer = tensors(built["per-layer"] / "target")
    assert all(torch.equal(per_layer[n], original[n]) for n in snapped)
    padded = tensors(built["pad-global"] / "target")
    for name in snapped:
        if "self_attn" in name:
            assert set(torch.unique(padded[name].float()).tolist()) <= \
                set(torch.unique(original[name].float()).tolist()) | {0.0}, name
        else:
            assert torch.equal(padded[name], original[name]), name

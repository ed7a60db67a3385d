"""Casting a torch model the way transformers' from_pretrained(dtype=...) does (the reference and equivalence tests)."""

from __future__ import annotations


def cast_like_from_pretrained(model, dtype):
    """Casts like from_pretrained(dtype=...): parameters and buffers, but RoPE inv_freq stays fp32."""
    keep = {n: b.clone() for n, b in model.named_buffers() if "inv_freq" in n}
    model.to(dtype)
    for name, buffer in keep.items():
        owner, attr = name.rsplit(".", 1)
        setattr(model.get_submodule(owner), attr, buffer)
    return model

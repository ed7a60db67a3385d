"""Layout plug-ins: each module registers one class; importing this package registers them all.

A layout decides, per attention tensor, what the output holds (a TensorPlan) and how the text
config's geometry keys read. Everything else (discovery, validation, sharding, writing) is shared.
"""

from __future__ import annotations

from .base import Layout, default_layout, get_layout, layout_names, layouts_in_preference, register_layout
from . import pad_global, per_layer  # noqa: F401  (explicit imports register the layouts)

__all__ = ["Layout", "default_layout", "get_layout", "layout_names", "layouts_in_preference", "register_layout"]

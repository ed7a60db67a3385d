"""What one numerical check of `verify` found: produced by numerics.py, reported by verification.py.

Its own module so the arrows point one way (verification -> numerics -> checks, verification -> checks) and so that
importing verification.py (the CLI does, for every verb) needs no torch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LayerCheck:
    """Numerical comparison of one block: converted vs original, against the original's own precision noise.

    rel_rms is |converted - truth| / |truth| over the whole output (stable across seeds, unlike a max);
    noise_floor is the same measure for the ORIGINAL weights in the checked dtype; ratio = rel_rms / noise_floor.
    """

    name: str
    max_abs: float
    max_rel: float
    rel_rms: float
    cosine: float
    noise_floor: float
    ratio: float
    factor: float
    passed: bool
    note: str | None = None

"""Row ranges of stored tensors: what a fused qkv_proj is split into, and what a plan copies or loads."""

from __future__ import annotations

from dataclasses import dataclass

from .safetensors_header import TensorRef


@dataclass(frozen=True)
class SourceSlice:
    """Rows [row_start, row_stop) of a stored tensor: one contiguous byte range of its file."""

    ref: TensorRef
    row_start: int
    row_stop: int

    @classmethod
    def whole(cls, ref: TensorRef) -> "SourceSlice":
        return cls(ref=ref, row_start=0, row_stop=ref.shape[0] if ref.shape else 1)

    @property
    def row_bytes(self) -> int:
        rows = self.ref.shape[0] if self.ref.shape else 1
        return self.ref.nbytes // rows if rows else 0

    @property
    def offset(self) -> int:
        return self.ref.offset + self.row_start * self.row_bytes

    @property
    def nbytes(self) -> int:
        return (self.row_stop - self.row_start) * self.row_bytes

    @property
    def shape(self) -> tuple[int, ...]:
        if not self.ref.shape:
            return ()
        return (self.row_stop - self.row_start, *self.ref.shape[1:])

    @property
    def is_whole(self) -> bool:
        return self.shape == self.ref.shape

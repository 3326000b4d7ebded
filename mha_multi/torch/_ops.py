"""The spec's array-ops adapter for PyTorch."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def dtype_kind(dtype: torch.dtype) -> str:
    """numpy's ``dtype.kind`` letter for a torch dtype."""
    if dtype.is_floating_point:
        return "f"
    if dtype.is_complex:
        return "c"
    if dtype == torch.bool:
        return "b"
    return "i" if dtype.is_signed else "u"


class TorchOps:
    """:class:`mha_multi.spec.ArrayOps` on ``torch.Tensor``."""

    def split_axis(self, x: torch.Tensor, axis: int, sizes: tuple[int, int]) -> torch.Tensor:
        return x.unflatten(axis, sizes)

    def merge_axes(self, x: torch.Tensor, axis: int) -> torch.Tensor:
        axis = axis % x.dim()
        return x.flatten(axis, axis + 1)

    def permute(self, x: torch.Tensor, axes: Sequence[int]) -> torch.Tensor:
        return x.permute(*axes)

    def expand_dims(self, x: torch.Tensor, axis: int) -> torch.Tensor:
        return x.unsqueeze(axis)

    def matmul(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.matmul(a, b)

    def swap_last(self, x: torch.Tensor) -> torch.Tensor:
        return x.transpose(-1, -2)

    def arange_like(self, x: torch.Tensor, axis: int) -> torch.Tensor:
        return torch.arange(x.shape[axis], device=x.device)

    def flip(self, x: torch.Tensor) -> torch.Tensor:
        return torch.flip(x, (0,))

    def less(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.lt(a, b)

    def greater_equal(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.ge(a, b)

    def logical_and(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.logical_and(a, b)

    def where(
        self, condition: torch.Tensor, x: torch.Tensor, fill: float | torch.Tensor
    ) -> torch.Tensor:
        return torch.where(condition, x, fill)

    def softmax(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x, dim=-1)

    def cast(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return x.to(dtype)

    def dtype(self, x: torch.Tensor) -> torch.dtype:
        return x.dtype

    def dtype_kind(self, dtype: torch.dtype) -> str:
        return dtype_kind(dtype)

    def itemsize(self, dtype: torch.dtype) -> int:
        return dtype.itemsize

    def float32(self) -> torch.dtype:
        return torch.float32

    def ndim(self, x: torch.Tensor) -> int:
        return x.dim()

    def any_last(self, x: torch.Tensor) -> torch.Tensor:
        return x.any(dim=-1, keepdim=True)

    def logical_not(self, x: torch.Tensor) -> torch.Tensor:
        return torch.logical_not(x)

    def mean(self, x: torch.Tensor, axis: int) -> torch.Tensor:
        return x.mean(dim=axis, keepdim=True)


OPS = TorchOps()

"""The spec's array-ops adapter for PyTorch, and how its products accumulate."""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.nn import functional

from mha_multi import spec

SIXTEEN_BIT = (torch.float16, torch.bfloat16)


def accumulates_in_float32(device: torch.device) -> bool:
    """Whether 16-bit products on ``device`` accumulate in float32 by construction.

    CUDA GEMMs (tensor cores, cuBLAS with a float32 compute type) and fused
    attention kernels do. cuBLAS may still reduce split-K partial sums in
    16 bits while ``torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction``
    (or its bf16 twin) is ``True``, PyTorch's default; that is a global
    setting the caller owns, so the layer does not change it (the parity
    runner turns it off). CPU kernels differ by machine and dtype (float16
    ``bmm`` was measured rounding 7% of the elements twice), so elsewhere the
    layer computes 16-bit products on float32 copies and rounds once.
    """
    return device.type == "cuda"


def repeats_grouped_heads(
    q: torch.Tensor, num_queries: int, head_dim: int, dtype: torch.dtype | None = None
) -> bool:
    """Whether SDPA gets grouped key/value heads repeated rather than ``enable_gqa``,
    for ``num_queries`` queries ``q`` of ``head_dim``, run in ``dtype`` (``q``'s by default).

    On CUDA, PyTorch's memory-efficient kernel takes no grouped heads and
    its flash kernel no float32, so float32 grouped heads fall to the math
    kernel, which holds the scores and the weights (two numbers per query
    and key of each head) where repeated keys and values take two vectors of
    ``head_dim`` per key and head. A float32 prefill of 8 examples of 256
    positions (8 query heads of 64, 2 key/value heads) peaked at 80 MiB with
    ``enable_gqa`` and at 12 MiB with the heads repeated, measured on an H200
    (docs: "Results"). A call of fewer queries than ``head_dim`` (a decoding
    step) holds less without the copy; elsewhere ``enable_gqa`` copies nothing.
    """
    return q.is_cuda and (dtype or q.dtype) == torch.float32 and num_queries > head_dim


#: Rows of fewer entries than this are softmaxed on a CPU by the formula itself:
#: PyTorch's CPU softmax takes a scalar path for rows shorter than its vector
#: width (16 float32 lanes with AVX-512), four to six times slower than the
#: formula's own operations there (docs: "Fast paths"). One threshold for every
#: CPU, so that the numbers depend on the shapes alone.
SHORT_ROWS = 16

#: Fewer scores than this in all take ``torch.softmax`` whatever their rows' length:
#: its scalar path costs less there than the host time of the formula's six
#: operations (a decoding step's one query over a few keys). On an AMD EPYC, one
#: thread (``python tools/torch_short_rows.py sizes``): 1 to 32 rows of 3 to 15
#: keys took 1.3 to 10 us by ``torch.softmax`` against 14 to 18 us by the formula;
#: the two cross between 480 and 1536 scores; at 4608 and 7680 the formula took a
#: third of ``torch.softmax``'s time. One threshold for every CPU, as :data:`SHORT_ROWS`.
FEW_SCORES = 1024

#: The key counts over which SDPA's CPU kernel takes an explicit mask slower than the
#: generic path computes the same attention (:func:`masks_few_keys_slowly`): up to the
#: vector width, as :data:`SHORT_ROWS`.
CPU_SLOW_MASK_KEYS = range(8, SHORT_ROWS)


def masks_few_keys_slowly(q: torch.Tensor, num_queries: Any, num_keys: Any) -> bool:
    """Whether SDPA, given an explicit mask or bias, runs slower than the generic path:
    on a CPU, eagerly, more than one query over 8 to 15 keys (:data:`CPU_SLOW_MASK_KEYS`).

    The CPU kernel takes a mask over rows of fewer keys than its vector holds
    on a slower path (64 examples of 14 positions, 4 heads of 8, lengths:
    1288 us a call, and 613 us over 16): at d2l's sizes (10 positions) it
    took 841 us where the generic path took 585, and 1.2x to 1.7x the
    generic path's time over 8 to 15 keys for heads of 8 to 32 (1.06x for
    heads of 64), forward and backward 0.99x to 1.3x (one thread, an AMD
    EPYC; docs: "Fast paths"). Over fewer keys the generic path's fixed cost
    decides (forward and backward 0.8x to 0.9x); from 16 keys on the
    kernel's vectors serve, and without a mask (its causal flag, or none) it
    is as fast. One query per example keeps the kernel: a decoding step's
    plan serves every length of its cache.
    """
    # (Compiling first: a tracer's sizes are symbols, which no test of them may read.)
    return (
        not torch.compiler.is_compiling()
        and type(num_keys) is int
        and num_keys in CPU_SLOW_MASK_KEYS
        and type(num_queries) is int
        and num_queries > 1
        and q.device.type == "cpu"
    )


#: A context manager that does nothing (reusable: it holds no state).
_NOTHING = contextlib.nullcontext()


def autocasting(device_type: str) -> bool:
    """Whether autocast is on for ``device_type`` (``"cpu"``, ``"cuda"``...), asked of one
    flag first: a device's own answer parses its name, and every route's call asks."""
    return torch._C._is_any_autocast_enabled() and torch.is_autocast_enabled(device_type)


def autocast_off(device: torch.device) -> contextlib.AbstractContextManager[None]:
    """Autocast disabled on ``device`` (a no-op where it is not enabled).

    Products whose dtype is chosen here must not be recast by autocast.
    """
    if torch.is_autocast_enabled(device.type):
        return torch.autocast(device.type, enabled=False)
    return _NOTHING


def product_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype ``x @ weight.T`` is computed in: autocast's for float32 operands."""
    dtype = x.dtype
    if dtype is not weight.dtype:
        dtype = torch.promote_types(dtype, weight.dtype)
    if dtype is torch.float32:
        # (Naming the CPU spares making a device object: every product asks.)
        device = "cpu" if x.is_cpu else x.device.type
        if torch.is_autocast_enabled(device):
            return torch.get_autocast_dtype(device)
    return dtype


def needs_float32_copies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``x @ weight.T`` is taken on float32 copies (a 16-bit product off CUDA)."""
    return product_dtype(x, weight) in SIXTEEN_BIT and not accumulates_in_float32(x.device)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` whose 16-bit products accumulate in float32 and round once."""
    dtype = x.dtype
    if dtype is weight.dtype and (
        dtype is torch.float64
        or (
            dtype is torch.float32
            and not torch.is_autocast_enabled("cpu" if x.is_cpu else x.device.type)
        )
    ):
        # What needs_float32_copies answers of operands of one wide dtype, spelled out:
        # every product of a call asks.
        return torch.nn.functional.linear(x, weight, bias)
    if not needs_float32_copies(x, weight):
        return torch.nn.functional.linear(x, weight, bias)
    dtype = product_dtype(x, weight)
    # Rounding to ``dtype`` first is what autocast does to float32 operands.
    x, weight = (t.to(dtype).float() for t in (x, weight))
    bias = None if bias is None else bias.to(dtype).float()
    with autocast_off(x.device):
        return torch.nn.functional.linear(x, weight, bias).to(dtype)


def dtype_kind(dtype: torch.dtype) -> str:
    """numpy's ``dtype.kind`` letter for a torch dtype."""
    if dtype.is_floating_point:
        return "f"
    if dtype.is_complex:
        return "c"
    if dtype == torch.bool:
        return "b"
    return "i" if dtype.is_signed else "u"


class TorchOps(spec.NamespaceOps):
    """:class:`mha_multi.spec.ArrayOps` on ``torch.Tensor``.

    Args:
        device: where :meth:`arange` puts the positions of a mask.
    """

    xp = torch

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)

    def float_bits(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(torch.int64 if x.element_size() == 8 else torch.int32)

    def split_axis(self, x: torch.Tensor, axis: int, sizes: tuple[int, int]) -> torch.Tensor:
        # unflatten cannot infer -1 when the tensor has no elements.
        return x.unflatten(axis, spec.static_split_sizes(x.shape[axis], sizes))

    def merge_axes(self, x: torch.Tensor, axis: int) -> torch.Tensor:
        axis = axis % x.dim()
        return x.flatten(axis, axis + 1)

    def permute(self, x: torch.Tensor, axes: Sequence[int]) -> torch.Tensor:
        return x.permute(*axes)

    def expand_dims(self, x: torch.Tensor, axis: int) -> torch.Tensor:
        return x.unsqueeze(axis)

    def matmul(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        # The spec chose these dtypes (float32 scores for 16-bit heads):
        # autocast must not lower them.
        dtype = a.dtype
        if dtype is not b.dtype:
            dtype = torch.promote_types(dtype, b.dtype)
        with autocast_off(a.device):
            if dtype in SIXTEEN_BIT and not accumulates_in_float32(a.device):
                return torch.matmul(a.float(), b.float()).to(dtype)
            return torch.matmul(a, b)

    def swap_last(self, x: torch.Tensor) -> torch.Tensor:
        return x.transpose(-1, -2)

    def matmul_swapped(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.matmul(a, b.transpose(-1, -2))  # (a view: matmul reads it as it lies)

    def size(self, x: torch.Tensor, axis: int) -> int:
        return x.shape[axis]

    def arange(self, size: int) -> torch.Tensor:
        return torch.arange(size, device=self.device)

    def flip(self, x: torch.Tensor) -> torch.Tensor:
        return torch.flip(x, (0,))

    def where(
        self, condition: torch.Tensor, x: torch.Tensor, fill: float | torch.Tensor
    ) -> torch.Tensor:
        return torch.where(condition, x, fill)

    def softmax(self, x: torch.Tensor) -> torch.Tensor:
        # (The formula's rows are floored, hidden or not; torch.softmax has its own exp.)
        return softmax(x)

    def cast(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        # (``to`` would return ``x`` too, after a dispatch: the generic path casts often.)
        return x if x.dtype is dtype else x.to(dtype)

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

    def mean(self, x: torch.Tensor, axis: int) -> torch.Tensor:
        return x.mean(dim=axis, keepdim=True)

    def gather_positions(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return torch.take_along_dim(x, positions.unsqueeze(-1), dim=1)

    def concat_last(self, xs: Sequence[torch.Tensor]) -> torch.Tensor:
        return torch.cat(list(xs), dim=-1)

    def rsqrt(self, x: torch.Tensor) -> torch.Tensor:
        return torch.rsqrt(x)

    def constant(self, value: np.ndarray, like: torch.Tensor) -> torch.Tensor:
        if like.device.type == "cpu" or torch.compiler.is_compiling():
            return torch.as_tensor(value, device=like.device)
        # A copy from pageable host memory synchronizes with the device: each
        # constant (rotary frequencies, ALiBi slopes) is copied once per device.
        value = np.ascontiguousarray(value)
        return _device_constant(value.tobytes(), value.dtype.str, value.shape, like.device)


OPS = TorchOps()

#: The formula's floor on a shifted score, by dtype: ``exp`` of anything lower is
#: below the dtype's smallest normal number, which the CPU's vectorized ``exp``
#: computes on a slow path (a hidden score, ``MASK_VALUE`` less the row's maximum,
#: made it six times slower). The floor's exponential and anything up to ``e``
#: times it (float32 ``4.5e-38``, float64 ``8.2e-308``) come out 0, as a hidden
#: score's exactly did; a weight that small counts for nothing in any sum. Other
#: dtypes take the formula as it is.
_FLOORS = {
    dtype: (torch.tensor(floor, dtype=dtype), math.exp(floor + 1))
    for dtype, floor in ((torch.float32, -87.0), (torch.float64, -708.0))
}


def softmax(x: torch.Tensor) -> torch.Tensor:
    """The softmax over the last axis of the scores, as the generic path takes it.

    Rows shorter than :data:`SHORT_ROWS` on a CPU, :data:`FEW_SCORES` or more
    scores in all: ``exp(x - max) / sum``, the maximum held constant (the
    softmax does not change with it, and its gradient is then the formula's
    alone), the shifted scores floored (:data:`_FLOORS`); the same non-finite
    pattern as ``torch.softmax`` (a row holding NaN or +inf, or hidden whole
    by -inf, is NaN) and its accuracy. Any other: ``torch.softmax``.
    """
    if 0 < x.shape[-1] < SHORT_ROWS and x.device.type == "cpu" and x.numel() >= FEW_SCORES:
        exps = floored_exp(x - x.amax(-1, keepdim=True).detach())
        return exps / exps.sum(-1, keepdim=True)
    return torch.softmax(x, dim=-1)


def floored_exp(shifted: torch.Tensor) -> torch.Tensor:
    """``exp`` of a softmax's shifted scores (each row's maximum subtracted), on a CPU:
    floored first (:data:`_FLOORS`), so that no result is below the dtype's smallest
    normal number. The same numbers as ``exp`` but those up to ``e`` times the floor's,
    which are 0; a NaN kept forward and backward.
    """
    floor = _FLOORS.get(shifted.dtype)
    if floor is None:
        return shifted.exp()
    # Two ways to the same numbers: ``maximum``'s forward is the faster, ``where``'s
    # backward (one select where ``maximum``'s takes five operations).
    lowest, zeroed = floor
    if shifted.requires_grad:
        floored = torch.where(shifted < lowest, lowest, shifted)
    else:
        floored = torch.maximum(shifted, lowest)
    return functional.hardshrink(floored.exp(), zeroed)


@functools.lru_cache(maxsize=256)
def _device_constant(
    data: bytes, dtype: str, shape: tuple[int, ...], device: torch.device
) -> torch.Tensor:
    """A numpy constant (as bytes) as a tensor on ``device``, made once."""
    array = np.frombuffer(data, dtype=np.dtype(dtype)).reshape(shape)
    return torch.from_numpy(array.copy()).to(device)


@functools.cache
def ops_on(device: torch.device) -> TorchOps:
    """The adapter whose masks live on ``device``."""
    return TorchOps(device)

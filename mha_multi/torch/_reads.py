"""PyTorch's finiteness reads: whether a call's values are finite, and how large, in few passes.

What an eager call reads of its values before it plans (docs: "Fast
paths"): a float32 sum that is finite only where every element is
(:func:`finite_sum`, over self-attention's stacked projection once,
:func:`covering`), the extremes that bound the scores (:func:`extremes`,
:func:`largest_magnitude`), and 0-d tensors read to the host in one
transfer (:func:`read_together`). The PyTorch facts, their guarded kernel,
the plain route and Keras on PyTorch read with these. This module imports
nothing of the package.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "covering",
    "extremes",
    "finite_sum",
    "larger",
    "largest_magnitude",
    "magnitude_of",
    "read_together",
]


def covering(*tensors: torch.Tensor, eager: bool = False) -> tuple[torch.Tensor, ...]:
    """Tensors holding exactly the elements of ``tensors``, as few as can be.

    The projections of self-attention are column blocks of one stacked
    product ``(B, T, width)``, side by side in memory: one pass over that
    product reads them all. (Views made under ``torch.inference_mode`` do
    not know their base, so the blocks are matched by their addresses.)
    ``eager``: the caller knows that no ``torch.compile`` tracer runs (it
    asked already).
    """
    first = tensors[0]
    if not tensors[1:] or (not eager and torch.compiler.is_compiling()):
        return tensors  # (a traced tensor has no address; the compiler fuses the passes)
    base = first._base
    if base is not None and first.ndim == base.ndim == 3:
        # Column blocks of one (B, T, width) tensor, read from their shapes (no count
        # of elements asked: every call of a layer asks).
        width = 0
        for x in tensors:
            if x._base is not base or x.shape[:-1] != base.shape[:-1]:
                break
            width += x.shape[-1]
        else:
            # As many elements as the tensor holds, or more (none where B * T is 0).
            if base.shape[-1] <= width or 0 in base.shape[:-1]:
                return (base,)
    if base is not None:
        # (Loops, not generators: every call of a layer asks.)
        total = 0
        for x in tensors:
            if x._base is not base:
                break
            total += x.numel()
        else:
            if base.numel() <= total:
                # Views of one tensor that holds no more elements than they do: a
                # pass over it reads them all (at worst an element twice).
                return (base,)
    if first.dim() != 3:
        return tensors
    width = sum(x.shape[-1] for x in tensors)
    stride = first.stride()
    if stride[-1] != 1 or stride[-2] != width or stride[0] != width * first.shape[1]:
        return tensors
    storage = first.untyped_storage().data_ptr()
    address = first.data_ptr()
    for x in tensors:
        if (
            x.data_ptr() != address
            or x.shape[:-1] != first.shape[:-1]
            or x.stride() != stride
            or x.dtype != first.dtype
            or x.untyped_storage().data_ptr() != storage
        ):
            return tensors
        address += x.shape[-1] * x.element_size()
    return (first.as_strided((*first.shape[:-1], width), stride),)


def finite_sum(*tensors: torch.Tensor, eager: bool = False) -> torch.Tensor:
    """A 0-d float32 on the tensors' device, finite only if every element is.

    One pass, nothing allocated (over self-attention's stacked projection
    once, :func:`covering`; ``eager`` as there). A finite sum that overflows
    only sends a call to the generic path, which is exact for any values.
    """
    blocks = covering(*tensors, eager=eager)
    total = blocks[0].detach().sum(dtype=torch.float32)
    for x in blocks[1:]:
        total = total + x.detach().sum(dtype=torch.float32)
    return total


def extremes(x: torch.Tensor) -> list[torch.Tensor]:
    """``[max(x), min(x)]``, 0-d on ``x``'s device (zeros for no elements; NaN where
    ``x`` holds one): two passes, nothing allocated. A read takes ``max|x|`` from
    them on the host (:func:`magnitude_of`), with three kernels fewer than
    :func:`largest_magnitude`, each a launch on a GPU. (``linalg.vector_norm``'s
    infinity norm took 60 times as long over a strided cache prefix on the CPU.)"""
    x = x.detach()
    if not x.numel():
        return [torch.zeros((), dtype=x.dtype, device=x.device)] * 2
    return [x.amax(), x.amin()]


def largest_magnitude(x: torch.Tensor) -> torch.Tensor:
    """``max|x|`` on the device, a 0-d float32 (0 for no elements; NaN where ``x``
    holds one), for a test that stays there (a compiled graph's predicate)."""
    largest, smallest = extremes(x)
    return torch.maximum(largest, -smallest).float()


def larger(a: float, b: float) -> float:
    """The larger of two magnitudes, NaN where either is (Python's ``max`` is not)."""
    return a + b if math.isnan(a) or math.isnan(b) else max(a, b)


def magnitude_of(largest: float, smallest: float) -> float:
    """``max|x|`` from :func:`extremes` read to the host."""
    return larger(abs(largest), abs(smallest))


def read_together(reads: list[torch.Tensor]) -> list[float]:
    """0-d tensors of any dtypes on one device, read to the host in one transfer as
    float64 (which holds every length a tensor can have exactly): one stack, no cast
    of its own per tensor."""
    if not reads[1:]:  # (one: no len() asked, every call reads)
        return [reads[0].item()]
    out = torch.empty(len(reads), dtype=torch.float64, device=reads[0].device)
    return torch.stack(reads, out=out).tolist()

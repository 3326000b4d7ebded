"""A compiled PyTorch call's new rows written into a cache's own tensors, one write per array.

Under ``torch.compile``, where no gradient is recorded through the cache,
a cached call writes its new keys and values in place (docs: "Generating
with a cache", "Errors, and what compiled code does"): static shapes, no
value read, no new cache, so that the compiled step is safe for CUDA graphs
(``mode="reduce-overhead"``). What it writes is exactly
:func:`mha_multi.spec.update_cache`'s update, for any lengths.
"""

from __future__ import annotations

import torch

from mha_multi import spec

__all__ = ["records_gradient", "write_in_place", "writes_in_place"]


def records_gradient(*arrays: torch.Tensor) -> bool:
    """Whether a gradient is recorded through any of ``arrays``: then the cache is
    updated functionally, as an eager call's is (docs: "Generating with a cache").

    (Whether a tensor is an inference tensor cannot be asked in a compiled
    graph; inductor's graphs write an inference cache outside inference mode too.)
    """
    return torch.is_grad_enabled() and any(x.requires_grad for x in arrays)


def writes_in_place(
    k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
) -> bool:
    """Whether a compiled call writes its new rows ``k``, ``v`` into a cache's ``keys``
    and ``values`` in place (:func:`write_in_place`): no gradient recorded through
    them, and the arrays two, each contiguous.

    No two elements of the cache may share memory, as in an eager call (docs:
    "Generating with a cache"): an expanded view's examples share theirs, one
    array given as both keys and values all, and a row written in place would
    change the others. A compiled graph cannot ask where an array lies, only
    how: two contiguous arrays have no element in common within each, and a
    view of another layout (expanded, or interleaved with the other in one
    buffer) is updated functionally, as its eager call's is. (Two contiguous
    arrays cut from one buffer so that they overlap are not told apart.)
    """
    return (
        not records_gradient(k, v, keys, values)
        and keys is not values
        and keys.is_contiguous()
        and values.is_contiguous()
    )


def write_in_place(
    ops: spec.ArrayOps,
    cache: spec.KVCache,
    k: torch.Tensor,
    v: torch.Tensor,
    valid_lens: torch.Tensor | None,
    *,
    head_dim: int,
    causal: bool,
) -> tuple[spec.KVCache, torch.Tensor]:
    """:func:`mha_multi.spec.update_cache`, ``cache.keys`` and ``cache.values`` written in place.

    Row ``t`` of example ``b`` goes to position ``lengths[b] + t`` where ``t
    < valid_lens[b]`` (clipped into ``[0, T]``) and the position is in
    ``[0, max_length)``. Every row goes somewhere: position ``(lengths[b] +
    t) mod max_length``, distinct for the ``T <= max_length`` rows of an
    example, and a row that is not kept rewrites that position with the
    value it holds, so no position outside the written ones changes. A call
    of more rows than ``max_length`` writes the spec's update back whole.

    Returns:
        ``(cache, lens)`` as :func:`mha_multi.spec.update_cache` returns
        them, the cache sharing ``keys`` and ``values`` with ``cache``.
    """
    lengths = cache.lengths
    num_new = k.shape[1]
    if num_new == 0:
        return cache, lengths  # no position to write, and no query
    max_length = cache.keys.shape[2]
    if num_new > max_length:
        # (A prompt longer than the cache: some positions of an example coincide mod max_length.)
        updated, visible = spec.update_cache(
            ops, cache, k, v, valid_lens, head_dim=head_dim, causal=causal
        )
        cache.keys.copy_(updated.keys)
        cache.values.copy_(updated.values)
        return spec.KVCache(cache.keys, cache.values, updated.lengths), visible
    spec.check_cache_dtype(ops, cache, ops.dtype(k), ops.dtype(v))
    new = spec.appended(ops, lengths, valid_lens, num_new)
    at, kept = spec.row_positions(ops, lengths.to(torch.int64), new, num_new, max_length)
    # (B, 1, 1), (1, H_kv, 1), (B, 1, T): each example's, each head's positions.
    index = (
        torch.arange(k.shape[0], device=k.device)[:, None, None],
        torch.arange(cache.keys.shape[1], device=k.device)[:, None],
        at.remainder(max_length)[:, None, :],
    )
    kept = kept[:, None, :, None]
    for held, x in ((cache.keys, k), (cache.values, v)):
        rows = x.unflatten(-1, (held.shape[1], head_dim)).transpose(1, 2)  # (B, H_kv, T, dh)
        # (index_put_ is written into the cache's buffer by inductor; scatter_ is not.)
        held.index_put_(index, torch.where(kept, rows, held[index]))
    updated = spec.KVCache(cache.keys, cache.values, lengths + new)
    return updated, spec.cached_visibility(ops, lengths, new, num_new, causal=causal)

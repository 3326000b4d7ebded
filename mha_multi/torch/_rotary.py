"""The fast route's rotation: :func:`mha_multi.spec.rotate`'s numbers in fewer operations.

A decoding step's host time is its operations (docs: "Fast paths"), and
the spec's rotation of each head's pairs, ``(x1 cos - x2 sin, x2 cos + x1
sin)``, takes nine. Written as transformers writes it, ``x * C + swap(x)
* S``, with ``C`` each angle's cosine at both entries of its pair and
``S`` its sine, negated at the pair's first entry, it takes four: a swap
of the pairs (a roll of the half-split layout, a flip of interleaved
pairs), two products and a sum. Each entry is the same two products and
one sum, rounded the same way (``a + b * (-s)`` is ``a - b * s`` in IEEE
arithmetic, non-finite values included), so the numbers are the spec's to
the bit. A rotation of part of each head keeps the spec's own form.
"""

from __future__ import annotations

import torch

from mha_multi import spec
from mha_multi.torch._ops import OPS

__all__ = ["WideTables", "rotate_heads", "rotate_stacked", "wide_tables"]

#: ``(C, S)``, each ``(..., head_dim)``: every entry's cosine and signed sine.
WideTables = tuple[torch.Tensor, torch.Tensor]


def wide_tables(
    tables: tuple[torch.Tensor, torch.Tensor], rotary: spec.Rotary, head_dim: int
) -> WideTables | None:
    """``(C, S)`` of :func:`mha_multi.spec.rotary_tables`' ``(cos, sin)`` (``(..., dim /
    2)``), or ``None`` where only part of each head rotates."""
    if rotary.dim(head_dim) != head_dim:
        return None
    cos, sin = tables
    if rotary.interleaved:  # pairs (2 i, 2 i + 1)
        return (
            torch.stack([cos, cos], -1).flatten(-2),
            torch.stack([-sin, sin], -1).flatten(-2),
        )
    return torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1)  # pairs (i, i + dim / 2)


def rotate_heads(heads: torch.Tensor, tables: WideTables, rotary: spec.Rotary) -> torch.Tensor:
    """:func:`mha_multi.spec.rotate` of ``heads`` ``(..., head_dim)`` by :func:`wide_tables`
    (broadcast against them), in their dtype."""
    wide_cos, wide_sin = tables
    dtype = heads.dtype
    if wide_cos.dtype != dtype:  # 16-bit heads rotate in float32, rounded once
        heads = heads.to(wide_cos.dtype)
    half = heads.shape[-1] // 2
    if rotary.interleaved:
        swapped = heads.unflatten(-1, (half, 2)).flip(-1).flatten(-2)
    else:
        swapped = heads.roll(half, -1)
    turned = heads * wide_cos + swapped * wide_sin
    return turned if turned.dtype == dtype else turned.to(dtype)


def rotate_stacked(
    projected: torch.Tensor,
    tables: tuple[torch.Tensor, torch.Tensor],
    wide: WideTables | None,
    rotary: spec.Rotary,
    heads: spec.Heads,
    position: int | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The queries and keys of self-attention's stacked projections rotated together
    (one tensor of their heads: the rotation acts on each head alone).

    ``tables`` are :func:`mha_multi.spec.rotary_tables` of ``arange(Q)``
    (``position`` ``None``) or of every position of a cache, whose row at a
    step's ``position`` is taken; ``wide`` their :func:`wide_tables`
    (``None`` where part of each head rotates: the spec's own form).
    Returns ``(q, k, v, both)``: ``q`` and ``k`` views of ``both``, the rotated
    heads, and ``v`` the values' block of ``projected``.
    """
    query_width, kv_width = heads.query_features, heads.kv_features
    both, v = projected.split_with_sizes((query_width + kv_width, kv_width), -1)
    all_heads = heads.num_heads + heads.num_kv_heads
    rows = tables if wide is None else wide
    if position is not None:  # (a row of each table, broadcast over the heads)
        rows = rows[0][position], rows[1][position]
    if wide is None:
        both = spec.rotate(OPS, both, None, rotary, all_heads, heads.head_dim, tables=rows)
    else:
        heads_of = both.view(*both.shape[:-1], all_heads, heads.head_dim)
        both = rotate_heads(heads_of, rows, rotary).flatten(-2)
    q, k = both.split_with_sizes((query_width, kv_width), -1)
    return q, k, v, both

"""The head layout: ``transpose_qkv``, ``transpose_output`` and their grouped forms.

d2l's layout merges examples and heads into one axis, ``(B*H, T, dh)``, flat
row ``b*H + h``; grouped-query attention puts each key/value head's group of
query heads next to each other, so that no key or value is repeated.
"""

from __future__ import annotations

from mha_multi.spec.ops import Array, ArrayOps


def transpose_qkv(ops: ArrayOps, x: Array, num_heads: int) -> Array:
    """``(B, T, H*dh) -> (B*H, T, dh)``; the flat row index is ``b*H + h``."""
    x = ops.split_axis(x, 2, (num_heads, -1))  # (B, T, H, dh)
    x = ops.permute(x, (0, 2, 1, 3))  # (B, H, T, dh)
    return ops.merge_axes(x, 0)  # (B*H, T, dh)


def transpose_output(ops: ArrayOps, x: Array, num_heads: int) -> Array:
    """``(B*H, T, dh) -> (B, T, H*dh)``; the exact inverse of :func:`transpose_qkv`."""
    x = ops.split_axis(x, 0, (-1, num_heads))  # (B, H, T, dh)
    x = ops.permute(x, (0, 2, 1, 3))  # (B, T, H, dh)
    return ops.merge_axes(x, 2)


def transpose_grouped_queries(ops: ArrayOps, x: Array, num_kv_heads: int, group_size: int) -> Array:
    """``(B, Q, H*dh) -> (B*H_kv, G*Q, dh)`` for ``G = group_size`` query heads per key/value head.

    Query head ``h = j*G + g`` lands in row block ``b*H_kv + j`` at rows
    ``g*Q .. g*Q + Q - 1``, next to the other heads that read key/value head
    ``j``: one matrix product per key/value head serves its whole group, and
    no key or value is repeated. With ``G = 1`` it is :func:`transpose_qkv`.
    """
    x = ops.split_axis(x, 2, (num_kv_heads, -1))  # (B, Q, H_kv, G*dh)
    x = ops.split_axis(x, 3, (group_size, -1))  # (B, Q, H_kv, G, dh)
    x = ops.permute(x, (0, 2, 3, 1, 4))  # (B, H_kv, G, Q, dh)
    x = ops.merge_axes(x, 2)  # (B, H_kv, G*Q, dh)
    return ops.merge_axes(x, 0)


def transpose_grouped_output(ops: ArrayOps, x: Array, num_kv_heads: int, group_size: int) -> Array:
    """``(B*H_kv, G*Q, dh) -> (B, Q, H*dh)``: the inverse of :func:`transpose_grouped_queries`."""
    x = ops.split_axis(x, 0, (-1, num_kv_heads))  # (B, H_kv, G*Q, dh)
    x = ops.split_axis(x, 2, (group_size, -1))  # (B, H_kv, G, Q, dh)
    x = ops.permute(x, (0, 3, 1, 2, 4))  # (B, Q, H_kv, G, dh)
    x = ops.merge_axes(x, 3)  # (B, Q, H_kv, G*dh)
    return ops.merge_axes(x, 2)


def grouped_to_heads(ops: ArrayOps, x: Array, num_kv_heads: int, group_size: int) -> Array:
    """``(B*H_kv, G*Q, K) -> (B, H, Q, K)`` with ``h = j*G + g``."""
    x = ops.split_axis(x, 0, (-1, num_kv_heads))  # (B, H_kv, G*Q, K)
    x = ops.split_axis(x, 2, (group_size, -1))  # (B, H_kv, G, Q, K)
    return ops.merge_axes(x, 1)


def heads_to_grouped(ops: ArrayOps, x: Array, num_kv_heads: int, group_size: int) -> Array:
    """``(B, H, Q, K) -> (B*H_kv, G*Q, K)``: the inverse of :func:`grouped_to_heads`."""
    x = ops.split_axis(x, 1, (num_kv_heads, group_size))  # (B, H_kv, G, Q, K)
    x = ops.merge_axes(x, 2)  # (B, H_kv, G*Q, K)
    return ops.merge_axes(x, 0)

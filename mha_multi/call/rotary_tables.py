"""A call's rotary tables at its default positions, made once per signature and reused.

The cosines and sines of :func:`mha_multi.spec.rotary_tables` at a call's
default positions (``arange(Q)`` and ``arange(K)`` without a cache, a
cache's rows ``start + arange(T)`` with one) depend on the call's signature
alone: how many positions, the rotation and the head size, the angles'
precision and where constants land (:meth:`mha_multi.call.Facts.constants_key`).
An eager call of a framework that names that place takes them from here,
made once for the last few signatures (docs: "Fast paths"); a traced call,
or a framework that names none, makes its own, and nothing traced is kept.

A cached call takes its rows of the table of every position of its cache
where the framework's cosine and sine give each angle's numbers whatever the
array (:attr:`mha_multi.call.Facts.rows_of_one_table`): a table's row is then
that of its position alone, the numbers the call would make. Rows from one
start are a slice; a ragged batch's are picked where the framework picks
them (:meth:`mha_multi.call.Facts.rows_at`). Elsewhere a cached call whose
lengths were read makes its own tables, of positions made on the host.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mha_multi import spec
from mha_multi.call.contract import Array
from mha_multi.call.facts import Facts
from mha_multi.spec.memo import Kept

__all__ = [
    "KEPT_SIGNATURES",
    "default_tables",
    "forget",
    "kept",
    "kept_tables",
    "rotated_at_default_positions",
]

#: How many signatures' tables are kept, the least recently used dropped
#: first: a table of a long cache's every position is large.
KEPT_SIGNATURES = 8

Tables = tuple[Array, Array]

_KEPT: Kept[Tables] = Kept(KEPT_SIGNATURES)


def kept() -> list[Tables]:
    """The tables kept now, the least recently used first."""
    return list(_KEPT.values())


def forget() -> None:
    """Drops every kept table (their memory goes with the last call holding them)."""
    _KEPT.clear()


def kept_tables(
    ops: spec.ArrayOps,
    x: Array,
    where: Any,
    rotary: spec.Rotary,
    head_dim: int,
    count: int,
    *,
    length: int | None = None,
) -> Tables:
    """:func:`mha_multi.spec.rotary_tables` of positions ``arange(count)``, made once per signature.

    Args:
        ops: the array-ops adapter.
        x: what will be rotated (eager): gives the angles' precision and device.
        where: :meth:`mha_multi.call.Facts.constants_key` of ``x`` (not ``None``).
        rotary: the rotation.
        head_dim: the size of each head.
        count: how many positions, from 0.
        length: the call's length, for a rotary type that depends on it; ``None`` otherwise.

    Returns:
        ``(cos, sin)``, each ``(count, 1, dim / 2)``.
    """
    key = (where, ops.dtype(x), rotary, head_dim, count, length)
    try:
        tables = _KEPT.get(key)
    except TypeError:  # a rotation whose fields cannot be hashed: made each time
        key, tables = None, None
    if tables is not None:
        _KEPT.move_to_end(key)
        return tables
    # The positions as a constant, not ops.arange(x's size): an array with no
    # history (MXNet records what arange_like draws from a recorded array).
    positions = ops.constant(np.arange(count, dtype=np.int32), x)
    tables = spec.rotary_tables(ops, x, positions, rotary, head_dim, length=length)
    if key is not None:
        _KEPT.keep(key, tables)
    return tables


def default_tables(
    facts: Facts,
    ops: spec.ArrayOps,
    q: Array,
    k: Array | None,
    rotary: spec.Rotary,
    head_dim: int,
    *,
    fill: spec.CacheFill | None,
    held: Array | None,
    lengths: Array | None,
) -> tuple[Tables, Tables] | None:
    """The tables of the queries and keys of an eager call at its default positions.

    Without a cache, the kept tables of ``arange(Q)`` and ``arange(K)``. With
    one whose lengths were read (``fill``): rows of the kept table of every
    position of the cache where the framework's tables allow it
    (:attr:`mha_multi.call.Facts.rows_of_one_table`): the examples' shared
    start's, or each example's (:meth:`mha_multi.call.Facts.rows_at`) where
    their positions lie in the cache; else the call's own tables, of
    :func:`mha_multi.spec.cache_positions`' positions made on the host from the
    lengths read (the same array, without its operations).

    Args:
        facts: the framework's facts.
        ops: the array-ops adapter.
        q: the projected queries ``(B, Q, H*dh)``.
        k: the projected keys ``(B, K, H_kv*dh)``, or ``None``.
        rotary: the layer's rotation.
        head_dim: the size of each head.
        fill: a cached call's lengths as read on the host, or ``None``.
        held: the cache's keys ``(B, H_kv, max_length, dh)``, or ``None`` without a cache.
        lengths: the cache's lengths before the call, or ``None`` without a cache.

    Returns:
        ``(query_tables, key_tables)``, or ``None`` where the call makes its
        own from its positions on the device: traced, a framework that
        keeps nothing, a cached call whose lengths are not known on the
        host, or one whose rotary type depends on its length.
    """
    where = facts.constants_key(q)
    if where is None:
        return None
    num_queries = q.shape[1]
    if held is None:
        num_keys = num_queries if k is None else k.shape[1]
        # (A length-dependent type: the call's length, Q and K's larger.)
        length = max(num_queries, num_keys) if rotary.depends_on_length else None
        tables = kept_tables(ops, q, where, rotary, head_dim, num_queries, length=length)
        if num_keys == num_queries:
            return tables, tables
        return tables, kept_tables(ops, q, where, rotary, head_dim, num_keys, length=length)
    if fill is None or rotary.depends_on_length:
        return None
    start = fill.uniform_start(num_queries) if facts.rows_of_one_table else None
    if start is not None:
        whole = kept_tables(ops, q, where, rotary, head_dim, held.shape[2])
        rows = tuple(facts.first_rows(table, start, start + num_queries) for table in whole)
        return rows, rows
    if facts.rows_of_one_table and fill.lengths.size:
        # A ragged batch: each example's rows of that table, where every position is one
        # of the cache's (a padding row's may lie past it).
        max_length = held.shape[2]
        if int(fill.lengths.max()) + num_queries <= max_length:
            whole = kept_tables(ops, q, where, rotary, head_dim, max_length)
            index = fill.lengths[:, None] + np.arange(num_queries)
            rows = tuple(facts.rows_at(table, index) for table in whole)
            if rows[0] is not None:
                return rows, rows
    # (The lengths' integer type, as numpy names it: each framework's dtype has its kind
    # and size.)
    lengths_dtype = ops.dtype(lengths)
    integer = np.dtype(f"{ops.dtype_kind(lengths_dtype)}{ops.itemsize(lengths_dtype)}")
    steps = np.arange(num_queries, dtype=integer)
    positions = ops.constant(fill.lengths.astype(steps.dtype)[:, None] + steps, q)
    tables = spec.rotary_tables(ops, q, positions, rotary, head_dim)
    return tables, tables


def rotated_at_default_positions(
    facts: Facts,
    ops: spec.ArrayOps,
    q: Array,
    k: Array | None,
    rotary: spec.Rotary,
    heads: spec.Heads,
    *,
    fill: spec.CacheFill | None,
    held: Array | None,
    lengths: Array | None,
) -> tuple[Array, Array | None] | None:
    """``q`` and ``k`` rotated by :func:`default_tables`, or ``None`` where the call
    makes its own tables (the arguments are :func:`default_tables`'; ``heads``: the
    layer's).

    Queries and keys at the same positions rotate side by side, in one rotation:
    the same operations on each element, a rotation's fixed cost paid once.
    """
    kept = default_tables(
        facts, ops, q, k, rotary, heads.head_dim, fill=fill, held=held, lengths=lengths
    )
    if kept is None:
        return None
    tables, key_tables = kept
    if k is not None and key_tables is tables:
        width = q.shape[2]
        both = ops.concat_last([q, k])
        num_heads = heads.num_heads + heads.num_kv_heads
        both = spec.rotate(ops, both, None, rotary, num_heads, heads.head_dim, tables=tables)
        return ops.slice_last(both, 0, width), ops.slice_last(both, width, both.shape[2])
    q = spec.rotate(ops, q, None, rotary, heads.num_heads, heads.head_dim, tables=tables)
    if k is not None:
        k = spec.rotate(ops, k, None, rotary, heads.num_kv_heads, heads.head_dim, tables=key_tables)
    return q, k

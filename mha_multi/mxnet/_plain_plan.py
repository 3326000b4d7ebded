"""What a plan of MXNet's plain calls holds, and its shapes (docs: "Fast paths").

A :class:`PlainPlan` is what every call of one signature of plain
self-attention (:mod:`mha_multi.mxnet._plain`) or plain cross-attention
(:mod:`mha_multi.mxnet._cross`) runs: the projections' parameters, the
layouts as concrete reshapes (:func:`layout`, a transpose that moves no data
left out), the kernel plan of a call with lengths, and what a layer's
options add. :func:`shaped_plan` makes what depends on the call's shapes,
for both.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import mxnet as mx
import numpy as np

from mha_multi import call, spec
from mha_multi.mxnet._ops import MXNetOps
from mha_multi.spec.memo import MISSING, Kept

__all__ = ["NOT_YET", "Layout", "PlainPlan", "kept", "layout", "relaid", "shaped_plan"]

Array = Any
#: What a plan's maker answers where a plan cannot be made yet (an input size deferred:
#: the generic flow's first call fixes it), and what a table answers for no plan yet
#: (the tables' own sentinel).
NOT_YET = MISSING
#: A change of layout: ``(operation, shape or axes)`` steps, each ``mx.npx.reshape``
#: or ``mx.np.transpose``.
Layout = tuple[tuple[Any, tuple[int, ...]], ...]


class PlainPlan(NamedTuple):
    """What every plain call of one signature runs
    (:func:`mha_multi.mxnet._plain.plain_attention`,
    :func:`mha_multi.mxnet._cross.cross_attention`)."""

    #: ``(weight, bias, units)`` of ``W_q``, ``W_k``, ``W_v`` and ``W_o``: Gluon
    #: parameters, their arrays looked up at each call.
    projections: tuple[tuple[Any, Any, int], ...]
    heads: spec.Heads
    #: MXNet's facts (their generic path's attention) and the spec's operations on
    #: these arrays (the facts' adapter).
    facts: call.Facts
    ops: MXNetOps
    #: The call's ``causal`` flag.
    causal: bool
    #: The layer's query/key norms (:func:`mha_multi.spec.normalize_qk`) and their
    #: Gluon parameters ``(q_norm, k_norm)``; ``None`` without.
    norm: spec.QKNorm | None
    norms: tuple[Any, Any] | None
    #: The layer's window (a cached call's plan: a step runs it only where the
    #: window holds every position, as the generic flow plans such a step without it).
    window: int | None
    #: A soft cap's, sinks' or ALiBi's score options (the window's left out: it hides
    #: nothing where the plan runs), with the sinks' Gluon parameter: the generic
    #: path's attention, which no kernel of MXNet takes; ``None`` for the fused route's.
    scored: tuple[spec.ScoreOptions, Any] | None
    #: A call with lengths (without a cache, nor ``scored``): the generic flow's kernel
    #: plan for it, whose mask (or generic path) the plan's call takes.
    kernel: spec.KernelPlan | None
    num_heads: int
    #: ``sqrt(head_dim)``: the queries' divisor, as in
    #: :func:`mha_multi.mxnet._kernel.sequence_mask_attention`.
    scale: float
    #: ``(B, T, H + H_kv, 2, dh / 2)``: the queries' and keys' heads, halves apart,
    #: rotated side by side; ``None`` without a rotation.
    rotated: tuple[int, ...] | None
    #: ``(cos, sign * sin)``, each ``(positions, 1, 2, dh / 2)``: the two halves' factors
    #: (every position of a cache, else the call's); ``None`` without a rotation.
    tables: tuple[Array, Array] | None
    #: The queries (projected or rotated) to ``(B*H_kv, G*T, dh)``, the spec's grouped layout.
    queries: Layout
    #: The keys (projected or rotated) to ``(B*H_kv, T, dh)``; with a cache to
    #: ``(B, H_kv, T, dh)``, the rows written.
    keys: Layout
    #: The values, as the keys.
    values: Layout
    #: The context ``(B*H_kv, G*T, dh)`` to ``(B, T, H*dh)``.
    output: Layout
    #: A causal call's ``sequence_mask`` lengths, one per row of the scores; ``None``
    #: where nothing is hidden.
    mask_lengths: Array | None
    #: The scores' shape ``(B*H_kv, G*T, K)`` (without a cache; ``K`` the keys' own
    #: length in a cross-attention plan, :mod:`mha_multi.mxnet._cross`).
    scores: tuple[int, ...]
    #: ``T``: the call's new positions.
    num_new: int
    #: With a cache, its ``max_length``; ``None`` without one.
    max_length: int | None
    #: The layer's dropout rate on the weights (``npx.dropout``, which acts in training
    #: mode only), as the generic flow's kernel call and generic path apply it.
    dropout: float = 0.0
    #: A cached call's inputs as the graph of its functional update takes them, each
    #: ``(shape, dtype)`` (``None`` for an input it has not), which a hybridized layer's
    #: step leaves for ``export`` (:meth:`mha_multi.mxnet._graph.Graphs.stand_in`);
    #: ``None`` without a cache.
    standing: tuple[tuple[tuple[int, ...], Any] | None, ...] | None = None


def layout(
    shape: tuple[int, ...], split: tuple[int, ...], axes: tuple[int, ...], merged: tuple[int, ...]
) -> Layout:
    """``shape`` reshaped to ``split``, transposed by ``axes`` and reshaped to ``merged``.

    The transpose is left out where it moves no data (only axes of size 1
    change places), and so is a reshape that keeps the shape.
    """
    moved = [axis for axis in axes if split[axis] != 1]
    if moved == sorted(moved):
        return () if merged == shape else ((mx.npx.reshape, merged),)
    steps = () if split == shape else ((mx.npx.reshape, split),)
    return (*steps, (mx.np.transpose, axes), (mx.npx.reshape, merged))


def relaid(x: Array, steps: Layout) -> Array:
    """``x`` through the steps of a :data:`Layout`."""
    for operation, argument in steps:
        x = operation(x, argument)
    return x


def shaped_plan(
    facts: call.Facts,
    layer: Any,
    queries: Array,
    valid_lens: Array | None,
    *,
    num_keys: int,
    rows: tuple[int, ...],
    dtype: np.dtype,
    causal: bool,
    rotated_shapes: tuple[tuple[int, ...], tuple[int, ...]] | None = None,
    **fields: Any,
) -> PlainPlan:
    """A plan of a call of ``queries`` ``(B, Q, ·)`` and ``num_keys`` keys: what depends
    on their shapes (the projections, the layouts, the scores' shape) and, where
    ``valid_lens`` are given, the generic flow's kernel plan for them, which reads no
    value on MXNet (:meth:`mha_multi.call.Facts.plan_values`): decided once.

    ``rows``: the keys' and values' layout, ``(B*H_kv, K, dh)`` or a cache's rows
    ``(B, H_kv, T, dh)``; ``rotated_shapes``: the queries' and keys' shapes as
    rotated, where they are; ``fields``: the plan's others (norms, window,
    score options, rotation, mask lengths, ``max_length``).
    """
    heads = layer.heads
    batch, num_queries = queries.shape[:2]
    dh, kv_heads, group = heads.head_dim, heads.num_kv_heads, heads.group_size
    units = {"q": heads.query_features, "k": heads.kv_features, "v": heads.kv_features}
    units["o"] = layer.num_hiddens
    projections = []
    for name, width in units.items():
        dense = getattr(layer, f"W_{name}")
        projections.append((dense.weight, dense.bias, width))
    q_shape = (batch, num_queries, heads.query_features)
    v_shape = (batch, num_keys, heads.kv_features)
    kernel = None
    if valid_lens is not None:
        q, k = (mx.np.zeros(shape, dtype=dtype, ctx=queries.ctx) for shape in (q_shape, v_shape))
        flags = {"causal": causal, "dropout": layer.dropout > 0, "kv_split": False}
        kernel = call.plan(
            facts, q, k, k, valid_lens, heads=heads, return_attention_weights=False, **flags
        )
    k_shape = v_shape
    if rotated_shapes is not None:
        q_shape, k_shape = rotated_shapes
    split = (batch, num_keys, kv_heads, dh)
    return PlainPlan(
        projections=tuple(projections),
        heads=heads,
        facts=facts,
        ops=facts.ops(queries),
        causal=causal,
        kernel=kernel,
        num_heads=heads.num_heads,
        scale=math.sqrt(dh),
        queries=layout(
            q_shape,
            (batch, num_queries, kv_heads, group, dh),
            (0, 2, 3, 1, 4),
            (batch * kv_heads, group * num_queries, dh),
        ),
        keys=layout(k_shape, split, (0, 2, 1, 3), rows),
        values=layout(v_shape, split, (0, 2, 1, 3), rows),
        output=layout(
            (batch * kv_heads, group * num_queries, dh),
            (batch, kv_heads, group, num_queries, dh),
            (0, 3, 1, 2, 4),
            (batch, num_queries, heads.query_features),
        ),
        scores=(batch * kv_heads, group * num_queries, num_keys),
        num_new=num_queries,
        dropout=layer.dropout,
        **fields,
    )


def kept(plans: Kept, key: tuple, made: PlainPlan | object | None) -> PlainPlan | None:
    """``made`` (a signature's first plan, ``None`` where the route takes none) kept in
    ``plans`` for ``key`` and returned; ``None``, and nothing kept, where it is
    :data:`NOT_YET`. Asked only where ``plans.get(key, NOT_YET)`` found no plan:
    a signature's later calls find theirs with that lookup alone."""
    if made is NOT_YET:
        return None
    return plans.keep(key, made)

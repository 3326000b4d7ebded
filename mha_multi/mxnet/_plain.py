"""MXNet's route for plain self-attention called imperatively: one plan per signature.

A call whose queries are its keys and values and that asks for nothing else
(:func:`mha_multi.call.plain_self_attention`), of a layer with any options,
made imperatively (without a cache, recording a gradient or not; a hybridized
layer with options runs its calls so too, and a hybridized layer without
options its decoding steps that record nothing, whose rows are written outside
any graph), is offered to
:func:`plain_attention` before any check (docs: "Fast paths"). The first call
of a signature (the queries' shape, dtype and device, ``causal``, a cache's
arrays; a layer keeps a table of them for its options) runs the generic flow's
checks, which raise its errors, and makes a
:class:`~mha_multi.mxnet._plain_plan.PlainPlan`: the layouts as concrete
reshapes (a transpose that moves no data left out), a causal call's mask
lengths, the rotary tables. Every call of that signature then runs the
fused route's operations (:mod:`mha_multi.mxnet._kernel`) on the same arrays:
the projections, the query/key norms (:func:`mha_multi.spec.normalize_qk`, the
generic flow's own), the rotation, the scaled queries' ``batch_dot``,
``softmax``, the weights' dropout and ``batch_dot`` (with a soft cap, sinks or
ALiBi, which no kernel of MXNet takes, the generic path's attention,
:meth:`mha_multi.call.Facts.generic_attention`, called as the generic flow
calls it), the output projection, so the numbers are the generic flow's to the
bit, and so are the gradients ``autograd.record()`` takes of them (with
dropout in training mode, the same mask: one draw of MXNet's random state of
the same shape, where the generic flow draws it).

A decoding step (new positions appended to a cache, one per example, or
several without the causal rule) still reads the cache's lengths and the
values past the positions it attends over at every call, as the generic flow
does: a cache without room, negative lengths, a non-finite value past them
or a window that hides keys (a layer's window is taken where it
holds every position, as the generic flow plans such a step without it; a
call without a cache takes its mask) return ``None`` before anything is
written, and the generic flow checks and runs the call. The step writes its
rows into the cache's arrays (a ragged batch's, each example's at its own
position) and attends over the filled positions rounded up to the facts' span
bucket (:meth:`mha_multi.call.Facts.span_bucket_of`), those past
the filled ones hidden by ``sequence_mask``, as the generic flow does
for a call that records nothing.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import mxnet as mx
import numpy as np

# MXNet's registered numpy operators: those ``q / s``, ``a * b``, ``a + b``
# and ``np.flip`` reach, without the Python dispatch in front of them (some
# 15 function calls an operation: docs "Results", calls per call).
from mxnet.ndarray.numpy import _internal as _npi

from mha_multi import call, spec
from mha_multi.call.rotary_tables import kept_tables
from mha_multi.mxnet._kernel import weights_dropout
from mha_multi.mxnet._ops import apart, copied_to
from mha_multi.mxnet._plain_plan import NOT_YET, PlainPlan, kept, relaid, shaped_plan
from mha_multi.spec.memo import KeptBy

__all__ = ["PLANS_PER_LAYER", "attend_projected", "plain_attention", "plans_of", "project"]

Array = Any
#: How many signatures' plans a layer keeps, the oldest dropped first.
PLANS_PER_LAYER = 16

#: Plans by layer, then by signature; ``None`` for a signature the route does not take.
_PLANS = KeptBy(PLANS_PER_LAYER)
#: The generic path's settings of a call the plans take (:func:`_scored`).
_GENERIC = {"head_parallel": False, "return_attention_weights": False}
#: The spec's operations on the host (a call's mask lengths, :func:`_mask_lengths`).
_HOST = spec.NumpyOps()


def plans_of(layer: Any) -> dict[tuple, PlainPlan | None]:
    """The plans ``layer`` keeps, by signature (``None``: a signature the route does not take)."""
    return _PLANS.get(layer, {})


def plain_attention(
    facts: call.Facts,
    layer: Any,
    queries: Any,
    cache: Any,
    *,
    causal: bool,
    dtype: np.dtype,
    options: spec.LayerOptions | None,
    valid_lens: Any = None,
) -> call.Result | None:
    """Plain self-attention by the plan of its signature, or ``None`` (the generic flow).

    Taken by an imperative layer, or a hybridized one with options (whose
    calls run on its arrays, not in a graph), for a call of ``mxnet.numpy``
    arrays; with a cache, a :class:`mha_multi.spec.KVCache` of them recording
    nothing (see the module's docstring), by a hybridized layer without
    options too (the step's functional graph left for ``export``,
    :meth:`mha_multi.mxnet._graph.Graphs.stand_in`). A layer's dropout acts on the
    weights where the generic flow's does (``npx.dropout``, in training mode
    only), drawing the same mask from MXNet's random state.

    Args:
        facts: MXNet's facts (their checks, :meth:`~mha_multi.call.Facts.finite_past`
            and :meth:`~mha_multi.call.Facts.cache_prefix`).
        layer: the :class:`mha_multi.mxnet.MultiHeadAttention`.
        queries: the call's queries, which are its keys and values.
        cache: the call's cache, unchecked, or ``None``.
        causal: the call's flag (a bool).
        dtype: the layer's dtype.
        options: the layer's checked options, or ``None``.
        valid_lens: the call's lengths, unchecked: an ``mxnet.numpy`` array on the
            queries' device, of a call without a cache (else the generic flow).
    """
    # A hybridized layer without options runs its graphs, but for a decoding step that
    # records nothing: that step writes its rows outside any graph, and took 1.8x the
    # plan's time with its attention in a graph (docs: "Fast paths"). With options,
    # which a graph takes as no host constants, a layer runs the generic flow on its
    # arrays, whose numbers the plan gives.
    graphed = layer._active and (options is None or options.is_default)
    if type(queries) is not mx.np.ndarray or (graphed and cache is None):
        return None
    if cache is not None and mx.autograd.is_recording():
        return None  # (a recorded cached call updates its cache functionally)
    ctx = queries.ctx
    key: tuple[Any, ...] = (queries.shape, queries.dtype, ctx, causal, dtype)
    if valid_lens is not None:
        if cache is not None or type(valid_lens) is not mx.np.ndarray or valid_lens.ctx != ctx:
            return None  # (the generic flow's conversions, or a cached call's new lengths)
        key += (valid_lens.shape, valid_lens.dtype)
    if cache is not None:
        if type(cache) is not spec.KVCache:
            return None
        for x in cache:
            if type(x) is not mx.np.ndarray:
                return None
            key += (x.shape, x.dtype, x.ctx)
    plans = _PLANS.of(layer, options)  # (the layer's options, set anew, make a new table)
    plan = plans.get(key, NOT_YET)
    if plan is NOT_YET:
        made = _plan(
            facts, layer, queries, cache, valid_lens, causal=causal, dtype=dtype, options=options
        )
        plan = kept(plans, key, made)
    if plan is None:
        return None
    if cache is None:
        return call.Result(_attend(plan, queries, valid_lens, ctx), None, None)
    result = _step(facts, plan, queries, cache, ctx)
    if graphed and result is not None:
        # What export writes for it: its functional graph, as for the graph's own steps.
        layer._graphs.stand_in(plan.standing, ctx, causal=causal, return_attention_weights=False)
    return result


def _plan(
    facts: call.Facts,
    layer: Any,
    queries: Any,
    cache: spec.KVCache | None,
    valid_lens: Any,
    *,
    causal: bool,
    dtype: np.dtype,
    options: spec.LayerOptions | None,
) -> PlainPlan | object | None:
    """The plan of a call's signature after the generic flow's checks (which raise its
    errors); ``None`` for a signature the route does not take,
    :data:`~mha_multi.mxnet._plain_plan.NOT_YET` while an input size is deferred."""
    if cache is None:
        call.check_call(
            facts, layer, queries, queries, queries, valid_lens, causal=causal, dtype=dtype
        )
    else:
        call.check_cached_call(
            facts, layer, queries, queries, queries, None, cache, causal=causal, dtype=dtype
        )
    if None in layer.input_sizes().values():
        return NOT_YET  # the generic flow's first call fixes them
    batch, num_new = queries.shape[:2]
    heads = layer.heads
    dh, kv_heads = heads.head_dim, heads.num_kv_heads
    if dtype.itemsize < 4 or 0 in (batch, num_new):
        return None  # 16-bit products in float32, or an empty call: the generic flow
    options = options or spec.LayerOptions()
    rotary, norm, window = options.rotary, options.qk_norm, options.window
    scored = None
    if options.softcap is not None or options.sinks or options.alibi:
        # (The generic flow's score options but the window, which hides nothing where the
        # plan runs, and a step's query positions, made at each step.)
        slopes = spec.alibi_slopes(heads.num_heads) if options.alibi else None
        sinks = layer.sinks if options.sinks else None
        scored = (spec.ScoreOptions(softcap=options.softcap, alibi_slopes=slopes), sinks)
    if window is not None and cache is None:
        # (The generic flow gives a call without a cache its window's mask, which
        # MXNet's kernel does not take: the generic path, with its own numbers.)
        return None
    if rotary is not None and (
        rotary.interleaved or rotary.depends_on_length or rotary.dim(dh) != dh
    ):
        return None
    max_length = standing = None
    if cache is not None:
        if (causal and num_new > 1) or np.dtype(cache.lengths.dtype) != np.int32:
            return None  # a causal chunk needs a mask per query; lengths are made int32
        max_length = cache.keys.shape[2]
        # (What a hybridized layer's step leaves for export; no import of the graphs,
        # which import these facts.)
        standing = layer._graphs.functional_inputs(queries, queries, queries, cache, None)
    rotated = tables = shapes = None
    if rotary is not None:
        half = (2, dh // 2)
        rotated = (batch, num_new, heads.num_heads + kv_heads, *half)
        count = num_new if max_length is None else max_length
        cos, sin = kept_tables(facts.ops(queries), queries, queries.ctx, rotary, dh, count)
        tables = (mx.np.stack([cos, cos], axis=2), mx.np.stack([-sin, sin], axis=2))
        shapes = (batch, num_new, heads.num_heads, *half), (batch, num_new, kv_heads, *half)
    rows = (batch * kv_heads, num_new, dh) if cache is None else (batch, kv_heads, num_new, dh)
    mask_lengths = None
    if causal and num_new > 1:
        lengths = np.tile(np.arange(1, num_new + 1, dtype=np.int32), batch * heads.num_heads)
        mask_lengths = mx.np.array(lengths, dtype=np.int32, ctx=queries.ctx)
    return shaped_plan(
        facts,
        layer,
        queries,
        valid_lens if scored is None else None,
        num_keys=num_new,
        rows=rows,
        dtype=dtype,
        causal=causal,
        rotated_shapes=shapes,
        norm=norm,
        norms=None if norm is None else (layer.q_norm, layer.k_norm),
        window=window,
        scored=scored,
        rotated=rotated,
        tables=tables,
        mask_lengths=mask_lengths,
        max_length=max_length,
        standing=standing,
    )


def project(x: Array, projection: tuple[Any, Any, int], ctx: mx.Context) -> Array:
    """``W x + b`` as :class:`mha_multi.mxnet._projections.Projections` computes it (float32
    and float64: the plans take no 16-bit layer)."""
    weight, bias, units = projection
    return mx.npx.fully_connected(
        x,
        weight.data(ctx),
        None if bias is None else bias.data(ctx),
        no_bias=bias is None,
        num_hidden=units,
        flatten=False,
    )


def _projected(plan: PlainPlan, queries: Array, ctx: mx.Context) -> tuple[Array, Array, Array]:
    """The queries, keys and values projected, the queries and keys normalised where
    the layer has norms (before any rotation, as the generic flow)."""
    projections = plan.projections
    q = project(queries, projections[0], ctx)
    k = project(queries, projections[1], ctx)
    v = project(queries, projections[2], ctx)
    if plan.norm is not None:
        weights = tuple(parameter.data(ctx) for parameter in plan.norms)
        q, k = spec.normalize_qk(plan.ops, q, k, weights, plan.norm, plan.heads)
    return q, k, v


def _rotated(
    plan: PlainPlan, q: Array, k: Array, tables: tuple[Array, Array]
) -> tuple[Array, Array]:
    """``q`` and ``k`` rotated side by side (:func:`mha_multi.spec.rotate`'s numbers).

    ``x1 cos - x2 sin`` and ``x2 cos + x1 sin`` are the two halves of ``x *
    [cos, cos] + flip(x) * [-sin, sin]``: the same products, and ``a + (-b)``
    is ``a - b`` to the bit.
    """
    cos, sin = tables
    both = mx.npx.reshape(_npi.concatenate(q, k, axis=2), plan.rotated)
    turned = _npi.add(_npi.multiply(both, cos), _npi.multiply(_npi.flip(both, axis=3), sin))
    heads = plan.num_heads
    q = mx.npx.slice(turned, (None, None, 0), (None, None, heads))
    return q, mx.npx.slice(turned, (None, None, heads), (None, None, None))


def _context(
    plan: PlainPlan, q: Array, k: Array, v: Array, mask_lengths: Array | None = None
) -> Array:
    """The fused route's attention (:func:`mha_multi.mxnet._kernel.sequence_mask_attention`).

    ``q`` as projected or rotated, ``k`` and ``v`` ``(B*H_kv, K, dh)``; returns
    the heads' context ``(B, T, H*dh)``. ``mask_lengths``: the visible keys of
    each row of the scores, the plan's (a causal call's) where not given.
    """
    if mask_lengths is None:
        mask_lengths = plan.mask_lengths
    q = relaid(_npi.true_divide_scalar(q, plan.scale), plan.queries)
    scores = mx.npx.batch_dot(q, k, transpose_b=True)
    if mask_lengths is not None:
        masked = mx.npx.sequence_mask(
            mx.npx.reshape(scores, (-5, -2)),
            mask_lengths,
            use_sequence_length=True,
            value=spec.MASK_VALUE,
            axis=1,
        )
        scores = mx.npx.reshape(masked, (*plan.scores[:2], -1))
    weights = mx.npx.softmax(scores, axis=-1)
    if plan.dropout and mx.autograd.is_training():
        # (The kernel call's. Outside training mode npx.dropout returns the weights and
        # draws nothing: the generic flow's numbers without the call.)
        weights = mx.npx.dropout(weights, p=plan.dropout)
    return relaid(mx.npx.batch_dot(weights, v), plan.output)


def _attend(plan: PlainPlan, queries: Array, valid_lens: Array | None, ctx: mx.Context) -> Array:
    """The output of a call without a cache (``valid_lens``: its lengths, or ``None``)."""
    q, k, v = _projected(plan, queries, ctx)
    if plan.tables is not None:
        q, k = _rotated(plan, q, k, plan.tables)
    return attend_projected(plan, q, k, v, valid_lens, ctx)


def attend_projected(
    plan: PlainPlan, q: Array, k: Array, v: Array, valid_lens: Array | None, ctx: mx.Context
) -> Array:
    """The output of a call without a cache from its projections (rotated where the
    plan rotates): ``q`` ``(B, Q, ·)``, ``k`` and ``v`` ``(B, K, ·)``; ``valid_lens``
    its lengths, or ``None``."""
    if plan.scored is None and (valid_lens is None or plan.kernel.fused):
        lengths = None if valid_lens is None else _mask_lengths(plan, valid_lens, len(q))
        context = _context(plan, q, relaid(k, plan.keys), relaid(v, plan.values), lengths)
    else:
        if plan.tables is not None:  # (B, T, H*dh), as projected
            q, k = (mx.npx.reshape(x, (-2, -2, -1)) for x in (q, k))
        context = _scored(plan, q, k, v, valid_lens, ctx, causal=plan.causal)
    return project(context, plan.projections[3], ctx)


def _mask_lengths(plan: PlainPlan, valid_lens: Array, batch: int) -> Array:
    """The kernel's ``sequence_mask`` lengths of a call with lengths, one per row of the
    scores (example, head, query), counted on the host from the lengths read.

    The generic flow's kernel call counts the same mask on the device
    (:func:`mha_multi.mxnet._kernel.sequence_mask_attention`): the spec's
    visibility of integer positions against the lengths, the same integers
    on either side (the comparisons are exact), so the same scores are hidden.
    """
    num = plan.num_new
    seen = plan.kernel.mask(_HOST, num, plan.scores[-1], valid_lens.asnumpy())
    counts = seen.sum(axis=-1, dtype=np.int32)  # (B, 1, 1|Q) or (Q,)
    rows = np.broadcast_to(counts, (batch, plan.num_heads, num)).reshape(-1)
    return copied_to(valid_lens.ctx, rows, np.int32)


def _scored(
    plan: PlainPlan,
    q: Array,
    k: Array,
    v: Array,
    valid_lens: Array | None,
    ctx: mx.Context,
    *,
    causal: bool = False,
    positions: Array | None = None,
    kv_split: bool = False,
) -> Array:
    """The generic path's attention (:meth:`mha_multi.call.Facts.generic_attention`) with
    the plan's score options (a soft cap, sinks, ALiBi; none for a call with lengths
    whose kernel plan is the generic path's), as the generic flow calls it: ``q``
    ``(B, T, H*dh)``, ``k`` and ``v`` ``(B, K, H_kv*dh)``, or with ``kv_split`` a
    cache's ``(B, H_kv, K, dh)``; ``valid_lens`` the call's or the cache's lengths
    and, with ALiBi, the new rows' ``positions`` ``(B, T)``."""
    options, sinks = plan.scored or (spec.NO_OPTIONS, None)
    if positions is not None:
        options = dataclasses.replace(options, query_positions=positions)
    if sinks is not None:
        options = options.with_sinks(sinks.data(ctx))
    settings = {"heads": plan.heads, "causal": causal, "kv_split": kv_split}
    dropout = plan.dropout if mx.autograd.is_training() else 0.0  # (as _context's)
    settings["dropout"] = weights_dropout(plan.ops, dropout)
    attend = plan.facts.generic_attention
    context, _ = attend(plan.ops, q, k, v, valid_lens, options=options, **settings, **_GENERIC)
    return context


def _step(
    facts: call.Facts, plan: PlainPlan, queries: Array, cache: spec.KVCache, ctx: mx.Context
) -> call.Result | None:
    """A decoding step: its rows written into the cache, attention over the filled positions.

    A ragged batch (examples that hold different lengths) writes each
    example's rows at its own position in one scatter and hides the keys
    past each example's by the scores' mask, as the generic flow's kernel
    call does (its ``sequence_mask`` lengths, one per row of the scores).
    """
    keys, values, lengths = cache
    if not apart(keys, values):
        return None  # (shared memory: the generic flow writes new arrays, FACTS.write_cache)
    read = lengths.asnumpy()
    num_new, max_length = plan.num_new, plan.max_length
    start = int(read[0])
    ragged = not (read == start).all()
    if ragged:
        start, most = int(read.min()), int(read.max())
    else:
        most = start
    span = most + num_new
    if start < 0 or span > max_length:
        return None  # the generic flow refuses it
    if plan.window is not None and span > plan.window:
        return None  # the window hides keys: the generic flow's mask
    # The generic flow's span (CacheFill.span): the filled positions rounded up to the
    # facts' bucket, those past the filled ones hidden by the mask lengths.
    attended = spec.rounded_span(span, max_length, facts.span_bucket_of(keys))
    if attended < max_length and not facts.finite_past(keys, values, attended):
        return None  # the generic flow attends over every position
    q, k, v = _projected(plan, queries, ctx)
    if ragged:
        # Each new row's position, (B, T), on the host: the lengths were read.
        positions = read.astype(np.int64)[:, None] + np.arange(num_new)
    if plan.tables is not None:
        cos, sin = plan.tables
        if ragged:
            index = copied_to(ctx, positions, np.int64)
            rows = mx.np.take(cos, index, axis=0), mx.np.take(sin, index, axis=0)
        else:
            rows = mx.npx.slice(cos, (start,), (span,)), mx.npx.slice(sin, (start,), (span,))
        q, k = _rotated(plan, q, k, rows)
    k, v = relaid(k, plan.keys), relaid(v, plan.values)  # (B, H_kv, T, dh)
    if ragged:
        batch, kv_heads, _, head_dim = keys.shape
        # keys[b, j, positions[b, t]] = k[b, j, t]: one scatter of (B*H_kv*T) rows.
        example, head, _ = np.indices((batch, kv_heads, num_new))
        where = np.broadcast_to(positions[:, None, :], example.shape)
        index = copied_to(ctx, np.stack([example, head, where]).reshape(3, -1), np.int64)
        for held, rows_of in ((keys, k), (values, v)):
            rows_of = mx.npx.reshape(rows_of, (-1, head_dim))
            _npi.scatter_set_nd(lhs=held, rhs=rows_of, indices=index, shape=held.shape, out=held)
    else:
        begin, end, step = (None, None, start, None), (None, None, span, None), (None,) * 4
        keys.slice_assign(k, begin, end, step)
        values.slice_assign(v, begin, end, step)
    held_keys, held_values = keys, values
    if attended < max_length:
        held_keys, held_values = facts.cache_prefix(keys, values, attended)
    if plan.scored is None:
        mask_lengths = None
        if ragged:
            # Each example's keys past its own are hidden (one query per new position,
            # the rows of the scores in their order: example, head, query).
            visible = np.repeat(read.astype(np.int32) + num_new, plan.num_heads * num_new)
            mask_lengths = copied_to(ctx, visible, np.int32)
        elif attended > span:
            # (Every row sees the filled positions: made where it lies, no copy from the
            # host; the registered operator, mx.np.full's, without its Python around it.)
            rows = plan.scores[0] * plan.scores[1]
            mask_lengths = _npi.full(shape=(rows,), value=span, ctx=ctx, dtype=np.int32)
        # (B, H_kv, span, dh) -> (B*H_kv, span, dh)
        held_keys, held_values = (
            mx.npx.reshape(held_keys, (-5, -4)),
            mx.npx.reshape(held_values, (-5, -4)),
        )
        context = _context(plan, q, held_keys, held_values, mask_lengths)
    else:  # (the cache's (B, H_kv, span, dh), each example's lengths after the step)
        held = copied_to(ctx, read.astype(np.int32) + num_new, np.int32)
        if plan.tables is not None:
            q = mx.npx.reshape(q, (-2, -2, -1))
        query_positions = None
        if plan.scored[0].alibi_slopes is not None:  # (ALiBi sees each query at its position)
            query_positions = spec.cache_positions(plan.ops, lengths, plan.ops.size(q, 1))
        context = _scored(
            plan, q, held_keys, held_values, held, ctx, positions=query_positions, kv_split=True
        )
    output = project(context, plan.projections[3], ctx)
    new_lengths = _npi.add_scalar(lengths, float(num_new))
    return call.Result(output, None, spec.KVCache(keys, values, new_lengths))

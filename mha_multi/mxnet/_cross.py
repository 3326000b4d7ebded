"""MXNet's route for plain cross-attention called imperatively: one plan per signature.

A call without a cache whose keys and values are its own (not both its
queries) and that asks for nothing else
(:func:`mha_multi.call.plain_cross_attention`), d2l's ``attention(X, Y, Y,
valid_lens)`` of a decoder attending to its encoder, of an imperative layer
without options, recording a gradient or not, is offered to
:func:`cross_attention` before any check (docs: "Fast paths"). The first
call of a signature (the queries', keys', values' and lengths' shapes,
dtypes and device) runs the generic flow's checks, which raise its errors,
and makes a :class:`~mha_multi.mxnet._plain_plan.PlainPlan` as self-attention's
route does (:mod:`mha_multi.mxnet._plain`), the keys' own length in its
layouts: every call of that signature then projects the queries, keys and
values and runs that route's attention and output projection, the generic
flow's operations on the same arrays, so its numbers and gradients to the
bit. A causal call takes the generic flow.
"""

from __future__ import annotations

from typing import Any

import mxnet as mx
import numpy as np

from mha_multi import call, spec
from mha_multi.mxnet._plain import PLANS_PER_LAYER, attend_projected, project
from mha_multi.mxnet._plain_plan import NOT_YET, PlainPlan, kept, shaped_plan
from mha_multi.spec.memo import KeptBy

__all__ = ["cross_attention", "plans_of"]

#: Plans by layer, then by signature; ``None`` for a signature the route does not take.
_PLANS = KeptBy(PLANS_PER_LAYER)


def plans_of(layer: Any) -> dict[tuple, PlainPlan | None]:
    """The cross-attention plans ``layer`` keeps, by signature (``None``: a signature
    the route does not take)."""
    return _PLANS.get(layer, {})


def cross_attention(
    facts: call.Facts,
    layer: Any,
    queries: Any,
    keys: Any,
    values: Any,
    *,
    causal: bool,
    dtype: np.dtype,
    options: spec.LayerOptions | None,
    valid_lens: Any = None,
) -> call.Result | None:
    """Plain cross-attention by the plan of its signature, or ``None`` (the generic flow).

    Taken by an imperative layer without options, for a call that is not
    causal and whose arrays are ``mxnet.numpy`` arrays on one device (the
    lengths too, where given); dropout as the self-attention plan's.

    Args:
        facts: MXNet's facts (their checks and kernel plan).
        layer: the :class:`mha_multi.mxnet.MultiHeadAttention`.
        queries, keys, values: the call's, unchecked.
        causal: the call's flag (a bool).
        dtype: the layer's dtype.
        options: the layer's checked options, or ``None``.
        valid_lens: the call's lengths, unchecked, or ``None``.
    """
    if layer._active or causal or not (options is None or options.is_default):
        return None  # (a hybridized layer runs its graphs)
    ndarray = mx.np.ndarray
    if type(queries) is not ndarray or type(keys) is not ndarray or type(values) is not ndarray:
        return None  # (the generic flow's conversions)
    ctx = queries.ctx
    if keys.ctx != ctx or values.ctx != ctx:
        return None  # (the generic flow's error)
    key: tuple[Any, ...] = (queries.shape, keys.shape, values.shape, ctx, dtype)
    key += (queries.dtype, keys.dtype, values.dtype)
    if valid_lens is not None:
        if type(valid_lens) is not ndarray or valid_lens.ctx != ctx:
            return None  # (the generic flow's conversions)
        key += (valid_lens.shape, valid_lens.dtype)
    plans = _PLANS.of(layer, options)
    plan = plans.get(key, NOT_YET)
    if plan is NOT_YET:
        plan = kept(plans, key, _plan(facts, layer, queries, keys, values, valid_lens, dtype=dtype))
    if plan is None:
        return None
    projections = plan.projections
    q = project(queries, projections[0], ctx)
    k = project(keys, projections[1], ctx)
    v = project(values, projections[2], ctx)
    return call.Result(attend_projected(plan, q, k, v, valid_lens, ctx), None, None)


def _plan(
    facts: call.Facts,
    layer: Any,
    queries: Any,
    keys: Any,
    values: Any,
    valid_lens: Any,
    *,
    dtype: np.dtype,
) -> PlainPlan | object | None:
    """The plan of a call's signature after the generic flow's checks (which raise its
    errors); ``None`` for a signature the route does not take,
    :data:`~mha_multi.mxnet._plain_plan.NOT_YET` while an input size is deferred."""
    call.check_call(facts, layer, queries, keys, values, valid_lens, causal=False, dtype=dtype)
    if None in layer.input_sizes().values():
        return NOT_YET  # the generic flow's first call fixes them
    batch, num_queries = queries.shape[:2]
    num_keys = keys.shape[1]
    if dtype.itemsize < 4 or 0 in (batch, num_queries, num_keys):
        return None  # 16-bit products in float32, or an empty call: the generic flow
    heads = layer.heads
    return shaped_plan(
        facts,
        layer,
        queries,
        valid_lens,
        num_keys=num_keys,
        rows=(batch * heads.num_kv_heads, num_keys, heads.head_dim),
        dtype=dtype,
        causal=False,
        norm=None,
        norms=None,
        window=None,
        scored=None,
        rotated=None,
        tables=None,
        mask_lengths=None,
        max_length=None,
    )

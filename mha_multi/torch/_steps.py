"""The plain route's decoding step written out in one function, on each plan.

A decoding step's cost on the host is its Python as much as its kernels
(docs: "Fast paths"): :func:`fused_step` (SDPA after the one finiteness
read, the host's plan) and :func:`generic_step` (the generic path's
attention, which reads nothing: a GPU's plan) run the operations the
generic flow would, on the same tensors, with none of its indirection.
:class:`mha_multi.torch._plain.PlainRoute` decides which, once per layer and
shapes (:class:`PlainPlan`).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from mha_multi import call, spec
from mha_multi.torch._cache import CacheCheck, next_lengths, written_step
from mha_multi.torch._ops import OPS, SIXTEEN_BIT
from mha_multi.torch._rotary import WideTables, rotate_stacked

__all__ = ["PlainPlan", "fused_step", "generic_step", "step_attention"]


class PlainPlan(NamedTuple):
    """How :meth:`PlainRoute.plain_attention` runs the calls of one layer and shapes.

    ``fused``: SDPA with ``arguments`` after the one finiteness read (the
    generic flow's plan for values read finite). Otherwise the generic
    path's attention (:meth:`mha_multi.call.Facts.generic_attention`) and no
    read: the generic flow's plan on a GPU where a head's scores are few
    (:func:`mha_multi.spec.reads_values`). ``bounded``: SDPA's causal flag
    hides keys, so the read takes the largest query and key too, whose
    scores must lie within :data:`mha_multi.spec.FUSED_SCORE_LIMIT`.
    ``tables``: a rotary layer's :func:`mha_multi.spec.rotary_tables`, made
    once: of the call's ``arange(Q)`` without a cache, of every position of
    the cache with one (a step takes its row); ``wide_tables`` the same as
    :func:`mha_multi.torch._rotary.wide_tables`, where whole heads rotate.
    A decoding step's generic plan: ``positions``, the cache's
    ``arange(max_length)`` where it lies (a step's mask is of them), and
    ``spans``, each filled length's span (:func:`mha_multi.spec.rounded_span`)
    as steps meet them, or ``None`` where the generic flow would read
    (:func:`mha_multi.spec.reads_values`); ``direct``: its products are the
    product itself (``F.linear``), neither 16-bit off CUDA nor autocast's.
    """

    fused: bool
    arguments: dict[str, Any]
    bounded: bool = False
    tables: tuple[torch.Tensor, torch.Tensor] | None = None
    wide_tables: WideTables | None = None
    positions: torch.Tensor | None = None
    spans: dict[int, int | None] | None = None
    direct: bool = False


def fused_step(
    layer: call.Projections,
    queries: torch.Tensor,
    cache: spec.KVCache,
    check: CacheCheck,
    plan: PlainPlan,
    step: tuple[Any, tuple, Any],
    rotates: bool,
) -> call.Result | None:
    """The plain route's decoding step on a fused plan (the host's).

    The route's operations for one query per example, written out in one
    function: a step's cost on the host is its Python as much as its
    kernels (docs: "Fast paths"). ``rotates``: the layer's ``rotary``, whose
    tables the plan holds. ``None`` where the values read are not finite,
    before anything is written.
    """
    heads = layer._heads
    query_width, kv_width = heads.query_features, heads.kv_features
    num_kv_heads, head_dim = heads.num_kv_heads, heads.head_dim
    keys, values, lengths = cache
    length = check._uniform  # (CacheCheck.uniform, which the route's check resolved)
    modules = layer._modules
    # (The layer was called before: its parameters are sized; views of them where packed.)
    stacked = layer._stacks.views((modules["W_q"], modules["W_k"], modules["W_v"]))
    projected = torch.nn.functional.linear(queries, *(stacked or layer.stacked_parameters(queries)))
    if not rotates:
        q, k, v = projected.split_with_sizes((query_width, kv_width, kv_width), -1)
        total = projected.sum()  # (float32 or float64: a fused plan's dtypes)
    else:
        q, k, v, turned = rotate_stacked(
            projected, plan.tables, plan.wide_tables, layer.options.rotary, heads, length
        )
        total = turned.sum() + v.sum()
    # One query sees its keys unmasked (the plan is not bounded): the read is the sum's,
    # finite iff its difference with itself is 0 (inf - inf and NaN are NaN).
    read = total.item()
    if read - read != 0.0:
        return None  # (no gradient here)
    # One position of (B, H_kv, max_length, dh) from (B, 1, H_kv*dh).
    keys.select(2, length).copy_(k.view(-1, num_kv_heads, head_dim))
    values.select(2, length).copy_(v.view(-1, num_kv_heads, head_dim))
    filled = length + 1
    updated = spec.KVCache(keys, values, next_lengths(check, lengths, filled))
    check.stepped(updated, filled, step)
    # One query per example: (B, 1, H*dh) is (B, H, 1, dh) as it lies, and back.
    batch = q.shape[0]
    context = torch.nn.functional.scaled_dot_product_attention(
        q.view(batch, heads.num_heads, 1, head_dim),
        keys.narrow(2, 0, filled),
        values.narrow(2, 0, filled),
        **plan.arguments,
    )
    parameters = modules["W_o"]._parameters
    output = torch.nn.functional.linear(
        context.reshape(batch, 1, query_width), parameters["weight"], parameters["bias"]
    )
    return call.Result(output, None, updated)


def generic_step(
    layer: call.Projections,
    queries: torch.Tensor,
    cache: spec.KVCache,
    check: CacheCheck,
    plan: PlainPlan,
    step: tuple[Any, tuple, Any] | None,
    rotates: bool,
    span: int,
) -> call.Result:
    """The plain route's decoding step on the generic plan (a GPU's): nothing read.

    The rows are written in place and left for a later read to check
    (:func:`mha_multi.torch._cache.written_step`), and the one query per
    example attends over the cache's first ``span`` positions by
    :func:`step_attention`, the generic path's operations, those past the
    filled ones hidden. ``rotates``: the layer's ``rotary``, whose tables the
    plan holds.
    """
    heads = layer._heads
    length = check._uniform  # (CacheCheck.uniform, which the route's check resolved)
    if plan.direct:
        modules = layer._modules
        stacked = layer._stacks.views((modules["W_q"], modules["W_k"], modules["W_v"]))
        weight, bias = stacked or layer.stacked_parameters(queries)
        projected = torch.nn.functional.linear(queries, weight, bias)
    else:
        projected = layer.project_stacked(queries)  # (16-bit products accumulate in float32)
    if not rotates:
        q, k, v = projected.split_with_sizes(
            (heads.query_features, heads.kv_features, heads.kv_features), -1
        )
    else:
        q, k, v, _ = rotate_stacked(
            projected, plan.tables, plan.wide_tables, layer.options.rotary, heads, length
        )
    keys, values, updated = written_step(cache, check, k, v, heads, step, span=span, checked=False)
    # Every example holds length + 1 positions now: the spec's mask of its lengths.
    visible = plan.positions.narrow(0, 0, span) < length + 1
    context = step_attention(q, keys, values, visible, heads)
    if plan.direct:
        output = torch.nn.functional.linear(context, *layer.output_parameters())
    else:
        output = layer.project_output(context, None)
    return call.Result(output, None, updated)


def step_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    visible: torch.Tensor,
    heads: spec.Heads,
) -> torch.Tensor:
    """:func:`mha_multi.spec.attention` of one query per example over a cache's positions,
    to its numbers: its products, mask and softmax on the same shapes, written for
    this case.

    Args:
        q: the queries ``(B, 1, H*dh)``.
        keys, values: the positions attended over ``(B, H_kv, S, dh)``.
        visible: which positions each query sees, booleans broadcastable to ``(B, H, 1, S)``.
        heads: the layer's heads.

    Returns:
        The heads' context ``(B, 1, H*dh)``.
    """
    batch, span = q.shape[0], keys.shape[2]
    num_heads, num_kv_heads, head_dim = heads.num_heads, heads.num_kv_heads, heads.head_dim
    # One query: the spec's grouped layout (B*H_kv, G*1, dh) is a view of (B, 1, H*dh),
    # and with G = 1 its (B*H, 1, dh) heads.
    grouped_q = q.reshape(batch * num_kv_heads, num_heads // num_kv_heads, head_dim)
    k, v = keys.flatten(0, 1), values.flatten(0, 1)
    low = q.dtype in SIXTEEN_BIT
    if low:  # (16-bit heads: float32 scores, spec.scaled_scores)
        grouped_q, k = grouped_q.float(), k.float()
    scores = torch.matmul(grouped_q, k.transpose(-1, -2)) / math.sqrt(head_dim)
    scores = torch.where(visible, scores.view(batch, num_heads, 1, span), spec.MASK_VALUE)
    weights = torch.softmax(scores, dim=-1).view(batch * num_kv_heads, -1, span)
    # (16-bit weights: rounded once, their product as the spec's adapter takes it.)
    context = OPS.matmul(weights.to(values.dtype), v) if low else torch.matmul(weights, v)
    return context.reshape(batch, 1, num_heads * head_dim)

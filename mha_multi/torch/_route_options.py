"""What the PyTorch route's plans make of a layer's options, once: a call's masks and bias.

A plan of :class:`mha_multi.torch._plain.PlainRoute` (:class:`PlainPlan`)
holds what the generic flow makes of the layer's options at every call: the
score options (:func:`call_options`), SDPA's ``attn_mask`` (:func:`kernel_mask`)
or the generic path's visibility and bias (:func:`generic_plan`), each made
with the spec's own functions. A decoding step's are those of a step at the
cache's last position, of which each step takes a view (docs: "Fast paths").
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from mha_multi import call, spec
from mha_multi.torch._ops import SIXTEEN_BIT, needs_float32_copies
from mha_multi.torch._steps import PlainPlan

__all__ = ["call_options", "fused_taken", "generic_plan", "kernel_mask"]


def fused_taken(plan: spec.KernelPlan) -> bool:
    """Whether the route runs SDPA as ``plan`` (fused) says: its causal flag, its mask of
    the causal rule and the window, and ALiBi's bias. The rows' fix is none: every
    query of self-attention sees its own key (``Q == K``; a step's at its length)."""
    plain = dataclasses.replace(
        plan,
        is_causal=False,
        mask_causal=False,
        mask_window=False,
        fix_rows=False,
        fix_causal=False,
        fix_window=False,
        bias=False,
    )
    return plain == spec.KernelPlan(fused=True)


def call_options(
    options: spec.LayerOptions, layer: call.Projections, keys: torch.Tensor | None
) -> spec.ScoreOptions:
    """The score options of a call without a cache (``keys`` ``None``), or of a decoding
    step at the last position of a cache of ``keys``: the generic flow's
    (:meth:`mha_multi.spec.LayerOptions.score_options`, whose query positions are a
    step's length for ALiBi and the window), with the layer's sink logits (which a call
    takes anew, :class:`PlainPlan`)."""
    positions = None
    if keys is not None and (options.alibi or options.window is not None):
        last = keys.shape[2] - 1
        positions = torch.full((1, 1), last, dtype=torch.int64, device=keys.device)
    score_options = options.score_options(
        num_heads=layer.heads.num_heads, query_positions=positions
    )
    return score_options.with_sinks(layer.sink_logits() if options.sinks else None)


def _frame(queries: torch.Tensor, cache: spec.KVCache | None) -> tuple[int, torch.Tensor | None]:
    """The keys a plan's masks and bias span, and their lengths: a call's own ``Q`` and
    none, or for a step ``2 * max_length`` and ``(1,)`` lengths of a cache filled to its
    last position (:class:`PlainPlan`)."""
    if cache is None:
        return queries.shape[1], None
    keys = cache.keys
    lengths = torch.full((1,), keys.shape[2], dtype=torch.int64, device=keys.device)
    return 2 * keys.shape[2], lengths


def kernel_mask(
    ops: Any,
    plan: spec.KernelPlan,
    options: spec.ScoreOptions,
    queries: torch.Tensor,
    cache: spec.KVCache | None,
) -> torch.Tensor | None:
    """SDPA's ``attn_mask`` of the call (``None``: none), as
    :func:`mha_multi.torch._kernel.fused_attention` makes it for ``plan``: the causal
    rule's and the window's booleans, ALiBi's bias, ``-inf`` where both; a step's over
    the keys of :func:`_frame`."""
    num_keys, lengths = _frame(queries, cache)
    num_queries = queries.shape[1] if cache is None else 1
    mask = plan.mask(ops, num_queries, num_keys, lengths, options) if plan.needs_mask else None
    if plan.bias:
        like = torch.empty((), dtype=queries.dtype, device=queries.device)
        bias = spec.score_bias(ops, options, num_queries, num_keys, like)
        mask = bias if mask is None else torch.where(mask, bias, float("-inf"))
    return mask


def generic_plan(
    plan: PlainPlan,
    ops: Any,
    layer: call.Projections,
    queries: torch.Tensor,
    options: spec.ScoreOptions,
    cache: spec.KVCache | None,
    *,
    causal: bool,
) -> PlainPlan:
    """``plan`` with what the generic path's attention takes: the visibility and ALiBi's
    bias of the call (a step's over the keys of :func:`_frame`), the soft cap and whether
    sinks join the softmax; for a step, the scores' fill value and whether its products
    are the layer's own (:class:`PlainPlan`)."""
    num_keys, lengths = _frame(queries, cache)
    num_queries = queries.shape[1] if cache is None else 1
    window, positions = options.window, options.query_positions
    visible = spec.visibility(
        ops, num_queries, num_keys, lengths, causal=causal, window=window, query_positions=positions
    )
    scores = torch.float32 if queries.dtype in SIXTEEN_BIT else queries.dtype
    like = torch.empty((), dtype=scores, device=queries.device)
    plan = plan._replace(
        visible=visible,
        bias=spec.score_bias(ops, options, num_queries, num_keys, like),
        softcap=options.softcap,
        sinks=options.sinks is not None,
    )
    if cache is None:
        return plan
    if visible is not None:  # (one query, the same for every example and head)
        plan = plan._replace(visible=visible.reshape(1, 1, num_keys))
    # (A step's products: those the layer's linear takes directly.)
    direct = not needs_float32_copies(queries, layer.output_parameters()[0])
    fill = torch.tensor(spec.MASK_VALUE, dtype=scores, device=queries.device)
    root = torch.tensor(math.sqrt(layer.heads.head_dim), dtype=scores)  # (on the CPU)
    return plan._replace(fill=fill, root=root, spans={}, direct=direct)

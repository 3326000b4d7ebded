"""The plain route's decoding step of a ragged batch: examples at different lengths.

A batch of prompts of different lengths decodes with each example at its own
position (docs: "Generating with a cache"). Such a step runs here in a dozen
operations: each example's row written at its own length, and one query per
example attending over the positions up to the longest's, the others' hidden
by the lengths. On the host, after the generic flow's read of the new rows and
of the keys the lengths may now hide, by SDPA with the lengths' mask (with a
window's where it hides keys, and ALiBi's bias), or by the generic path where
the read says so. Where no kernel takes the options (a soft cap, sinks), and
on a GPU, where a step reads nothing, by the generic path over the generic
flow's span, the rows left for a later read to check. Every option joins as
the generic flow makes it of each example's position: a window that hides no
key is left out, one that hides keys joins the mask, from the first position
it shows every example where the generic flow leaves those before it out,
and ALiBi's bias counts from there. These are the operations of
the generic flow's write, kernel plan and kernel call for the same call
(:func:`mha_multi.call.attend`, :func:`mha_multi.call.plan`), on the same
tensors: the numbers are its numbers to the bit, and the cache's check is
left as it leaves it. This module imports nothing of the facts.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from mha_multi import call, spec
from mha_multi.spec.memo import Kept
from mha_multi.torch._cache import CacheCheck, from_host, next_lengths, versioned
from mha_multi.torch._kernel import folded_mask
from mha_multi.torch._ops import ops_on
from mha_multi.torch._reads import extremes, finite_sum, larger, magnitude_of, read_together
from mha_multi.torch._rotary import rotate_stacked
from mha_multi.torch._steps import (
    PlainPlan,
    StepResult,
    project_output,
    step_attention,
    step_projections,
)

__all__ = ["ragged_step"]

#: ``arange(n)`` on a device, made once for each ``(n, device)``: a ragged step's
#: examples, and the key positions its lengths' mask compares.
_COUNTS: Kept = Kept(16)


def _counting(count: int, device: torch.device) -> torch.Tensor:
    """``arange(count)`` on ``device`` (int64), kept (an ordinary tensor: :func:`versioned`)."""
    made = _COUNTS.get((count, device))
    if made is None:
        with versioned():
            made = _COUNTS.keep((count, device), torch.arange(count, device=device))
    return made


def ragged_step(
    route: Any,
    plan: PlainPlan,
    layer: call.Projections,
    queries: torch.Tensor,
    cache: spec.KVCache,
    check: CacheCheck,
    step: tuple[Any, tuple, Any] | None,
    options: spec.LayerOptions | None,
) -> StepResult | None:
    """The plain route's decoding step of examples at different lengths, on a plan that
    takes them (``plan.ragged``): a fused plan whose kernel is SDPA with the lengths'
    mask, a window's and ALiBi's bias (the host's), or a generic one (a GPU's, or one of
    options no kernel takes).

    ``route``: the :class:`mha_multi.torch._plain.PlainRoute` (its span of a
    step), whose step ``plan`` this is (a window's: its plan ``within`` the window
    where the longest example's keys are). ``check``: the cache's, which holds.
    ``None`` where the plan takes no ragged step, where a fused plan would have
    rows or a poison to read, where the longest example has no room left (the
    generic flow raises), or where the generic flow reads for the span (a GPU's
    span whose scores are many, or on the host positions past the longest example
    not known finite), before anything is written. ``options``: the layer's (its
    rotary positions, whose tables of every cache position the plan holds).
    """
    keys, values, lengths = cache
    held = check.lengths  # (B,) int64, on the host
    # (Python's max and min of a few lengths: numpy's reductions cost more.)
    listed = held.tolist()
    filled, least = max(listed) + 1, min(listed)  # (the longest example's new length)
    window = plan.window  # (the layer's, where it hides keys from a query)
    if window is not None and filled <= window:
        # The generic flow plans without the window where it hides no key from any
        # example's query (call.binding_window): every example within it.
        plan, window = plan.within, None
        if plan is None:
            return None
    if not plan.ragged or (plan.fused and (check.pending is not None or check.poison is not None)):
        return None  # (the generic flow's: plans of options, rows to read)
    max_length, finite_from = keys.shape[2], check.finite_from
    if filled > max_length:
        return None
    if plan.fused:
        span = filled  # (the positions attended over: the host's kernels take any count)
        if finite_from is None or finite_from > span:
            return None
    else:
        span = route._step_span(layer, cache, filled, may_read=False)
        # The write's knowledge of the positions past the longest (CacheCheck.written_past);
        # not known, the generic flow reads them on the host (Facts.finite_past) and
        # attends over every position on a device.
        finite_from = None if finite_from is None else max(finite_from, filled)
        if span < max_length and (finite_from is None or finite_from > span):
            if route.on_host(keys):
                return None
            span = max_length
        if route._step_span(layer, cache, span, may_read=plan.may_read) is None:
            return None  # (the generic flow reads for that span)
    heads = layer._heads
    query_width, kv_width = heads.query_features, heads.kv_features
    num_kv_heads, head_dim = heads.num_kv_heads, heads.head_dim
    batch, device = queries.shape[0], queries.device
    # (A fused plan's products are the product itself: 32 or 64 bits, no autocast.)
    projected = step_projections(layer, queries, plan.fused or plan.direct, plan.norm)
    # Each example's position: the write's, and the rows of the rotary tables.
    # (The cache's lengths tensor where it lies on the device: the check holds it to
    # the lengths read.)
    positions = lengths if lengths.device == device else from_host(held, device, None)
    rotary = None if options is None else options.rotary
    if rotary is None:
        q, k, v = projected.split_with_sizes((query_width, kv_width, kv_width), -1)
        total = projected.sum() if plan.fused else None  # (float32 or float64: a fused plan's)
    else:
        q, k, v, turned = rotate_stacked(
            projected, plan.tables, plan.wide_tables, rotary, heads, positions.unsqueeze(1)
        )
        total = turned.sum() + v.sum() if plan.fused else None
    # Before writing, as the generic flow's write: the rows the calls before left pending.
    poison = None if plan.fused else check.settled()
    first = 0  # (the first cache position attended over: past a window's start)
    if window is not None:
        first, poison = _window_first(route, check, least, window, keys, poison)
    examples = _counting(batch, device)
    keys[examples, :, positions] = k.view(batch, num_kv_heads, head_dim)
    values[examples, :, positions] = v.view(batch, num_kv_heads, head_dim)
    new_held = held + 1
    updated = spec.KVCache(keys, values, next_lengths(check, lengths, listed[0] + 1, new_held))
    # The rows written from the shortest example's length on: the keys' bound holds below.
    key_upto = check.key_upto if check.key_upto < least else least
    key_max = check.key_max if key_upto else 0.0  # (a bound of nothing)
    exact = False
    if plan.fused:
        upto, finite_from, pending = max(check.upto, span), span, None
        exact, poison, key_upto, key_max = _fused_read(
            check, q, k, keys, values, total, span, first, key_upto, key_max, head_dim
        )
    else:
        upto, pending = check.upto, (k, v)
    check.ragged_stepped(
        updated,
        new_held,
        step,
        lengths,
        upto=upto,
        finite_from=finite_from,
        key_upto=key_upto,
        key_max=key_max,
        poison=poison,
        pending=pending,
    )
    # Which keys each query sees, (B, 1, 1, span - first): key j iff j < its example's
    # new length and, where the window hides keys (counted from the first position
    # attended over: call.binding_window), j > its length - window: spec.visibility's
    # rule and shape for integer lengths, spelled out (its dtype handling for lengths of
    # any kind cost a step 23 Python calls; the randomised tests hold these masks'
    # numbers to the generic flow's, which spec.visibility makes).
    seen = _counting(max_length, device).narrow(0, first, span - first)
    visible = seen < updated.lengths.view(batch, 1, 1, 1)
    if window is not None and filled - first > window:
        visible = visible & (seen > lengths.view(batch, 1, 1, 1) - window)
    bias = None
    if options is not None and options.alibi:  # (ALiBi's, of each example's position)
        # (A fused plan's scores are of the queries' dtype, 32 or 64 bits.)
        like = q if plan.fill is None else plan.fill
        bias = _alibi_bias(options, heads, lengths, first, span - first, like)
    if exact:
        mask = visible if bias is None else torch.where(visible, bias, float("-inf"))
        if plan.folded:  # (each key/value head's query heads as its queries: folds_groups)
            q = q.view(batch, num_kv_heads, heads.group_size, head_dim)
            mask = folded_mask(mask, num_kv_heads, heads.group_size)
        else:
            q = q.view(batch, heads.num_heads, 1, head_dim)
        # (A window's plan fixes rows the window and lengths hide whole: here every query
        # sees its own new key, so none is.)
        context = torch.nn.functional.scaled_dot_product_attention(
            q,
            keys.narrow(2, first, span - first),
            values.narrow(2, first, span - first),
            attn_mask=mask,
            **plan.arguments,
        ).reshape(batch, 1, query_width)
    else:
        # (A fused plan's, whose read said no: its scores' dtype is the queries'.)
        fill = spec.MASK_VALUE if plan.fill is None else plan.fill
        context = step_attention(
            q,
            *check.attended(first, span - first),
            visible,
            heads,
            fill,
            plan.root,
            softcap=plan.softcap,
            bias=bias,
            sinks=layer.sink_logits() if plan.sinks else None,
        )
    return project_output(layer, context, plan.fused or plan.direct), updated


def _fused_read(
    check: CacheCheck,
    q: torch.Tensor,
    k: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    total: torch.Tensor,
    span: int,
    first: int,
    key_upto: int,
    key_max: float,
    head_dim: int,
) -> tuple[bool, torch.Tensor | None, int, float]:
    """The generic flow's read of a ragged step on a fused plan (:meth:`Facts.plan_values
    <mha_multi.torch._facts.TorchFacts.plan_values>`), over the cache positions ``first``
    to ``span``: the new rows (``total``, their sum, with ``q`` and ``k``), the positions
    up to the span no call has checked, and the largest query and key (from ``key_upto``,
    the bound of the write's check, ``key_max``, below it) for the scores the mask may
    hide. Returns whether the kernel gives the spec's numbers, and the poison, keys'
    bound and its positions the check keeps."""
    upto = check.upto
    if upto < span:
        rest = (x.narrow(2, upto, span - upto) for x in (keys, values))
        total = total + finite_sum(*rest, eager=True)
    if first:
        # The keys attended over from the bound on (those before the window are not).
        start = key_upto if key_upto > first else first
        read = read_together([total, *extremes(q), *extremes(keys.narrow(2, start, span - start))])
        largest = larger(key_max, magnitude_of(read[3], read[4]))
        if key_upto >= first:
            key_upto, key_max = span, largest
    else:
        bounded = check.key_upto  # (the positions the check's bound holds for)
        if 0 < key_upto < bounded:
            # The same bound, read from less: a key below the check's bound unchanged
            # since is within it, so the largest key from key_upto on is the bound's,
            # the new rows' or one past the bound's positions (NaN where one is).
            bounded = min(bounded, span)
            read = read_together(
                [
                    total,
                    *extremes(q),
                    *extremes(k),
                    *extremes(keys.narrow(2, bounded, span - bounded)),
                ]
            )
            key_max = larger(key_max, magnitude_of(read[5], read[6]))
        else:
            rows = keys.narrow(2, key_upto, span - key_upto)
            read = read_together([total, *extremes(q), *extremes(rows)])
        largest = key_max = larger(key_max, magnitude_of(read[3], read[4]))
        key_upto = span
    finite = math.isfinite(read[0])
    exact = finite and spec.scores_within_limit(magnitude_of(read[1], read[2]), largest, head_dim)
    return exact, None if finite else total * 0.0, key_upto, key_max


def _window_first(
    route: Any,
    check: CacheCheck,
    least: int,
    window: int,
    keys: torch.Tensor,
    poison: torch.Tensor | None,
) -> tuple[int, torch.Tensor | None]:
    """The first cache position a ragged step of a windowed layer attends over, and the
    poison its write leaves, as the generic flow leaves them out and reads it
    (:func:`mha_multi.call.attended_positions`, :meth:`mha_multi.call.Facts.finite_before`).

    The first position the shortest example's query (at ``least``) sees through the
    window, rounded down to the span bucket, where every value before it is known
    finite: the check's positions reach it, and the write's ``poison`` (the rows no
    call read) is none, or on the host read finite (then none); else 0.
    """
    first = spec.window_first(least, window, route.span_bucket_of(keys))
    if not first or check.upto < first:
        return 0, poison
    if poison is not None and (not route.on_host(keys) or not math.isfinite(poison.item())):
        return 0, poison
    return first, None


def _alibi_bias(
    options: spec.LayerOptions,
    heads: spec.Heads,
    lengths: torch.Tensor,
    first: int,
    count: int,
    like: torch.Tensor,
) -> torch.Tensor:
    """ALiBi's bias of a ragged step's one query per example over ``count`` cache
    positions from ``first``, as the generic flow makes it (:func:`mha_multi.call.attend`):
    of the queries at ``lengths`` (the cache's before the step), counted from ``first``
    (:func:`mha_multi.spec.score_bias`, of ``like``'s dtype and on its device)."""
    ops = ops_on(like.device)  # (the adapter the generic flow's call has: its aranges there)
    positions = spec.cache_positions(ops, lengths, 1)
    if first:
        positions = positions - first
    scores = options.score_options(num_heads=heads.num_heads, query_positions=positions)
    return spec.score_bias(ops, scores, 1, count, like)

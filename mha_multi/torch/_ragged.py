"""The plain route's decoding step of a ragged batch: examples at different lengths.

A batch of prompts of different lengths decodes with each example at its own
position (docs: "Generating with a cache"). Such a step, on the host, by a
layer whose options leave the scores alone (rotary positions, query/key
norms, grouped heads), runs here in a dozen operations: each example's row
written at its own length, the generic flow's read of the new rows, and of
the keys the lengths may now hide, and one query per example attending over
the positions up to the longest's, by SDPA with the lengths' mask, or by the
generic path where the read says so. These are the operations of the
generic flow's write, kernel plan and kernel call for the same call
(:func:`mha_multi.call.attend`, :func:`mha_multi.call.plan`), on the same
tensors: the numbers are its numbers to the bit, and the cache's check is
left as it leaves it. This module imports nothing of the facts.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from mha_multi import call, spec
from mha_multi.torch._cache import CacheCheck, from_host, next_lengths
from mha_multi.torch._ops import OPS
from mha_multi.torch._reads import extremes, finite_sum, larger, magnitude_of, read_together
from mha_multi.torch._rotary import rotate_stacked
from mha_multi.torch._steps import PlainPlan, normalized

__all__ = ["ragged_step"]


def ragged_step(
    facts: call.Facts,
    layer: call.Projections,
    queries: torch.Tensor,
    cache: spec.KVCache,
    check: CacheCheck,
    plan: PlainPlan,
    step: tuple[Any, tuple, Any] | None,
    rotary: spec.Rotary | None,
) -> call.Result | None:
    """The plain route's decoding step of examples at different lengths, on a fused plan
    that takes them (``plan.ragged``; the host's).

    ``check``: the cache's, which holds, with no rows left to read and no
    poison (:meth:`mha_multi.torch._plain.PlainRoute.plain_attention` asked);
    ``None`` where it does not know the positions past the longest example's
    finite (the generic flow reads them), or where that example has no room
    left (the generic flow raises), before anything is written. ``rotary``:
    the layer's, whose tables of every cache position the plan holds.
    """
    keys, values, lengths = cache
    held = check.lengths  # (B,) int64, on the host
    # (Python's max and min of a few lengths: numpy's reductions cost more.)
    listed = held.tolist()
    span = max(listed) + 1  # (the positions attended over: the longest's, and its new one)
    finite_from = check.finite_from
    if span > keys.shape[2] or finite_from is None or finite_from > span:
        return None
    heads = layer._heads
    query_width, kv_width = heads.query_features, heads.kv_features
    num_kv_heads, head_dim = heads.num_kv_heads, heads.head_dim
    batch = queries.shape[0]
    modules = layer._modules
    stacked = layer._stacks.views((modules["W_q"], modules["W_k"], modules["W_v"]))
    projected = torch.nn.functional.linear(queries, *(stacked or layer.stacked_parameters(queries)))
    if plan.norm is not None:
        projected = normalized(projected, layer, plan.norm)
    # Each example's position (on the host, as the route's steps are): the write's, and
    # the rows of the rotary tables.
    positions = torch.from_numpy(held)
    if rotary is None:
        q, k, v = projected.split_with_sizes((query_width, kv_width, kv_width), -1)
        total = projected.sum()  # (float32 or float64: a fused plan's dtypes)
    else:
        q, k, v, turned = rotate_stacked(
            projected, plan.tables, plan.wide_tables, rotary, heads, positions.unsqueeze(1)
        )
        total = turned.sum() + v.sum()
    examples = torch.arange(batch)
    keys[examples, :, positions] = k.view(batch, num_kv_heads, head_dim)
    values[examples, :, positions] = v.view(batch, num_kv_heads, head_dim)
    attended = keys.narrow(2, 0, span), values.narrow(2, 0, span)
    # The generic flow's read (Facts.plan_values): the positions up to the span that no
    # call has checked, and the keys from the shortest example's length on, whose
    # largest magnitude, with those below it, bounds the scores its mask may hide.
    upto = check.upto
    if upto < span:
        total = total + finite_sum(*(x.narrow(2, upto, span - upto) for x in attended), eager=True)
    least = min(listed)
    key_upto = check.key_upto if check.key_upto < least else least
    read = read_together(
        [total, *extremes(q), *extremes(attended[0].narrow(2, key_upto, span - key_upto))]
    )
    largest_key = magnitude_of(read[3], read[4])
    if key_upto:
        largest_key = larger(check.key_max, largest_key)
    finite = math.isfinite(read[0])
    filled = held + 1
    updated = spec.KVCache(keys, values, next_lengths(check, lengths, listed[0] + 1, filled))
    check.ragged_stepped(updated, filled, span, largest_key, None if finite else total * 0.0, step)
    visible = from_host(filled, queries.device, None)
    if finite and spec.scores_within_limit(magnitude_of(read[1], read[2]), largest_key, head_dim):
        if plan.folded:  # (each key/value head's query heads as its queries: folds_groups)
            q = q.view(batch, num_kv_heads, heads.group_size, head_dim)
        else:
            q = q.view(batch, heads.num_heads, 1, head_dim)
        # (The lengths' mask, (B, 1, 1, span), as spec.visibility makes it.)
        mask = torch.arange(span, device=queries.device) < visible.view(batch, 1, 1, 1)
        context = torch.nn.functional.scaled_dot_product_attention(
            q, *attended, attn_mask=mask, **plan.arguments
        ).reshape(batch, 1, query_width)
    else:
        context = facts.generic_attention(
            OPS,
            q,
            *attended,
            visible,
            heads=heads,
            causal=False,
            dropout=None,
            kv_split=True,
            head_parallel=False,
            return_attention_weights=False,
        )[0]
    parameters = modules["W_o"]._parameters
    output = torch.nn.functional.linear(context, parameters["weight"], parameters["bias"])
    return call.Result(output, None, updated)

"""The plain route's calls written out: a decoding step in one function, on either plan,
and the generic path's attention for PyTorch.

A small call's cost on the host is its Python as much as its kernels (docs:
"Fast paths"): :func:`decoding_step` (SDPA after the one finiteness read, the
host's plan; or the generic path's attention, which reads nothing, a GPU's
plan) runs the operations the generic flow would, on the same tensors, with
none of its indirection; :func:`heads_attention` and
:func:`step_attention` are :func:`mha_multi.spec.attention`'s layouts,
products, mask and softmax on the same shapes, to its numbers.
:class:`mha_multi.torch._plain.PlainRoute` decides which, once per layer and
shapes (:class:`PlainPlan`).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from mha_multi import call, spec
from mha_multi.torch._cache import CacheCheck, next_lengths
from mha_multi.torch._ops import OPS, SIXTEEN_BIT, softmax
from mha_multi.torch._rotary import WideTables, rotate_heads, rotate_stacked

__all__ = [
    "PlainPlan",
    "StepResult",
    "decoding_step",
    "heads_attention",
    "normalized",
    "project_output",
    "step_attention",
    "step_projections",
]


#: What a decoding step of the route returns: its output ``(B, 1, num_hiddens)`` and the
#: updated cache (a plain tuple, not :class:`mha_multi.call.Result`: a step's cost is
#: such work, and a step has no weights to return).
StepResult = tuple[torch.Tensor, spec.KVCache]


class PlainPlan(NamedTuple):
    """How :meth:`PlainRoute.plain_attention` and :meth:`StepRoute.plain_step` run a layer's calls.

    ``fused``: SDPA with ``arguments`` after the one finiteness read (the
    generic flow's plan for values read finite). Otherwise the generic
    path's attention (:meth:`mha_multi.call.Facts.generic_attention`) and no
    read: the generic flow's plan on a GPU where a head's scores are few
    (:func:`mha_multi.spec.reads_values`), or where no kernel takes the
    layer's options (a soft cap, sinks). ``bounded``: SDPA's causal flag or
    mask hides keys, so the read takes the largest query and key too, whose
    scores must lie within :data:`mha_multi.spec.FUSED_SCORE_LIMIT`.
    ``tables``: a rotary layer's :func:`mha_multi.spec.rotary_tables`, made
    once: of the call's ``arange(Q)`` without a cache, of every position of
    the cache with one (a step takes its row); ``wide_tables`` the same as
    :func:`mha_multi.torch._rotary.wide_tables`, where whole heads rotate.
    The masks and bias are the call's, made once: a fused plan's ``mask``,
    SDPA's ``attn_mask`` (the causal rule's and the window's booleans,
    ALiBi's bias; ``None``: none); a generic plan's ``visible``, which keys
    each query sees (:func:`mha_multi.spec.visibility`; ``None``: all; a
    decoding step's ``(1, 1, 2 * max_length)``, :func:`step_attention`), and
    ``bias`` ALiBi's in the scores' dtype (``None``: none), with
    ``softcap`` the layer's cap and ``sinks`` whether the layer's sink
    logits join the softmax. A decoding step's are those of a step at the
    cache's last position, ``max_length - 1``, over ``2 * max_length``
    keys: the last dimension's positions from ``max_length - length - 1`` on
    are a step's at ``length`` (a view, :func:`decoding_step`). A generic
    step's ``fill`` is the spec's :data:`~mha_multi.spec.MASK_VALUE` as a 0-d
    tensor of the scores' dtype, ``root`` the scores' divisor
    ``sqrt(head_dim)`` as one on the CPU
    (:func:`step_attention`), and ``spans``, each filled length's span
    (:func:`mha_multi.spec.rounded_span`) as steps meet them (a bucket's
    lengths at once), or ``None`` where the generic flow would read
    (``may_read``: its plan for values read finite is the fused kernel's,
    and :func:`mha_multi.spec.reads_values` says a read pays); ``direct``:
    its products are the product itself (``F.linear``), neither 16-bit off
    CUDA nor autocast's. ``norm``: the layer's query/key norms, which every
    call's queries and keys go through before the rotation (:func:`normalized`).
    A step's ``window``: the layer's, and ``within`` the plan of the steps it
    hides nothing from (every filled position within it), made without it as
    the generic flow makes theirs (:func:`mha_multi.call.binding_window`;
    ``None``: the route takes none).
    A plan of calls with lengths holds what the generic flow's kernel plan is
    ``planned`` with (:func:`mha_multi.call.plan`'s keyword arguments), which
    each call makes by its values read as the generic flow does, and in
    ``arguments`` the kernel call's score ``options``. ``folded``: a fused
    plan of one query whose grouped heads SDPA takes as the queries of their
    key/value head (:func:`mha_multi.torch._kernel.folds_groups`; its ``mask``
    folded too). ``ragged``: a step's plan that a step of examples at
    different lengths takes too (:func:`mha_multi.torch._ragged.ragged_step`):
    a fused plan where the generic flow's kernel plan of lengths that hide
    keys is SDPA with their mask (a window's too, ALiBi's bias: those of each
    example's position, made at each step), and every generic one.
    """

    fused: bool
    arguments: dict[str, Any]
    bounded: bool = False
    tables: tuple[torch.Tensor, torch.Tensor] | None = None
    wide_tables: WideTables | None = None
    mask: torch.Tensor | None = None
    visible: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    softcap: float | None = None
    fill: torch.Tensor | None = None
    root: torch.Tensor | None = None
    spans: dict[int, int | None] | None = None
    may_read: bool = True
    direct: bool = False
    norm: spec.QKNorm | None = None
    sinks: bool = False
    window: int | None = None
    within: PlainPlan | None = None
    planned: dict[str, Any] | None = None
    folded: bool = False
    ragged: bool = False


def decoding_step(
    layer: call.Projections,
    queries: torch.Tensor,
    cache: spec.KVCache,
    check: CacheCheck,
    plan: PlainPlan,
    step: tuple[Any, tuple, Any] | None,
    rotary: spec.Rotary | None,
    first: int = 0,
    span: int = 0,
) -> StepResult | None:
    """The plain route's decoding step, on either plan: one query per example.

    The rows are written in place at the length every example holds. A
    fused plan's (the host's) then reads them, with the step's queries, in
    one sum, and runs SDPA over the filled positions; where the values read
    are not finite it returns ``None`` and the generic flow runs the step:
    the rows written are zeros then, of which the check's facts of the
    positions past the filled ones (finite, no key past its bound) hold, and
    the check holds for the cache again. A generic plan's (a GPU's) reads
    nothing: its rows are left for a later read to check, as the generic
    flow's write leaves them, with the rows the plain steps before wrote (one
    region of the cache, summed once when a call reads it; a write of the
    generic flow settles it first,
    :meth:`~mha_multi.torch._cache.CacheCheck.take_pending`), and the query
    attends over the cache's positions ``first`` to ``span`` by
    :func:`step_attention`, the generic path's operations, those past the
    filled ones hidden.

    ``rotary``: the layer's, whose tables the plan holds; ``first``: the
    first cache position attended over (past it, a window's); ``span``: a
    generic plan's. Written out in one function: a step's cost on the host is
    its Python as much as its kernels, and a GPU's step is host time (docs:
    "Fast paths").
    """
    heads = layer._heads
    num_heads, num_kv_heads, head_dim = heads.num_heads, heads.num_kv_heads, heads.head_dim
    keys, values, lengths = cache
    length = check._uniform  # (CacheCheck.uniform, which the route's check resolved)
    modules = layer._modules
    fused = plan.fused
    if fused or plan.direct:
        # step_projections' direct product, inline: the host's uniform step is the route's
        # most frequent call, and a function call is a measurable part of it (docs:
        # "Results", Python calls per call). (The layer was called before: its parameters
        # are sized; views of them where packed. A fused plan's heads are never 16-bit.)
        stacked = layer._stacks.views((modules["W_q"], modules["W_k"], modules["W_v"]))
        projected = torch.nn.functional.linear(
            queries, *(stacked or layer.stacked_parameters(queries))
        )
        if plan.norm is not None:
            projected = normalized(projected, layer, plan.norm)
    else:
        projected = step_projections(layer, queries, False, plan.norm)
    # One query per example: (B, 1, (H + 2*H_kv)*dh) is every head side by side, (B, H +
    # 2*H_kv, 1, dh) as it lies: the queries SDPA takes (B, H, 1, dh) (folded, (B, H_kv,
    # G, dh)), and the keys' and values' rows (B, H_kv, 1, dh), a position of (B, H_kv,
    # max_length, dh).
    batch = queries.shape[0]
    heads_of = projected.view(batch, -1, 1, head_dim)
    wide = plan.wide_tables
    if rotary is None:
        q, k, v = heads_of.split_with_sizes((num_heads, num_kv_heads, num_kv_heads), 1)
    elif wide is not None:
        # Queries' and keys' heads rotated together by the rows of the step's position
        # (rotate_stacked's, on a step's one query); half-split pairs by rotate_heads'
        # own operations, inline where the heads are of the tables' dtype.
        both, v = heads_of.split_with_sizes((num_heads + num_kv_heads, num_kv_heads), 1)
        rows = wide[0][length], wide[1][length]
        if rotary.interleaved or rows[0].dtype is not both.dtype:
            turned = rotate_heads(both, rows, rotary)
        else:
            turned = both * rows[0] + both.roll(head_dim // 2, -1) * rows[1]
        q, k = turned.split_with_sizes((num_heads, num_kv_heads), 1)
    else:
        q, k, v, turned = rotate_stacked(projected, plan.tables, None, rotary, heads, length)
        q = q.view(batch, num_heads, 1, head_dim)
        k, v = k.view(-1, num_kv_heads, 1, head_dim), v.view(-1, num_kv_heads, 1, head_dim)
    keys.narrow(2, length, 1).copy_(k)
    values.narrow(2, length, 1).copy_(v)
    filled = length + 1
    if fused:
        # One query sees its keys unmasked (a window's plan is that of the positions
        # within it): the read is that the step's projections are finite, their dot
        # product with themselves (and so their rotations, each a sum of two of them
        # times factors of at most 1). Finite values whose squares sum past the dtype's
        # range (in float32, values of about 2**64 / sqrt(count)) read as not finite: the
        # generic flow runs the step and reads for itself. BLAS's dot, not a sum: after
        # SDPA's pass over the cache a reduction's code starts cold at every step, and
        # took 2% to 4% of a large step more (docs: "Fast paths"). After the rows'
        # writes, which no call has attended over yet (past the filled positions): the
        # copies take the cold start of the first kernel after the product.
        flat = projected.view(-1)  # (a product's or a norm's: contiguous)
        read = torch.dot(flat, flat).item()  # (float32 or float64: a fused plan's dtypes)
        if read - read != 0.0:
            # Back to the generic flow, which writes these rows itself. What the check
            # knows of the positions past the filled ones (finite, no key past its bound)
            # holds of zeros: the rows become zeros, and the check holds for the arrays
            # again.
            keys.select(2, length).zero_()
            values.select(2, length).zero_()
            check.versions = (keys._version, values._version)
            return None  # (no gradient here)
    # (tuple's own constructor: the named tuple's is a Python function more, and every
    # step makes one.)
    updated = tuple.__new__(spec.KVCache, (keys, values, next_lengths(check, lengths, filled)))
    if fused:
        check.stepped(updated, filled, step, lengths)
        if plan.folded:  # (each key/value head's query heads as its queries: folds_groups)
            q = q.view(batch, num_kv_heads, heads.group_size, head_dim)
        mask, count = plan.mask, filled - first
        if mask is None:
            context = torch.nn.functional.scaled_dot_product_attention(
                q, keys.narrow(2, first, count), values.narrow(2, first, count), **plan.arguments
            )
        else:
            context = torch.nn.functional.scaled_dot_product_attention(
                q,
                keys.narrow(2, first, count),
                values.narrow(2, first, count),
                attn_mask=mask.narrow(-1, keys.shape[2] - count, count),
                **plan.arguments,
            )
        context = context.reshape(batch, 1, heads.query_features)
    else:
        pending_from = check.pending_from
        if pending_from is None:
            poison, pending_from = check.settled(), length
        else:
            poison = check.poison
        check.stepped(
            updated, filled, step, lengths, poison=poison, pending=()
        ).pending_from = pending_from
        # Every example holds length + 1 positions now: the spec's masks and bias of a
        # query at length are the plan's patterns from max_length - length - 1 on.
        start, count = keys.shape[2] - filled + first, span - first
        # (Where no window binds, the mask hides the span's positions past the filled
        # ones alone: those scores are filled, the mask is not read; where the span is
        # the filled positions, it would keep every score.)
        if plan.window is None:
            visible = None if span == filled else filled - first
        else:
            visible = plan.visible.narrow(-1, start, count)
        bias = plan.bias
        if bias is not None:
            bias = bias.narrow(-1, start, count)
        context = step_attention(
            q,
            *check.attended(first, count),
            visible,
            heads,
            plan.fill,
            plan.root,
            softcap=plan.softcap,
            bias=bias,
            sinks=layer.sink_logits() if plan.sinks else None,
        )
        if not plan.direct:
            return layer.project_output(context, None), updated
    parameters = modules["W_o"]._parameters
    return (
        torch.nn.functional.linear(context, parameters["weight"], parameters["bias"]),
        updated,
    )


def step_projections(
    layer: call.Projections, queries: torch.Tensor, direct: bool, norm: spec.QKNorm | None
) -> torch.Tensor:
    """A step's stacked projections ``(B, 1, (H + 2 H_kv) dh)``: the product itself where
    ``direct`` (a plan's products are neither 16-bit off CUDA nor autocast's), else as the
    layer projects (16-bit products accumulate in float32); through the layer's query/key
    ``norm`` where it has one (:func:`normalized`)."""
    if direct:
        modules = layer._modules
        stacked = layer._stacks.views((modules["W_q"], modules["W_k"], modules["W_v"]))
        weight, bias = stacked or layer.stacked_parameters(queries)
        projected = torch.nn.functional.linear(queries, weight, bias)
    else:
        projected = layer.project_stacked(queries)
    return projected if norm is None else normalized(projected, layer, norm)


def normalized(projected: torch.Tensor, layer: call.Projections, norm: spec.QKNorm) -> torch.Tensor:
    """The stacked projections ``(B, T, (H + 2 H_kv) dh)`` with their queries and keys
    through the layer's norms (:func:`mha_multi.spec.normalize_qk`'s numbers on the same
    values), stacked again: what the route rotates and reads.

    A norm of each head (Qwen 3's, Gemma 3's) normalises the query and key heads
    together, as they lie stacked (:func:`mha_multi.spec.rms_normalized`: each head's
    own mean, the same operations on each head's entries), then gives each its weight
    (:func:`mha_multi.spec.rms_gain`): half the operations of two norms, for a step's
    few values a measurable part of its time (docs: "Results", host time)."""
    heads = layer.heads
    num_heads, head_dim = heads.num_heads, heads.head_dim
    if norm.scope != "heads":
        q, k, v = projected.split_with_sizes(
            (heads.query_features, heads.kv_features, heads.kv_features), -1
        )
        q, k = spec.normalize_qk(OPS, q, k, layer.qk_norm_weights(), norm, heads)
        return torch.cat((q, k, v), -1)
    both, v = projected.split_with_sizes(
        (heads.query_features + heads.kv_features, heads.kv_features), -1
    )
    normed = spec.rms_normalized(OPS, both, norm, num_heads + heads.num_kv_heads, head_dim)
    q_weight, k_weight = layer.qk_norm_weights()
    dtype = projected.dtype
    q = spec.rms_gain(OPS, normed.narrow(2, 0, num_heads), q_weight, norm, dtype)
    k = spec.rms_gain(OPS, normed.narrow(2, num_heads, heads.num_kv_heads), k_weight, norm, dtype)
    return torch.cat((q.flatten(2), k.flatten(2), v), -1)


def project_output(layer: call.Projections, context: torch.Tensor, direct: bool) -> torch.Tensor:
    """``W_o`` of the heads' ungated context: the product itself where ``direct`` (a
    plan's products are neither 16-bit off CUDA nor autocast's), else as the layer
    projects."""
    if direct:
        return torch.nn.functional.linear(context, *layer.output_parameters())
    return layer.project_output(context, None)


def step_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    visible: torch.Tensor | int | None,
    heads: spec.Heads,
    fill: torch.Tensor | float = spec.MASK_VALUE,
    root: torch.Tensor | None = None,
    *,
    softcap: float | None = None,
    bias: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`mha_multi.spec.attention` of one query per example over a cache's positions,
    to its numbers (:func:`heads_attention` of a cache's heads).

    Args:
        q: the queries ``(B, 1, H*dh)`` or ``(B, H, dh)``.
        keys: the keys attended over, each key/value head's transposed ``(B*H_kv, dh, S)``;
            ``values`` theirs ``(B*H_kv, S, dh)`` (:meth:`CacheCheck.attended
            <mha_multi.torch._cache.CacheCheck.attended>`).
        visible: ``None`` (every position), or which positions each query sees:
            booleans broadcastable to ``(B, H, 1, S)``, or ``(1, 1, S)`` where every
            query sees the same; or an ``int`` ``n``: every query sees the first ``n``
            positions and none of the rest (their scores filled in place, no mask read).
        heads: the layer's heads.
        fill: :data:`mha_multi.spec.MASK_VALUE`, or it as a 0-d tensor of the scores'
            dtype (made once: a Python number is made a tensor at every call).
        root: ``None``, or the scores' divisor ``sqrt(head_dim)`` as a 0-d tensor of
            their dtype on the CPU, made once: the spec's Python number is the same
            operand there, on any device (a kernel takes a 0-d tensor of the CPU as it
            takes a number), without its cast at every call.
        softcap: the layer's soft cap of the scaled scores, or ``None``.
        bias: ``None``, or ALiBi's bias of the scores, broadcastable to ``(B, H, 1, S)``
            and of their dtype (:func:`mha_multi.spec.score_bias`).
        sinks: ``None``, or the heads' sink logits ``(H,)`` (:mod:`mha_multi.spec.sinks`).

    Returns:
        The heads' context ``(B, 1, H*dh)``.
    """
    batch, num_kv_heads, head_dim = q.shape[0], heads.num_kv_heads, heads.head_dim
    # One query: the spec's grouped layout (B*H_kv, G*1, dh) is the heads in order.
    grouped_q = q.reshape(batch * num_kv_heads, heads.num_heads // num_kv_heads, head_dim)
    context = _attend(
        grouped_q,
        keys,
        values,
        visible,
        heads,
        1,
        fill,
        root,
        softcap=softcap,
        bias=bias,
        sinks=sinks,
    )
    return context.reshape(batch, 1, heads.query_features)


def heads_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    visible: torch.Tensor | None,
    heads: spec.Heads,
    *,
    softcap: float | None = None,
    bias: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`mha_multi.spec.attention` of projected queries, keys and values with no
    lengths, to its numbers: its layouts, products, mask and softmax, written for
    PyTorch.

    Args:
        q: the queries ``(B, Q, H*dh)``.
        k, v: the keys and values ``(B, K, H_kv*dh)``.
        visible: ``None``, or which keys each query sees (:func:`mha_multi.spec.visibility`).
        heads: the layer's heads.
        softcap, bias, sinks: as :func:`step_attention` takes them, ``bias``
            broadcastable to ``(B, H, Q, K)``.

    Returns:
        The heads' context ``(B, Q, H*dh)``.
    """
    (batch, num_queries, _), num_keys = q.shape, k.shape[1]
    num_kv_heads, head_dim = heads.num_kv_heads, heads.head_dim
    group_size = heads.num_heads // num_kv_heads
    # The spec's grouped layout (B*H_kv, G*Q, dh) (spec.transpose_grouped_queries; with
    # G = 1, transpose_qkv's (B*H, Q, dh)), and the keys' and values' (B*H_kv, K, dh).
    grouped_q = q.view(batch, num_queries, num_kv_heads, group_size, head_dim)
    grouped_q = grouped_q.permute(0, 2, 3, 1, 4).reshape(-1, group_size * num_queries, head_dim)
    k, v = (
        x.view(batch, num_keys, num_kv_heads, head_dim)
        .transpose(1, 2)
        .reshape(-1, num_keys, head_dim)
        for x in (k, v)
    )
    context = _attend(
        grouped_q,
        k.transpose(-1, -2),
        v,
        visible,
        heads,
        num_queries,
        softcap=softcap,
        bias=bias,
        sinks=sinks,
    )
    # (B*H_kv, G*Q, dh) back to the heads side by side, transpose_grouped_output's.
    context = context.view(batch, num_kv_heads, group_size, num_queries, head_dim)
    return context.permute(0, 3, 1, 2, 4).reshape(batch, num_queries, heads.query_features)


def _attend(
    grouped_q: torch.Tensor,
    keys: torch.Tensor,
    v: torch.Tensor,
    visible: torch.Tensor | int | None,
    heads: spec.Heads,
    num_queries: int,
    fill: torch.Tensor | float = spec.MASK_VALUE,
    root: torch.Tensor | None = None,
    *,
    softcap: float | None = None,
    bias: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The spec's grouped attention of ``(B*H_kv, G*Q, dh)`` queries over ``(B*H_kv, dh, K)``
    transposed keys and ``(B*H_kv, K, dh)`` values: scaled scores, soft-capped
    (:func:`mha_multi.spec.adjust_scores`, ``softcap``), their ``(B, H, Q, K)`` view
    biased (``bias``), the masked softmax (hidden scores replaced by ``fill``;
    ``sinks``, the heads' logits, join it), and the weights' product with the values
    ``(B*H_kv, G*Q, dh)``. ``visible``: as :func:`step_attention` takes it, or
    broadcastable to ``(B, H, Q, K)``; ``root``: as :func:`step_attention` takes it."""
    num_keys, head_dim = keys.shape[2], heads.head_dim
    low = grouped_q.dtype in SIXTEEN_BIT
    if low:  # (16-bit heads: float32 scores, spec.scaled_scores)
        # (The keys cast as they lie untransposed: a copy's layout is the product's.)
        grouped_q, keys = grouped_q.float(), keys.transpose(1, 2).float().transpose(1, 2)
    # (bmm: the product torch.matmul makes of two batches alike, without its reshapes;
    # divided in place, the same numbers without a tensor more.)
    scores = torch.bmm(grouped_q, keys).div_(math.sqrt(head_dim) if root is None else root)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    # The heads' view where a bias, the sinks or the visibility differ by head or query;
    # the softmax of the grouped layout's rows is the same numbers, two views fewer.
    seen = visible if type(visible) is int else None
    if seen is not None:
        visible = None
    by_head = (visible is not None and visible.dim() != 3) or bias is not None or sinks is not None
    if by_head:
        scores = scores.view(-1, heads.num_heads, num_queries, num_keys)
    if bias is not None:
        scores = scores + bias
    if visible is not None:
        scores = torch.where(visible, scores, fill)
    elif seen is not None:  # (the scores are this call's own: filled in place)
        scores.narrow(-1, seen, num_keys - seen).fill_(fill)
    if sinks is None:
        weights = softmax(scores)
        if by_head:
            weights = weights.view(v.shape[0], -1, num_keys)
    else:  # (spec.masked_softmax's: each head's logit a column of its own, dropped after)
        # The logits expanded to the rows: spec.sink_column's values (its zeros plus the
        # logits; -0.0 becomes 0.0 there, the same weights), which builds the column from
        # zeros where a traced call's sizes are unknown; here they are known.
        column = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        joined = torch.cat((scores, column), -1)
        weights = softmax(joined)[..., :-1].reshape(v.shape[0], -1, num_keys)
    # (16-bit weights: rounded once, their product as the spec's adapter takes it.)
    return OPS.matmul(weights.to(v.dtype), v) if low else torch.bmm(weights, v)

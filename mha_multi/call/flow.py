"""A call's flow, written once: the checks, projections, cache, attention, gates and output.

:func:`forward` is what every layer calls; :func:`attend` computes a checked
call (docs: "Architecture").
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

from mha_multi import spec
from mha_multi.call.checks import (
    check_cache_values,
    check_cached_call,
    check_call,
    check_gates,
    check_options,
    check_segment_ids,
)
from mha_multi.call.contract import Array, Projections, Result
from mha_multi.call.facts import Facts
from mha_multi.call.kernel_plan import plan
from mha_multi.call.rotary_tables import rotated_at_default_positions


def _rotated(
    facts: Facts,
    ops: spec.ArrayOps,
    q: Array,
    k: Array | None,
    positions: Array | None,
    rotary: spec.Rotary,
    heads: spec.Heads,
    lengths: Array | None,
    fill: spec.CacheFill | None = None,
    held: Array | None = None,
) -> tuple[Array, Array | None]:
    """``q`` and ``k`` rotated at the call's positions (:func:`mha_multi.spec.call_positions`;
    a pair: packed sequences' restarting positions of the queries and the keys).

    At the default positions, an eager call rotates by the tables kept for its
    signature (:func:`mha_multi.call.rotary_tables.rotated_at_default_positions`;
    ``held``: the cache's keys, ``None`` without a cache).
    """
    if positions is None:
        rotated = rotated_at_default_positions(
            facts, ops, q, k, rotary, heads, fill=fill, held=held, lengths=lengths
        )
        if rotated is not None:
            return rotated
    num_queries = ops.size(q, 1)
    num_keys = None if k is None else ops.size(k, 1)
    if isinstance(positions, tuple):
        query_positions, key_positions = positions
    else:
        query_positions, key_positions = spec.call_positions(
            ops, positions, num_queries=num_queries, num_keys=num_keys, lengths=lengths
        )
    length = None
    if rotary.depends_on_length:
        # The call's largest position + 1 (docs: "Positions and biases"): from
        # shapes, or a cache's lengths read already; else one device reduction.
        sizes = (num_queries, num_keys)
        if positions is None and lengths is None and all(isinstance(n, int) for n in sizes):
            length = max(sizes)
        elif positions is None and fill is not None and isinstance(num_queries, int):
            length = int(fill.lengths.max()) + num_queries if fill.lengths.size else 0
        else:
            length = spec.rotary_length(ops, query_positions, key_positions)
    tables = spec.rotary_tables(ops, q, query_positions, rotary, heads.head_dim, length=length)
    q = spec.rotate(ops, q, query_positions, rotary, heads.num_heads, heads.head_dim, tables=tables)
    if k is not None:
        shared = tables if key_positions is query_positions else None
        k = spec.rotate(
            ops,
            k,
            key_positions,
            rotary,
            heads.num_kv_heads,
            heads.head_dim,
            tables=shared,
            length=length,
        )
    return q, k


def attend(
    facts: Facts,
    layer: Projections,
    ops: spec.ArrayOps,
    queries: Array,
    keys: Array | None,
    values: Array | None,
    valid_lens: Array | None,
    *,
    cache: spec.KVCache | None = None,
    gates: Array | None = None,
    causal: bool = False,
    return_attention_weights: bool = False,
    dropout: Callable[[Array], Array] | None = None,
    dropout_rate: float = 0.0,
    head_parallel: bool = False,
    kernel_plan: spec.KernelPlan | None = None,
    layer_options: spec.LayerOptions | None = None,
    positions: Array | None = None,
    bias: Array | None = None,
    fill: spec.CacheFill | None = None,
    segment_ids: tuple[Array, Array] | None = None,
) -> Result:
    """Projections, the cache update, attention, gates and the output of checked arguments.

    Args:
        facts: the framework's facts.
        layer: the layer's projections.
        ops: the array-ops adapter of these arrays.
        queries, keys, values, valid_lens: as the checks returned them
            (:func:`check_call`, :func:`check_cached_call`).
        cache: ``None``, or the checked cache: the new keys and values are
            written into it (:func:`mha_multi.spec.update_cache`) and the
            queries attend to all it then holds, the causal rule inside the
            lengths.
        gates: the checked ``head_mask`` (:func:`check_gates`), or ``None``.
        causal: the spec's causal flag.
        return_attention_weights: compute the weights (the generic path).
        dropout: applied to the weights by the generic path, or ``None``.
        dropout_rate: its rate, for a fused kernel that applies dropout.
        head_parallel: the heads are split over devices (see
            :meth:`Facts.generic_attention`).
        kernel_plan: a plan decided before the call (MXNet plans outside its
            graphs, where shapes are known); ``None`` plans here.
        layer_options: the layer's checked constructor options (rotary,
            ALiBi, window, soft-capping, query/key norms, sinks: the logits are the
            layer's :meth:`~mha_multi.call.Projections.sink_logits`); ``None`` for none.
        positions, bias: the call's, checked (:func:`check_options`).
        fill: a cached call's lengths as read on the host
            (:func:`check_cache_values`), for frameworks that write the
            cache in place or attend over its filled positions; ``None``
            keeps the spec's functional update over all ``max_length``.
        segment_ids: ``None``, or the checked ``(query_ids, key_ids)`` of
            packed sequences (:func:`check_segment_ids`): their visibility
            joins the masks, and rotary positions restart at each sequence
            unless ``positions`` are given (docs: "Packed sequences").

    Returns:
        The :class:`Result`.
    """
    heads = layer.heads
    q, k, v = layer.project_inputs(queries, keys, values)
    kv_split = cache is not None
    first = 0  # (the first cache position attended over)
    unmasked = False  # (where a cached call's lengths hide no key attended over)
    lengths = None if cache is None else cache.lengths  # before the new rows
    options = spec.NO_OPTIONS
    if layer_options is not None and layer_options.qk_norm is not None:
        # Before the rotation, so keys enter the cache normalised (docs: "Positions and biases").
        q, k = spec.normalize_qk(ops, q, k, layer.qk_norm_weights(), layer_options.qk_norm, heads)
    if layer_options is not None and layer_options.rotary is not None:
        if segment_ids is not None and positions is None:
            # Each sequence rotates from 0 (docs: "Packed sequences").
            query_ids, key_ids = segment_ids
            query_positions = spec.segment_positions(ops, query_ids)
            same = key_ids is query_ids
            positions = (
                query_positions,
                query_positions if same else spec.segment_positions(ops, key_ids),
            )
        # Keys rotate before they enter the cache (docs: "Positions and biases").
        held = None if cache is None else cache.keys
        q, k = _rotated(
            facts, ops, q, k, positions, layer_options.rotary, heads, lengths, fill, held
        )
    if cache is not None:
        spec.check_cache_dtype(ops, cache, ops.dtype(q), ops.dtype(q))
        # (A fill is read from values: then the new rows' count is an int.)
        asked_causal, num_new = causal, 0 if k is None or fill is None else k.shape[1]
        cache, valid_lens = facts.write_cache(
            ops, cache, k, v, valid_lens, head_dim=heads.head_dim, causal=causal, fill=fill
        )
        # The causal rule, each example's own, is in the lengths now.
        k, v, causal = cache.keys, cache.values, False
        if fill is not None and bias is None and not return_attention_weights:
            # Keys past the filled positions, and before the window of every query, add
            # nothing to any row (a user's bias could make them: it keeps all of them).
            window = None if layer_options is None else layer_options.window
            k, v, first = attended_positions(facts, k, v, fill, q.shape[1], window=window)
            # Where every query sees every key attended over, the generic path's mask of
            # the lengths would replace no score, so it is not made (the same numbers to
            # the bit; the kernel plan still reads the lengths, which tell it more).
            unmasked = fill.hides_none(num_new, k.shape[2], causal=asked_causal, first=first)
            if first:
                # The keys from ``first`` on: the lengths and query positions count from there.
                valid_lens = facts.lengths_from(ops, valid_lens, first)
    if bias is not None or (layer_options is not None and layer_options.touches_scores):
        # (Rotary positions and norms alone leave the scores d2l's: no options made, which
        # a compiled call would guard on.)
        layer_options = layer_options or spec.LayerOptions()
        window = binding_window(layer_options.window, fill, ops.size(q, 1), first=first)
        # ALiBi and the window see each cached query at its own position.
        frame = lengths is not None and (layer_options.alibi or window is not None)
        query_positions = spec.cache_positions(ops, lengths, ops.size(q, 1)) if frame else None
        if frame and first:
            query_positions = query_positions - first
        options = layer_options.score_options(
            num_heads=heads.num_heads, bias=bias, query_positions=query_positions
        ).with_sinks(layer.sink_logits() if layer_options.sinks else None)
        if window is None and options.window is not None:
            options = dataclasses.replace(options, window=None)
        if not options.adjusts_scores and options.window is None and options.sinks is None:
            options = spec.NO_OPTIONS  # rotary or norms only: the scores are d2l's
    if segment_ids is not None:
        options = options.with_segments(spec.segment_visibility(ops, *segment_ids))
    if kernel_plan is None:
        kernel_plan = plan(
            facts,
            q,
            k,
            v,
            valid_lens,
            heads=heads,
            causal=causal,
            dropout=dropout is not None,
            return_attention_weights=return_attention_weights,
            kv_split=kv_split,
            options=options,
        )
    context = weights = None
    settings: dict[str, Any] = {"heads": heads, "kv_split": kv_split}
    if kernel_plan.fused:
        fused_settings = {
            **settings,
            "dropout_rate": dropout_rate if dropout is not None else 0.0,
            # Packed sequences reach any kernel that takes a mask (docs: "Packed sequences").
            **({"options": options} if facts.passes_options or options.only_segments else {}),
        }

        def fused(q: Array, k: Array, v: Array) -> Array | None:
            return facts.fused_attention(ops, q, k, v, valid_lens, kernel_plan, **fused_settings)

    generic = functools.partial(
        facts.generic_attention,
        ops,
        valid_lens=None if unmasked else valid_lens,
        **settings,
        causal=causal,
        dropout=dropout,
        head_parallel=head_parallel,
        return_attention_weights=return_attention_weights,
        options=options,
    )
    if kernel_plan.guarded:
        context = facts.guarded(
            fused,
            lambda *qkv: generic(*qkv)[0],
            (q, k, v),
            options.bias,
            head_dim=heads.head_dim,
        )
    elif kernel_plan.fused:
        context = fused(q, k, v)
    if context is None:
        context, weights = generic(q, k, v)
    # Both paths' context is the heads' (B, Q, H*dh): the gates act on it alike.
    output = layer.project_output(context, gates)
    return Result(output, weights if return_attention_weights else None, cache)


def binding_window(
    window: int | None, fill: spec.CacheFill | None, num_queries: Any, *, first: int = 0
) -> int | None:
    """The layer's ``window`` where it may hide a key from a cached call's queries, else
    ``None``.

    A query at ``i_abs`` sees key ``j <= i_abs`` through the window iff
    ``i_abs - j < window``: where every query of the call (a padding one
    included) sits less than ``window`` positions past the first key attended
    over, ``first`` (``fill``, the lengths read, and ``num_queries`` new
    positions), the window hides nothing, and the call is planned without it
    (a kernel needs no mask for it: docs, "Fast paths"). A traced call (no
    ``fill``) keeps it.
    """
    if window is None or fill is None or not fill.lengths.size or not isinstance(num_queries, int):
        return window
    return None if int(fill.lengths.max()) - first + num_queries <= window else window


def attended_positions(
    facts: Facts,
    keys: Array,
    values: Array,
    fill: spec.CacheFill,
    num_queries: int,
    *,
    window: int | None = None,
    bucket: int | None = None,
) -> tuple[Array, Array, int]:
    """What a cached call attends over of a cache's ``(B, H_kv, max_length, dh)`` arrays:
    ``(keys, values, first)``, ``first`` the cache position of their first.

    The leading positions :meth:`mha_multi.spec.CacheFill.span` names for a
    call of ``num_queries`` new positions (``window``: the layer's), rounded
    up to ``bucket`` (``None``: :meth:`Facts.span_bucket_of`), through
    :meth:`Facts.cache_prefix`; all of them where the span reaches
    ``max_length``, or where a value past it is not known finite
    (:meth:`Facts.finite_past`). With a window, from the first position a
    query sees through it (:meth:`mha_multi.spec.CacheFill.window_start`)
    where every value before it is known finite (:meth:`Facts.finite_before`:
    a hidden value's weight is 0, which a NaN turns into NaN); else from 0.
    A fill is read from values: the arrays are concrete and their shapes ints.
    """
    max_length = keys.shape[2]
    bucket = facts.span_bucket_of(keys) if bucket is None else bucket
    span = fill.span(num_queries, max_length, window=window, bucket=bucket)
    if span < max_length and not facts.finite_past(keys, values, span):
        span = max_length
    first = fill.window_start(num_queries, window, bucket=bucket) if window is not None else 0
    if first and facts.finite_before(keys, values, first):
        return (*facts.cache_prefix(keys, values, span, first), first)
    if span >= max_length:
        return keys, values, 0
    return (*facts.cache_prefix(keys, values, span), 0)


def plain_self_attention(
    queries: Any,
    keys: Any,
    values: Any,
    valid_lens: Any,
    *,
    causal: Any,
    others: Sequence[Any],
) -> bool:
    """Whether a call is plain self-attention, which :meth:`Facts.plain_attention` may answer.

    The queries are the keys and values (with a cache: the new positions),
    ``causal`` is a bool, and nothing else is asked: each of ``others``, the
    call's every other argument (returned weights, gates, positions, bias,
    dropout, heads mapped over devices or sharded), ``None`` or ``False``.
    The lengths (``valid_lens``) and the layer's own options are the facts' to
    take or leave (:meth:`Facts.plain_attention`): rotary positions at their
    defaults and what a layer does to its scores are fixed with the layer.
    """
    return _plain_kind(queries, keys, values, causal, others) == "self"


def plain_cross_attention(
    queries: Any, keys: Any, values: Any, *, causal: Any, others: Sequence[Any]
) -> bool:
    """Whether a call is plain attention to keys and values of its own, which
    :meth:`Facts.cross_attention` may answer: d2l's ``attention(X, Y, Y, valid_lens)``.

    Keys and values are given and are not both the queries (that is
    :func:`plain_self_attention`), ``causal`` is a bool, and nothing else is
    asked (``others`` as there). Asked of calls without a cache.
    """
    return _plain_kind(queries, keys, values, causal, others) == "cross"


def _plain_kind(
    queries: Any, keys: Any, values: Any, causal: Any, others: Sequence[Any]
) -> str | None:
    """``"self"`` for :func:`plain_self_attention`, ``"cross"`` for
    :func:`plain_cross_attention`, else ``None``: one call that :func:`forward`
    makes for every call of every layer."""
    if not (causal is True or causal is False):
        return None
    # A loop, not all() of a generator: every call of every layer asks.
    for x in others:
        if x is not None and x is not False:
            return None
    if keys is queries and values is queries:
        return "self"
    return None if keys is None or values is None else "cross"


def forward(
    facts: Facts,
    layer: Projections,
    queries: Any,
    keys: Any,
    values: Any,
    valid_lens: Any = None,
    *,
    causal: Any = False,
    return_attention_weights: bool = False,
    cache: Any = None,
    head_mask: Any = None,
    positions: Any = None,
    bias: Any = None,
    segment_ids: Any = None,
    layer_options: spec.LayerOptions | None = None,
    gate_heads: int | None = None,
    dtype: Any = None,
    dropout: Callable[[Array], Array] | None = None,
    dropout_rate: float = 0.0,
    head_parallel: bool = False,
    local_gates: Callable[[Array], Array] | None = None,
    run: Callable[..., Result] = attend,
    declined: bool = False,
) -> Result:
    """One call of the layer: the checks, then :func:`attend`.

    Args:
        facts: the framework's facts.
        layer: the layer's projections.
        queries, keys, values, valid_lens: the layer call's arguments (docs: "The spec").
        causal, return_attention_weights, cache, head_mask: the call's options.
        positions, bias: the call's (docs: "Positions and biases").
        segment_ids: the call's ids of packed sequences, one integer ``(B,
            Q)`` array or a tuple ``(query_ids, key_ids)`` (docs: "Packed
            sequences"); ``None`` for one sequence a row.
        layer_options: the layer's checked constructor options
            (:class:`mha_multi.spec.LayerOptions`); ``None`` for none.
        gate_heads: the heads ``head_mask`` is for; ``None`` for the
            layer's (a sharded layer's gates span all its heads).
        dtype: the dtype the inputs must have, or ``None`` for any floating.
        dropout, dropout_rate, head_parallel: as in :func:`attend`.
        local_gates: maps the whole layer's checked gates to the heads this
            process computes (a sharded layer), or ``None``.
        run: what computes the checked call: :func:`attend`, or a function
            of its arguments that runs it elsewhere (MXNet's hybridized
            graphs, planned here where shapes are known and attending inside).
        declined: the facts' plan of a plain call declined it already (a
            layer that offers its plain calls at its own door, PyTorch's):
            not offered again.

    Returns:
        The :class:`Result`; :meth:`Result.returned` is the layer's return value.

    Raises:
        ValueError: a ``bias`` or ALiBi on a layer whose heads are sharded
            (not supported: each process would need its heads' share).
    """
    # Every other argument of the call: a plain call leaves them unset.
    others = (return_attention_weights, head_mask, positions, bias, segment_ids)
    others += (dropout, head_parallel, local_gates)
    # A plain call is offered first to the facts' plan of it (the function and its
    # arguments, not a partial: every call of every layer asks).
    offered: tuple[Callable[..., Result | None], tuple[Any, ...]] | None = None
    kind = None if declined else _plain_kind(queries, keys, values, causal, others)
    if kind == "self":
        offered = facts.plain_attention, (layer, queries, cache)
    elif kind == "cross" and cache is None:
        offered = facts.cross_attention, (layer, queries, keys, values)
    if offered is not None:
        answer, arguments = offered
        result = answer(
            *arguments,
            causal=causal,
            dtype=dtype,
            options=layer_options,
            valid_lens=valid_lens,
        )
        if result is not None:
            return result
    if return_attention_weights is not False and return_attention_weights is not True:
        # (Asked here, not inside: a call of a bool makes no function call for it.)
        return_attention_weights = spec.check_flag(
            "return_attention_weights", return_attention_weights
        )
    heads = layer.heads
    if cache is None:
        queries, keys, values, lens = check_call(
            facts, layer, queries, keys, values, valid_lens, causal=causal, dtype=dtype
        )
    else:
        queries, keys, values, lens, cache = check_cached_call(
            facts, layer, queries, keys, values, valid_lens, cache, causal=causal, dtype=dtype
        )
    all_heads = heads.num_heads if gate_heads is None else gate_heads
    # (Asked here, not inside: a call without gates makes no function call for them.)
    gates = (
        None
        if head_mask is None
        else check_gates(facts, head_mask, num_heads=all_heads, like=queries)
    )
    if gates is not None and local_gates is not None:
        gates = local_gates(gates)
    extra: dict[str, Any] = {}
    if (
        positions is not None
        or bias is not None
        or segment_ids is not None
        or (layer_options is not None and not layer_options.is_default)
    ):
        positions, bias = check_options(
            facts,
            positions,
            bias,
            num_heads=all_heads,
            like=queries,
            num_keys=keys.shape[1] if cache is None else cache.keys.shape[2],
            cached=cache is not None,
        )
        sharded = all_heads != heads.num_heads or local_gates is not None
        if sharded and (bias is not None or (layer_options and layer_options.alibi)):
            raise ValueError("bias and alibi are not supported on a layer whose heads are sharded")
        extra = {"layer_options": layer_options, "positions": positions, "bias": bias}
        if segment_ids is not None:
            extra["segment_ids"] = check_segment_ids(
                facts,
                segment_ids,
                like=queries,
                num_keys=0 if cache is not None else keys.shape[1],
                cached=cache is not None,
            )
    if cache is not None:
        fill = check_cache_values(facts, cache, lens, 0 if keys is None else queries.shape[1])
        if fill is not None and facts.attends_filled:
            extra["fill"] = fill
    return run(
        facts,
        layer,
        facts.ops(queries),
        queries,
        keys,
        values,
        lens,
        cache=cache,
        gates=gates,
        causal=bool(causal),
        return_attention_weights=return_attention_weights,
        dropout=dropout,
        dropout_rate=dropout_rate,
        head_parallel=head_parallel,
        **extra,
    )

"""A call's kernel plan: what :func:`mha_multi.spec.plan_kernel` reads of it, and its values' read.

The values are read (:meth:`~mha_multi.call.facts.Facts.plan_values`) only
where they can still change the decision, and off the host only where
:meth:`~mha_multi.call.facts.Facts.reads_values` says the read pays (docs: "Fast paths").
"""

from __future__ import annotations

from typing import Any

from mha_multi import spec
from mha_multi.call.contract import Array
from mha_multi.call.decisions import DECISIONS, once_per_signature
from mha_multi.call.facts import Facts


def kernel_settings(
    facts: Facts,
    q: Array,
    *,
    sizes: tuple[Any, Any, Any],
    lens_ndim: int | None,
    lens_integer: bool,
    heads: spec.Heads,
    causal: bool,
    dropout: bool,
    return_attention_weights: bool,
    options: spec.ScoreOptions = spec.NO_OPTIONS,
) -> dict[str, Any]:
    """What :func:`mha_multi.spec.plan_kernel` reads of a call, but its values.

    Args:
        q: projected queries (for the dtype the kernel serves).
        sizes: ``(B, Q, K)``.
        lens_ndim, lens_integer: the lengths' rank (``None``: no lengths)
            and whether they are integers.
    """
    return {
        "sizes": sizes,
        "lens_ndim": lens_ndim,
        "lens_integer": lens_integer,
        "causal": causal,
        "dropout": dropout,
        "return_attention_weights": return_attention_weights,
        "grouped": heads.grouped,
        "grouped_taken": not heads.grouped
        or facts.kernel_takes_grouped(q, sizes[1], heads.head_dim),
        "mask_taken": facts.kernel_takes_mask(q, sizes[1], sizes[2]),
        "dtype_supported": facts.kernel_serves(q),
        "bias": options.bias is not None or options.alibi_slopes is not None,
        "softcap": options.softcap is not None,
        "window": options.window is not None,
        "query_positions": options.query_positions is not None,
        "sinks": options.sinks is not None,
        "segments": options.segments is not None,
    }


#: What a call's shapes and flags decide of its kernel plan (:func:`decided`).
Decision = tuple[dict[str, Any], spec.KernelPlan, bool]


def planned(facts: Facts, settings: dict[str, Any], **values: Any) -> spec.KernelPlan:
    """:func:`mha_multi.spec.plan_kernel` of the facts' kernel for a call's kernel
    ``settings`` (:func:`kernel_settings`) and what its ``values`` tell
    (``values_exact``, ``shortest_length``, ``values_guard``), made once per signature
    (:func:`~mha_multi.call.decisions.once_per_signature`): the settings as the plan
    compares them (:func:`mha_multi.spec.plan_relations`), so that a decoding step's
    growing sizes find the plan of the step before."""
    arguments = {**settings, **values}
    relations = spec.plan_relations(arguments)
    key = (facts.kernel, *relations.items())
    return once_per_signature(facts, spec.plan_kernel, key, facts.kernel, **arguments)


def decided(
    facts: Facts, q: Array, k: Array, valid_lens: Array | None, arguments: dict[str, Any]
) -> Decision:
    """What :func:`plan` decides of a call's shapes and flags, ``arguments`` (its keyword
    arguments): ``(settings, optimistic, hides_keys)``, the kernel's settings, the plan
    for values read exact, and whether that plan hides keys whatever the lengths. A
    plan made before its calls asks it whether the kernel can serve them at all
    (PyTorch's route)."""
    lens_kind = None if valid_lens is None else facts.dtype_kind(valid_lens.dtype)
    settings = kernel_settings(
        facts,
        q,
        sizes=(q.shape[0], q.shape[1], k.shape[2 if arguments["kv_split"] else 1]),
        lens_ndim=None if valid_lens is None else len(valid_lens.shape),
        lens_integer=lens_kind is None or lens_kind in "iu",
        heads=arguments["heads"],
        causal=arguments["causal"],
        dropout=arguments["dropout"],
        return_attention_weights=arguments["return_attention_weights"],
        options=arguments["options"],
    )
    optimistic = planned(facts, settings, values_exact=True)
    return settings, optimistic, hides_keys(optimistic)


def unread_plan(facts: Facts, q: Array, settings: dict[str, Any]) -> spec.KernelPlan:
    """What :func:`plan` decides of a call whose values it does not read (a read that
    would wait for the device or cost too much), from the call's kernel ``settings``
    (:func:`decided`'s): values unknown, the kernel guarded where
    :meth:`Facts.values_guard` says so. A plan made before its calls asks it where it
    reads nothing (PyTorch's route)."""
    return planned(
        facts,
        settings,
        values_exact=None,
        shortest_length=None,
        values_guard=facts.values_guard(q, settings["sizes"]),
    )


def hides_keys(plan: spec.KernelPlan) -> bool:
    """Whether the kernel ``plan`` hides keys whatever the lengths (its causal rule, window
    or packed sequences): the values read must then bound the scores
    (:meth:`~mha_multi.call.facts.Facts.plan_values`)."""
    return (
        plan.is_causal
        or plan.mask_causal
        or plan.window_flag
        or plan.mask_window
        or plan.mask_segments
    )


def plan(
    facts: Facts,
    q: Array,
    k: Array,
    v: Array,
    valid_lens: Array | None,
    *,
    heads: spec.Heads,
    causal: bool,
    dropout: bool,
    return_attention_weights: bool,
    kv_split: bool,
    options: spec.ScoreOptions = spec.NO_OPTIONS,
) -> spec.KernelPlan:
    """The kernel plan of a call: the framework's kernel only where it gives the spec's numbers.

    :func:`mha_multi.spec.plan_kernel` decides for every backend; the values
    are read (:meth:`Facts.plan_values`) only where they can still change
    the decision. What the shapes and flags decide is made once per
    signature (:meth:`Facts.plan_signature`, and of score options which are
    given: the plan reads no more of them); whether to read, and the read,
    are asked at every call.

    Args:
        q: projected queries ``(B, Q, H*dh)``; ``k``, ``v`` ``(B, K,
            H_kv*dh)``, or a cache's ``(B, H_kv, K, dh)`` with ``kv_split``.
        options: the call's score options.
    """
    if facts.kernel is None:
        return spec.KernelPlan(fused=False, reason="the backend has no fused kernel")
    if options is not spec.NO_OPTIONS and not (facts.passes_options or options.only_segments):
        return spec.KernelPlan(
            fused=False, reason="the backend's kernel call passes no positions or biases"
        )
    arguments = {
        "heads": heads,
        "causal": causal,
        "dropout": dropout,
        "return_attention_weights": return_attention_weights,
        "kv_split": kv_split,
        "options": options,
    }
    signature = facts.plan_signature(q)
    if signature is not None and options is not spec.NO_OPTIONS:
        # (Score options hold arrays: the plan reads only which are given.)
        signature = (
            signature,
            options.bias is not None,
            options.alibi_slopes is not None,
            options.softcap is not None,
            options.window is not None,
            options.query_positions is not None,
            options.sinks is not None,
            options.segments is not None,
        )
    if signature is None:
        decision = decided(facts, q, k, valid_lens, arguments)
    else:
        key = (
            facts,
            signature,
            q.shape,
            k.shape,
            None if valid_lens is None else (valid_lens.shape, valid_lens.dtype),
            heads.num_heads,
            heads.num_kv_heads,
            heads.head_dim,
            causal,
            dropout,
            return_attention_weights,
            kv_split,
        )
        # (The table of the call's decisions, looked up inline: every call asks. The
        # signature is None while a tracer must see the plan made: Facts.tracing.)
        try:
            kernel, decision = DECISIONS[key]
        except KeyError:
            kernel = None
        if kernel is not facts.kernel:  # (new, or decided for a kernel since replaced)
            decision = decided(facts, q, k, valid_lens, arguments)
            DECISIONS.keep(key, (facts.kernel, decision))
    settings, optimistic, hides_keys = decision
    if not optimistic.fused:
        return optimistic
    batch, num_queries, num_keys = settings["sizes"]
    total_scores = (
        None if facts.records_gradient(q) else batch * heads.num_heads * num_queries * num_keys
    )
    if not facts.reads_values(q, num_queries, num_keys, total_scores=total_scores):
        return unread_plan(facts, q, settings)  # a read would wait, or cost too much
    if options.bias is None:
        exact, shortest = facts.plan_values(q, k, v, valid_lens, heads, hides_keys=hides_keys)
    else:
        exact, shortest = facts.plan_values(
            q, k, v, valid_lens, heads, bias=options.bias, hides_keys=hides_keys
        )
    if exact is True and shortest is None:
        return optimistic  # what the values were assumed to be
    return planned(
        facts,
        settings,
        values_exact=exact,
        shortest_length=shortest,
        values_guard=exact is None and facts.values_guard(q, settings["sizes"]),
    )

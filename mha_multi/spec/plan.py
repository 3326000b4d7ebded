"""The kernel plan: whether a call runs a backend's fused kernel, and what the kernel is given.

One decision for every backend from the kernel's facts (:class:`FusedKernel`)
and the call's (docs: "Fast paths"), so a fused path is an optimisation and
never a second definition; and when an eager call on an accelerator reads its
values to decide (:func:`reads_values`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from mha_multi.spec.attention import MASK_VALUE
from mha_multi.spec.ops import Array, ArrayOps
from mha_multi.spec.options import NO_OPTIONS, ScoreOptions
from mha_multi.spec.positions import visibility

#: Bound on every score ``|q . k| / sqrt(head_dim)`` within which a kernel
#: that *adds* a large negative mask gives the spec's weights. The spec
#: replaces hidden scores by :data:`MASK_VALUE`: the two agree only where
#: every hidden key's weight is exactly 0 both ways, i.e. where no visible
#: score of a row lies near or below -1e6 (``exp(-5e5)`` is 0 in every float
#: type). :func:`scores_within_limit` tests it from the projections' largest
#: magnitudes.
FUSED_SCORE_LIMIT: float = -MASK_VALUE / 2


@dataclass(frozen=True)
class FusedKernel:
    """What a backend's fused attention kernel can be given: the facts
    :func:`plan_kernel` decides from, so that every backend decides by the
    same rules (docs: "Fast paths").

    Attributes:
        name: the kernel, for messages and tests.
        takes_dropout: applies dropout to its weights itself, as the spec does.
        takes_key_lengths: takes per-example key lengths ``(B,)`` (integer
            lengths need no mask then).
        causal_flag: has its own (top-left aligned) causal flag.
        mask_and_causal: takes a boolean mask (or a bias) together with that flag.
        replaces_hidden_scores: hides keys by *replacing* their scores, as the
            spec does. A kernel that *adds* ``-inf`` lets a hidden key's
            non-finite score through, and may turn a NaN row into zeros, so it
            runs only where the caller read the values and found them exact
            (``values_exact``).
        hidden_rows_uniform: gives a query that sees no key uniform weights,
            as the spec does (it masks with ``MASK_VALUE`` itself), so no row
            needs :func:`fix_fully_hidden_rows`.
        takes_grouped_heads: takes fewer key/value heads than query heads
            (grouped-query attention) without their being repeated.
        takes_bias: takes a floating bias added to the scaled scores before
            its masks (:func:`score_bias`: the call's ``bias`` and ALiBi).
        takes_softcap: soft-caps the scaled scores itself, ``c * tanh(s /
            c)``, before the bias and the masks.
        takes_window: has its own sliding window beside its mask and causal
            flag, top-left aligned: key ``j`` is hidden from query ``i``
            unless ``i - j < window`` (used only where that is the spec's
            frame; the boolean mask holds the window otherwise).
        takes_any_mask: takes any boolean mask, not only one whose visible
            keys are a prefix of each row (lengths and the causal rule):
            packed sequences' need it.
    """

    name: str
    takes_dropout: bool = False
    takes_key_lengths: bool = False
    causal_flag: bool = True
    mask_and_causal: bool = False
    replaces_hidden_scores: bool = False
    hidden_rows_uniform: bool = False
    takes_grouped_heads: bool = False
    takes_bias: bool = False
    takes_softcap: bool = False
    takes_window: bool = False
    takes_any_mask: bool = True


@dataclass(frozen=True)
class KernelPlan:
    """What one call gives a fused kernel, or that it takes the generic path.

    Attributes:
        fused: whether the fused kernel runs at all.
        reason: why not, when ``fused`` is false (for messages and tests).
        is_causal: pass the kernel's own causal flag (top-left aligned, which
            is the spec's rule because ``Q == K``).
        key_lengths: pass the ``(B,)`` lengths as the kernel's key lengths.
        mask_lens: the boolean mask holds the lengths.
        mask_causal: the boolean mask holds the causal rule.
        fix_rows: rows may be fully hidden; give them the spec's value with
            :func:`fix_fully_hidden_rows` and :meth:`fix_visibility`.
        fix_causal: the causal rule can hide whole rows (``Q > K``, own query
            positions, or packed sequences whose keys have ids of their own).
        repeat_kv: grouped key/value heads must be repeated (once, on the
            projected heads) for a kernel that takes no groups.
        bias: give the kernel the additive bias, :func:`score_bias` (the
            call's ``bias`` and ALiBi).
        softcap: give the kernel the soft cap.
        window_flag: give the kernel the window, as its own sliding window
            (the frames agree: ``Q == K`` and no query positions).
        mask_window: the boolean mask holds the window rule.
        fix_window: the window can hide whole rows (with lengths, or query
            positions): :meth:`fix_visibility` includes it.
        mask_segments: the boolean mask holds the packed sequences' rule
            (:attr:`ScoreOptions.segments`), which hides padding rows whole:
            :meth:`fix_visibility` includes it.
        guarded: the values were not read (a compiled graph): the kernel's
            context is taken where the values are exact, as the device finds
            them, and the generic path's elsewhere, one conditional in the
            graph (docs: "Fast paths").
    """

    fused: bool
    reason: str = ""
    is_causal: bool = False
    key_lengths: bool = False
    mask_lens: bool = False
    mask_causal: bool = False
    fix_rows: bool = False
    fix_causal: bool = False
    repeat_kv: bool = False
    bias: bool = False
    softcap: bool = False
    window_flag: bool = False
    mask_window: bool = False
    fix_window: bool = False
    guarded: bool = False
    mask_segments: bool = False

    @property
    def needs_mask(self) -> bool:
        return self.mask_lens or self.mask_causal or self.mask_window or self.mask_segments

    def mask(
        self,
        ops: ArrayOps,
        num_queries: Any,
        num_keys: Any,
        valid_lens: Array | None,
        options: ScoreOptions = NO_OPTIONS,
    ) -> Array | None:
        """The boolean mask the kernel is given (``None`` where it needs none).

        ``options`` gives the window and the query positions (those of the
        call the plan was made for).
        """
        if not self.needs_mask:
            return None
        lens = valid_lens if self.mask_lens else None
        return visibility(
            ops,
            num_queries,
            num_keys,
            lens,
            causal=self.mask_causal,
            window=options.window if self.mask_window else None,
            query_positions=options.query_positions,
            segments=options.segments if self.mask_segments else None,
        )

    def fix_visibility(
        self,
        ops: ArrayOps,
        num_queries: Any,
        num_keys: Any,
        valid_lens: Array | None,
        options: ScoreOptions = NO_OPTIONS,
    ) -> Array | None:
        """What :func:`fix_fully_hidden_rows` reads (``None``: no row to fix).

        The causal rule hides whole rows only when ``Q > K`` (in the
        bottom-right frame), so below that the lengths, and the window,
        tell which rows are fully hidden: a query at ``i_abs >= 0`` sees
        key ``i_abs`` through the window and the causal rule alike, so the
        causal rule never empties a row the others leave seen. Packed
        sequences' ids may leave a query only later keys (the keys' own
        ids): there the causal rule is read too (:attr:`fix_causal`).
        """
        if not self.fix_rows:
            return None
        return visibility(
            ops,
            num_queries,
            num_keys,
            valid_lens,
            causal=self.fix_causal,
            window=options.window if self.fix_window else None,
            query_positions=options.query_positions,
            segments=options.segments if self.mask_segments else None,
        )


def _generic(reason: str) -> KernelPlan:
    return KernelPlan(fused=False, reason=reason)


def plan_relations(settings: dict[str, Any]) -> dict[str, Any]:
    """:func:`plan_kernel`'s settings with the sizes and the shortest length as it compares them.

    A plan reads of ``(B, Q, K)`` and ``shortest_length`` only which are 0,
    how ``Q`` compares with ``K``, and whether the shortest length is
    positive and at least ``K``: sizes with the same answers give the same
    plan. (A NaN length, or sizes not known, are kept as they are.)
    """
    sizes = settings["sizes"]
    batch, num_queries, num_keys = sizes
    # (Spelled out, not all() of a generator: every call of every layer asks.)
    if not (type(batch) is int and type(num_queries) is int and type(num_keys) is int):
        return settings
    if 0 in sizes:
        return {**settings, "sizes": tuple(min(size, 1) for size in sizes)}
    relation = 1 if num_queries < num_keys else 2 if num_queries == num_keys else 3
    shortest = settings.get("shortest_length")
    if shortest is not None and shortest == shortest:  # not NaN
        shortest = 2 if shortest >= num_keys else 1 if shortest > 0 else 0
    return {**settings, "sizes": (1, relation, 2), "shortest_length": shortest}


#: Scores per head (``Q * K``) from which an eager call on an accelerator reads
#: its projections to the host to choose the fused kernel (:func:`reads_values`).
DEVICE_READ_SCORES = 1 << 16


#: Scores in all (``B * H * Q * K``) from which an eager call on an accelerator
#: that records no gradient reads (:func:`reads_values`).
DEVICE_READ_TOTAL_SCORES = 1 << 26


def reads_values(
    on_host: bool, num_queries: int, num_keys: int, *, total_scores: int | None = None
) -> bool:
    """Whether an eager call reads its projections to plan (``values_exact``,
    one transfer), its arrays on the host (``on_host``) or an accelerator.

    On the host always: nothing waits. On an accelerator the transfer waits
    for every kernel queued before it, so only where a head's scores are
    many (:data:`DEVICE_READ_SCORES`): there the fused kernel saves more than
    that wait costs and never holds the ``(B, H, Q, K)`` scores. A call that
    records no gradient gives its ``total_scores`` (``B * H * Q * K``): its
    generic path holds them only while it runs, and reads only from
    :data:`DEVICE_READ_TOTAL_SCORES`, where the kernel's time saved first
    outweighs the wait. Below it (a decoding step, a short call) nothing is
    read, the generic path runs, and the forward never synchronises (docs:
    "Fast paths", measured on an H100 on the results page).
    """
    if on_host:
        return True
    if num_queries * num_keys < DEVICE_READ_SCORES:
        return False
    return total_scores is None or total_scores >= DEVICE_READ_TOTAL_SCORES


def magnitude_limit(head_dim: int) -> float:
    """The bound on ``max|q| * max|k|`` below which every score lies within
    :data:`FUSED_SCORE_LIMIT`: ``|q . k| / sqrt(head_dim) <= sqrt(head_dim) *
    max|q| * max|k|`` (Cauchy-Schwarz, per element)."""
    return FUSED_SCORE_LIMIT / math.sqrt(head_dim)


def scores_within_limit(query_max: float, key_max: float, head_dim: int) -> bool:
    """Whether every score of queries and keys of these largest magnitudes
    (``max|q|``, ``max|k|``) lies within :data:`FUSED_SCORE_LIMIT`
    (:func:`magnitude_limit`). A NaN magnitude fails."""
    return query_max * key_max < magnitude_limit(head_dim)


def plan_kernel(
    kernel: FusedKernel,
    *,
    sizes: tuple[Any, Any, Any],
    lens_ndim: int | None,
    lens_integer: bool = True,
    causal: bool = False,
    dropout: bool = False,
    return_attention_weights: bool = False,
    dtype_supported: bool = True,
    values_exact: bool | None = None,
    shortest_length: float | None = None,
    grouped: bool = False,
    grouped_taken: bool = True,
    bias: bool = False,
    softcap: bool = False,
    window: bool = False,
    segments: bool = False,
    query_positions: bool = False,
    values_guard: bool = False,
    sinks: bool = False,
    mask_taken: bool = True,
) -> KernelPlan:
    """Whether a call runs ``kernel``, and what the kernel is given.

    One decision for every backend: the fused path runs only where it gives
    the spec's numbers, so it is an optimisation and never a second
    definition (docs: "Fast paths").

    Args:
        kernel: the facts of the backend's kernel.
        sizes: ``(B, Q, K)``; ``None`` (or anything not an int) where unknown.
        lens_ndim: ``None`` without lengths, else 1 or 2.
        lens_integer: whether the lengths are integers.
        causal: the spec's causal flag.
        dropout: whether dropout is active for this call.
        return_attention_weights: whether the call returns the weights.
        dtype_supported: whether the kernel serves this dtype and precision.
        values_exact: what the caller read from the values: ``True`` when
            every projection (and the bias, where there is one) is finite
            (and, where the backend's kernel needs it, bounded), ``False``
            when not, ``None`` when they cannot be read (a traced graph).
        shortest_length: the shortest length, where it was read; ``None``
            where it was not (every row may then be fully hidden).
        grouped: fewer key/value heads than query heads.
        grouped_taken: where the kernel takes grouped heads, whether it is
            to take this call's as they are; ``False`` where the framework
            serves them better repeated (a kernel that would hold every
            score otherwise), so the plan repeats them once.
        bias: the scores get an additive bias (a ``bias`` argument or ALiBi).
        softcap: the scores are soft-capped.
        window: the layer has a sliding window.
        query_positions: the queries sit at their own positions among the
            keys (:attr:`ScoreOptions.query_positions`, a cached call), not
            in the bottom-right frame.
        values_guard: where the values are unreadable (``values_exact is
            None``), the caller can choose between the kernel and the
            generic path on the device, from the values
            (:attr:`KernelPlan.guarded`). Never with dropout: the two paths
            would draw different random numbers.
        sinks: the layer has attention sinks (:mod:`mha_multi.spec.sinks`).
            No backend's kernel takes a sink column: such a call always
            takes the generic path.
        segments: the call packs sequences (``segment_ids``): the boolean
            mask holds their rule, and padding rows are fully hidden.
        mask_taken: whether the kernel is to take this call's explicit mask
            or bias, where it needs one (the lengths', the causal rule's
            without the kernel's flag, a window's, packed sequences', an
            additive bias); ``False`` where the framework's kernel runs such
            a mask over these sizes slower than the generic path, which the
            call then takes (the same numbers: docs: "Fast paths").

    Returns:
        The plan.
    """
    if return_attention_weights:
        return _generic("the attention weights are requested")
    if not dtype_supported:
        return _generic("the kernel does not serve this dtype or precision")
    if bias and not kernel.takes_bias:
        return _generic("the kernel takes no additive bias (bias or ALiBi)")
    if softcap and not kernel.takes_softcap:
        return _generic("the kernel has no soft-capping")
    if sinks:
        return _generic("the kernel has no attention sinks")
    if segments and not kernel.takes_any_mask:
        return _generic("the kernel takes no mask of packed sequences")
    if not all(isinstance(size, int) for size in sizes):
        return _generic("sizes unknown while tracing")
    batch, num_queries, num_keys = sizes
    if batch == 0 or num_queries == 0 or num_keys == 0:
        return _generic("an empty axis")
    guarded = False
    if not kernel.replaces_hidden_scores and values_exact is not True:
        guarded = values_exact is None and values_guard and not dropout
        if not guarded:
            return _generic(
                "non-finite or unbounded values" if values_exact is False else "values unreadable"
            )
    if shortest_length is not None and lens_ndim is not None and shortest_length >= num_keys:
        lens_ndim = None  # lengths that hide nothing need no mask
    lens_may_hide_rows = lens_ndim is not None and not (
        shortest_length is not None and shortest_length > 0  # NaN hides every key
    )
    # Own query positions may lie anywhere: the causal rule may then hide
    # whole rows whatever the sizes.
    causal_hides_rows = causal and (num_queries > num_keys or query_positions)
    # Without lengths a window leaves each query key i_abs (causal) or the
    # keys after it; with lengths, or own positions, it may leave none.
    window_hides_rows = window and (lens_ndim is not None or query_positions)
    fix_rows = (
        lens_may_hide_rows or causal_hides_rows or window_hides_rows or segments
    ) and not kernel.hidden_rows_uniform
    if dropout and not kernel.takes_dropout:
        return _generic("the kernel has no dropout")
    if dropout and fix_rows:
        # A fully hidden row would need dropout on its uniform weights.
        return _generic("dropout with rows that may be fully hidden")
    key_lengths = lens_ndim == 1 and lens_integer and kernel.takes_key_lengths
    mask_lens = lens_ndim is not None and not key_lengths
    # The kernel's own flags are top-left aligned: the spec's frame only when Q == K.
    same_frame = num_queries == num_keys and not query_positions
    window_flag = window and kernel.takes_window and same_frame
    mask_window = window and not window_flag
    is_causal = (
        causal
        and kernel.causal_flag
        and same_frame
        # A bias reaches a kernel beside its mask, where the causal flag may not go.
        and (not (mask_lens or mask_window or bias or segments) or kernel.mask_and_causal)
    )
    mask_causal = causal and not is_causal
    if not mask_taken and (mask_lens or mask_causal or mask_window or bias or segments):
        return _generic("the kernel takes a mask over so few keys slower than the generic path")
    return KernelPlan(
        fused=True,
        is_causal=is_causal,
        key_lengths=key_lengths,
        mask_lens=mask_lens,
        mask_causal=mask_causal,
        fix_rows=fix_rows,
        # The rows to fix are found with the causal rule where it may empty them: past
        # the keys, at own positions, or among packed sequences, whose keys may carry
        # ids of their own (a pair of ids: the query's keys may all come after it).
        fix_causal=causal and (causal_hides_rows or segments),
        repeat_kv=grouped and not (kernel.takes_grouped_heads and grouped_taken),
        bias=bias,
        softcap=softcap,
        window_flag=window_flag,
        mask_window=mask_window,
        fix_window=window and fix_rows,
        guarded=guarded,
        mask_segments=segments,
    )

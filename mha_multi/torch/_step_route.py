"""The PyTorch facts' fast route for a plain decoding step (docs: "Fast paths").

A decoding step whose queries are its keys and values and that asks for
nothing else is offered to :meth:`StepRoute.plain_step` at the layer's door,
before its flow (:meth:`mha_multi.torch.MultiHeadAttention.forward`): one
query per example, a cache whose check (:class:`CacheCheck`) still holds,
every example at a length with room for one more. The plan the step before
made for the same layer and arguments, which the cache's check carries, runs
it straight through (:func:`~mha_multi.torch._steps.decoding_step`, on the fused
plan or, where a GPU reads nothing, the generic one;
examples at different lengths, :func:`~mha_multi.torch._ragged.ragged_step`);
the first step of a signature is planned by
:class:`~mha_multi.torch._plain.PlainRoute`, of which this is a part.
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch

from mha_multi import call, spec
from mha_multi.torch._cache import CHECKS, CacheCheck
from mha_multi.torch._ops import autocasting
from mha_multi.torch._ragged import ragged_step
from mha_multi.torch._steps import PlainPlan, StepResult, decoding_step

__all__ = ["StepRoute"]


class StepRoute:
    """The route's part for decoding steps, a part of the PyTorch facts
    (:class:`mha_multi.torch._facts.TorchFacts`, whose span bucket and ``on_host`` it
    reads, and of :class:`~mha_multi.torch._plain.PlainRoute`, whose plans it takes)."""

    on_host: Any
    span_bucket_of: Any
    _plain_plan: Any

    def plain_step(
        self,
        layer: call.Projections,
        queries: torch.Tensor,
        cache: spec.KVCache,
        *,
        causal: bool,
        dtype: torch.dtype | None,
        options: spec.LayerOptions | None,
    ) -> StepResult | None:
        """A plain decoding step (a call :func:`mha_multi.call.plain_self_attention` names,
        with a cache and no lengths): its output and updated cache, or ``None`` where the
        route takes none.

        What the generic flow's checks, plan and span decided for the step before,
        of this layer and these arguments, the cache's check carries
        (:attr:`mha_multi.torch._cache.CacheCheck.step`): a step of the same
        signature on a cache that check still holds runs straight through to
        :func:`decoding_step`. The PyTorch layer asks here
        first, before its call's flow, where its call is a plain step
        (:meth:`mha_multi.torch.MultiHeadAttention.forward`).

        Taken where the generic flow would, at this step, check its arguments
        as it did for the same shapes before and run SDPA after one
        finiteness read (or, on a GPU, the generic path's attention, which
        reads nothing): an eager step recording no gradient, no autocast, outside
        ``torch.func``'s transforms, one query per example, a cache whose check
        (:class:`CacheCheck`) still holds, every example at a length ``>= 1``
        with room for one more
        (examples at different lengths: :func:`ragged_step`). Its new rows
        are written in place at that position, and it attends over the
        filled positions (rounded up to the span bucket, ``span_bucket_of``,
        for the generic path). On the host the check must know every
        position below the lengths finite and kernels must take any span
        (the CPU); on a GPU the step's rows are left for a later read to
        check, as the generic flow leaves them. The operations are the
        generic flow's, on the same tensors: the numbers are its numbers to
        the bit, and a cache and its check are left as it leaves them.
        Rotary positions rotate the step's query and key by the plan's table
        row of its position, the generic flow's default one; ALiBi, the
        window, soft-capping and sinks are taken too, their masks and bias
        patterns the plan made once, of which each step takes a view (those
        the generic flow makes at each step, of the step's one position).
        Anything else returns ``None`` before writing anything, and the
        generic flow runs the step (docs: "Fast paths"); so do non-finite
        values read, whose rows :func:`decoding_step` has written and made zeros
        again.
        """
        # (No step records a gradient: a cached call that does takes the generic flow; nor
        # writes in place under torch.func's transforms: torch.vmap's examples each make
        # a cache of their own there.)
        if (
            type(queries) is not torch.Tensor
            or torch.is_grad_enabled()
            or torch.compiler.is_compiling()
            or torch._C._are_functorch_transforms_active()
        ):
            return None
        # The check of the step's cache, whose ``uniform`` length every example holds (a
        # fused plan asks besides that every position below the lengths be known finite).
        # CacheCheck.of, inline: every step asks. (carried_check's, but for its test of the
        # carrier: an entry goes when its tensor does, or when its check moves on to other
        # lengths, so that the entry of a live tensor's id is the check it carries.)
        if type(cache) is not spec.KVCache:
            return None
        keys, values, lengths = cache
        check = CHECKS.get(id(lengths))
        if check is None:
            return None
        if (
            keys is not check.keys()
            or values is not check.values()
            or (keys._version, values._version) != check.versions
            or lengths._version != check.lengths_version
            or (keys.data_ptr(), values.data_ptr()) != check.addresses
            or lengths.data_ptr() != check.lengths_address
            # (No inference tensor, which keeps no version counter: a check holds none of
            # them, CacheCheck.attach.)
        ):
            return None
        length = check._uniform
        if length == -1:  # (not known yet: CacheCheck.uniform resolves it)
            length = check.uniform
        # (Examples at different lengths: a ragged step, whose rest ragged_step checks.)
        if length is not None or not check.examples:
            # (A check may stand for more positions than are filled: those a GPU's span
            # rounded up to and a read checked. An overflow among them: the generic flow
            # raises it.)
            if length is None or length < 1 or check.upto < length or length >= keys.shape[2]:
                return None
            # (Nothing past the filled positions is attended over: the values there must
            # be known finite, call.Facts.finite_past.)
            finite_from = check.finite_from
            if finite_from is None or finite_from > length + 1:
                return None
        # The step before, where it was this layer's with these arguments, planned this
        # one. (The options compared by identity first: a tuple's items are. The queries'
        # shape is the key's: the check's examples, one query each, where it was planned.)
        device = queries.device
        key = (dtype, causal, queries.shape, queries.dtype, device, options)
        step = check.step
        if step is not None and step[0]() is layer and step[1] == key:
            # (Autocast's one flag asked first, autocasting's own first test: every step asks.)
            if torch._C._is_any_autocast_enabled() and autocasting(
                "cpu" if self.on_host(queries) else device.type
            ):
                return None
            plan = step[2]
        elif queries.shape[:2] != (check.examples, 1):
            return None
        else:
            plan = self._plain_plan(
                layer, queries, cache, causal=causal, dtype=dtype, options=options
            )
            step = None if plan is None else (weakref.ref(layer), key, plan)
        if plan is None:
            return None
        rotary = None if options is None else options.rotary
        if check._uniform is None:  # (examples at different lengths)
            return ragged_step(self, plan, layer, queries, cache, check, step, options)
        first = 0  # (the first cache position attended over)
        if plan.window is not None:
            first = self._window_first(check, plan, cache, on_host=self.on_host(queries))
            if first == check._uniform + 1 - plan.window or check._uniform < plan.window:
                plan = plan.within  # (the window hides none of the keys attended over)
                if plan is None:
                    return None
        if (check.pending is not None or check.poison is not None) and (
            plan.fused or (plan.may_read and self.on_host(queries))
        ):
            return None  # (rows no call has read yet: the generic flow reads them here)
        if plan.fused:
            return decoding_step(layer, queries, cache, check, plan, step, rotary, first)
        filled = check._uniform + 1  # (CacheCheck.uniform, resolved by the check)
        spans = plan.spans
        span = spans.get(filled, 0)
        if span == 0:
            span = self._step_span(layer, cache, filled, may_read=plan.may_read)
            # The lengths up to it have its span too (spec.rounded_span rounds up):
            # the steps to come find theirs.
            for upto in range(filled, filled + 1 if span is None else span + 1):
                spans[upto] = span
        if span is None:
            return None  # (the generic flow reads for it)
        return decoding_step(layer, queries, cache, check, plan, step, rotary, first, span)

    def _window_first(
        self, check: CacheCheck, plan: PlainPlan, cache: spec.KVCache, *, on_host: bool
    ) -> int:
        """The first cache position a step of a windowed layer attends over, as the generic
        flow leaves out those before its window (:func:`mha_multi.call.attended_positions`);
        0 where it keeps every position.

        Past the window, where every value before it is known finite
        (:meth:`mha_multi.call.Facts.finite_before`): a fused plan's check
        knows it (its span bucket is 1); on the host, the rows no call has
        read yet and the poison are read as the generic flow reads them (and
        then known finite to the calls after); a GPU's check knows it where
        nothing is unread (right after a call that read every value). The
        position is rounded down to the span bucket, as the generic flow's:
        the plan's patterns are viewed from there.
        """
        length, window = check._uniform, plan.window
        if length < window:
            return 0
        if plan.fused:
            return length + 1 - window  # (spec.window_first's, its span bucket 1)
        first = spec.window_first(length, window, self.span_bucket_of(cache.keys))
        if on_host:
            row = length - 1
            if (
                check.poison is None
                and check.pending == ()
                and check.pending_from == row
                and check.upto == length
            ):
                # The one row no call read is the step before's: read it alone.
                keys, values = cache.keys, cache.values
                total = keys.select(2, row).sum(dtype=torch.float32)
                total = total + values.select(2, row).sum(dtype=torch.float32)
                read = total.item()
                if read - read == 0.0:  # (inf - inf and NaN are NaN)
                    check.pending = check.pending_from = None
                    return first
            poison = check.settled()  # (the rows no call read, summed with the poison)
            if poison is not None and not math.isfinite(poison.item()):
                return 0
            check.poison = None
            return first
        clean = check.pending is None and check.pending_from is None and check.poison is None
        return first if clean else 0

    def _step_span(
        self, layer: call.Projections, cache: spec.KVCache, filled: int, *, may_read: bool
    ) -> int | None:
        """The generic flow's span of a step on ``cache`` filled to ``filled`` positions
        (:meth:`mha_multi.spec.CacheFill.span`), or ``None`` where that flow reads for it
        (``may_read``: its plan for values read finite is the fused kernel's, and
        :func:`mha_multi.spec.reads_values` says a read pays)."""
        keys = cache.keys
        span = spec.rounded_span(filled, keys.shape[2], self.span_bucket_of(keys))
        if not may_read:
            return span
        total_scores = keys.shape[0] * layer.heads.num_heads * span  # (no gradient here)
        return (
            None
            if spec.reads_values(self.on_host(keys), 1, span, total_scores=total_scores)
            else span
        )

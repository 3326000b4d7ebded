"""The fast route's calls with lengths: self-attention with ``valid_lens`` (docs: "Fast paths").

A call without a cache whose queries are its keys and values, given lengths
as a tensor, on the host, by a layer whose options the fused kernel takes
(rotary positions, query/key norms, a window, ALiBi; not a soft cap or
sinks), is planned once per
signature by :class:`~mha_multi.torch._plain.PlainRoute` (the generic flow's
checks, the kernel's settings): each call then makes the generic flow's one
read of its values and lengths, the kernel plan that read decides, and the
generic flow's kernel call, so its numbers are the generic flow's to the bit.
"""

from __future__ import annotations

from typing import Any

import torch

from mha_multi import call, spec
from mha_multi.torch._ops import SIXTEEN_BIT
from mha_multi.torch._steps import PlainPlan, project_output

__all__ = ["LengthsRoute"]


class LengthsRoute:
    """The route's part for lengths, a part of the PyTorch facts
    (:class:`mha_multi.torch._facts.TorchFacts`, whose kernel, read, conversions and
    kernel call it takes)."""

    kernel: spec.FusedKernel
    as_lens: Any
    plan_values: Any
    fused_attention: Any
    ops: Any

    def _lengths_plan(
        self,
        layer: call.Projections,
        queries: torch.Tensor,
        lengths: torch.Tensor,
        options: spec.ScoreOptions,
        *,
        causal: bool,
        sizes: tuple[int, int, int],
    ) -> PlainPlan | None:
        """The plan of calls with ``lengths`` (checked) on the host and the layer's score
        ``options`` (the generic flow's, :func:`~mha_multi.torch._route_options.call_options`):
        the kernel's settings, from which each call plans its kernel by its values read
        (:meth:`_with_lengths`), and the kernel call's ``options``; or ``None`` where the
        fused kernel serves no values of them (the generic flow's path)."""
        settings = call.kernel_settings(
            self,
            queries,
            sizes=sizes,
            lens_ndim=lengths.ndim,
            lens_integer=not lengths.is_floating_point(),
            heads=layer.heads,
            causal=causal,
            dropout=False,
            return_attention_weights=False,
            options=options,
        )
        optimistic = spec.plan_kernel(self.kernel, **settings, values_exact=True)
        if not optimistic.fused or queries.dtype in SIXTEEN_BIT:
            return None
        return PlainPlan(
            True, {"options": options}, bounded=call.hides_keys(optimistic), settings=settings
        )

    def _with_lengths(
        self,
        layer: call.Projections,
        plan: PlainPlan,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        valid_lens: torch.Tensor,
    ) -> call.Result | None:
        """A call with lengths on ``plan`` (:meth:`_lengths_plan`), of its projections
        ``(B, Q, ·)``: the generic flow's read (:meth:`plan_values`, the lengths' too),
        its kernel plan for what was read (:func:`mha_multi.call.plan`'s) and its kernel
        call, or ``None`` where that plan is not the fused kernel's (the generic flow,
        which reads again, runs the call)."""
        lengths = self.as_lens(valid_lens, q)
        heads = layer.heads
        try:
            exact, shortest = self.plan_values(q, k, v, lengths, heads, hides_keys=plan.bounded)
        except RuntimeError:  # (values torch.vmap batches, which no read may take)
            return None
        if exact is None:  # (nothing read: torch.func's transforms, whose plan is the flow's)
            return None
        kernel_plan = spec.plan_kernel(
            self.kernel,
            **plan.settings,
            values_exact=exact,
            shortest_length=shortest,
            values_guard=False,  # (the host reads: call.plan guards none)
        )
        if not kernel_plan.fused:
            return None
        context = self.fused_attention(
            self.ops(q),
            q,
            k,
            v,
            lengths,
            kernel_plan,
            heads=heads,
            kv_split=False,
            dropout_rate=0.0,
            **plan.arguments,
        )
        return call.Result(project_output(layer, context, True), None, None)

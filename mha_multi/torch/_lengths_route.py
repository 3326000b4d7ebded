"""The fast route's calls with lengths: self-attention with ``valid_lens`` (docs: "Fast paths").

A call without a cache whose queries are its keys and values, given lengths
as a tensor, on the host, by a layer whose options the fused kernel takes
(rotary positions, query/key norms, a window, ALiBi; not a soft cap or
sinks), is planned once per signature by
:class:`~mha_multi.torch._plain.PlainRoute` (the generic flow's checks, and
what its kernel plan decides of the shapes and flags,
:func:`mha_multi.call.decided`): each call then makes the generic flow's one
read of its values and lengths and the kernel plan that read decides (its
kernel plan itself, :func:`mha_multi.call.plan`), and the generic flow's
kernel call, so its numbers are the generic flow's to the bit.
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
    (:class:`mha_multi.torch._facts.TorchFacts`, whose kernel plan, conversions and
    kernel call it takes)."""

    as_lens: Any
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
    ) -> PlainPlan | None:
        """The plan of calls with ``lengths`` (checked) on the host and the layer's score
        ``options`` (the generic flow's, :func:`~mha_multi.torch._route_options.call_options`):
        the arguments of their kernel plan (:func:`mha_multi.call.plan`), which each call
        makes by its values read (:meth:`_with_lengths`), and the kernel call's
        ``options``; or ``None`` where the fused kernel serves no values of them
        (:func:`mha_multi.call.decided`: the generic flow's path)."""
        arguments = {
            "heads": layer.heads,
            "causal": causal,
            "dropout": False,
            "return_attention_weights": False,
            "kv_split": False,
            "options": options,
        }
        optimistic = call.decided(self, queries, queries, lengths, arguments)[1]
        if not optimistic.fused or queries.dtype in SIXTEEN_BIT:
            return None
        return PlainPlan(True, {"options": options}, planned=arguments)

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
        ``(B, Q, ·)``: the generic flow's kernel plan (:func:`mha_multi.call.plan`: its
        read, and the plan for what was read) and its kernel call, or ``None`` where
        that plan is not the fused kernel's alone (the generic flow, which reads again,
        runs the call)."""
        lengths = self.as_lens(valid_lens, q)
        heads = layer.heads
        try:
            kernel_plan = call.plan(self, q, k, v, lengths, **plan.planned)
        except RuntimeError:  # (values torch.vmap batches, which no read may take)
            return None
        if not kernel_plan.fused or kernel_plan.guarded:  # (guarded: nothing read)
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

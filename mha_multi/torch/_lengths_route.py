"""The fast route's calls with lengths: self-attention with ``valid_lens`` (docs: "Fast paths").

A call without a cache whose queries are its keys and values, given lengths
as a tensor, is planned once per signature by
:class:`~mha_multi.torch._plain.PlainRoute` (the generic flow's checks, and
what its kernel plan decides of the shapes and flags,
:func:`mha_multi.call.decided`). On the host, by a layer whose options the
fused kernel takes (rotary positions, query/key norms, a window, ALiBi),
each call then makes the generic flow's one read of its values and lengths
and the kernel plan that read decides (its kernel plan itself,
:func:`mha_multi.call.plan`), and the generic flow's kernel call. Where that
flow's plan is the generic path's whatever the values (a soft cap, sinks),
or where it reads nothing (a GPU's call whose scores are few), each call
runs the generic path's attention with its lengths' mask, which reads
nothing either. Either way its numbers are the generic flow's to the bit.
"""

from __future__ import annotations

from typing import Any

import torch

from mha_multi import call, spec
from mha_multi.torch._ops import OPS, SIXTEEN_BIT
from mha_multi.torch._route_options import generic_plan
from mha_multi.torch._steps import PlainPlan, project_output

__all__ = ["LengthsRoute"]


class LengthsRoute:
    """The route's part for lengths, a part of the PyTorch facts
    (:class:`mha_multi.torch._facts.TorchFacts`, whose kernel plan, conversions and
    kernel call it takes)."""

    as_lens: Any
    fused_attention: Any
    on_host: Any
    ops: Any

    def _lengths_plan(
        self,
        layer: call.Projections,
        queries: torch.Tensor,
        lengths: torch.Tensor,
        options: spec.ScoreOptions,
        *,
        causal: bool,
        reads: bool,
    ) -> PlainPlan | None:
        """The plan of calls with ``lengths`` (checked) and the layer's score ``options``
        (the generic flow's, :func:`~mha_multi.torch._route_options.call_options`), or
        ``None`` where the route takes none (``reads``: the generic flow's plan reads
        the values, :func:`mha_multi.spec.reads_values`).

        Where the fused kernel may serve such calls (:func:`mha_multi.call.decided`),
        on the host: the arguments of their kernel plan (:func:`mha_multi.call.plan`),
        which each call makes by its values read (:meth:`_with_lengths`), and the
        kernel call's ``options``; on a GPU, a call that reads nothing, whose plan
        is then the generic path's, as the generic flow plans values it does not
        read. Where the generic flow's plan is the generic path's: that path's
        plan (:func:`~mha_multi.torch._route_options.generic_plan`), each call's
        lengths masked by :meth:`_visible_within`.
        """
        arguments = {
            "heads": layer.heads,
            "causal": causal,
            "dropout": False,
            "return_attention_weights": False,
            "kv_split": False,
            "options": options,
        }
        settings, optimistic, _ = call.decided(self, queries, queries, lengths, arguments)
        if optimistic.fused:
            if self.on_host(queries):
                if queries.dtype in SIXTEEN_BIT:
                    return None
                return PlainPlan(True, {"options": options}, planned=arguments)
            if reads:
                return None  # (a GPU's long call: the generic flow reads it)
            if call.unread_plan(self, queries, settings).fused:
                return None  # (what call.plan decides of values it does not read)
        ops = self.ops(queries)
        return generic_plan(PlainPlan(False, {}), ops, layer, queries, options, None, causal=causal)

    def _visible_within(
        self,
        valid_lens: torch.Tensor,
        q: torch.Tensor,
        visible: torch.Tensor | None,
        num_keys: int | None = None,
    ) -> torch.Tensor:
        """Which of ``num_keys`` keys (``None``: as many as queries) each query of a call
        with ``valid_lens`` sees, of those ``visible`` (a generic plan's, ``None``: all):
        the lengths' mask (:func:`mha_multi.spec.visibility`, the generic flow's, of
        the lengths as it takes them) and the plan's, both as the generic flow's one
        mask has them."""
        lengths = self.as_lens(valid_lens, q)
        num_queries = q.shape[1]
        seen = spec.visibility(
            OPS, num_queries, num_queries if num_keys is None else num_keys, lengths
        )
        return seen if visible is None else seen & visible

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

"""The PyTorch facts' fast route for plain self-attention (docs: "Fast paths").

A call whose queries are its keys and values and that asks for nothing
else (:func:`mha_multi.call.plain_self_attention`) is offered to
:meth:`PlainRoute.plain_attention` before any check: for shapes it has seen,
it runs the dozen operations the generic flow would, to its numbers, with
the checks' verdict and the kernel plan looked up (:class:`PlainPlan`); a
decoding step, offered at the layer's door, runs the plan the cache it wrote
carries (:mod:`mha_multi.torch._step_route`). On the host those are
SDPA's after one finiteness read; on a GPU, where that read would wait for
the device, the generic path's attention, which reads nothing.
:class:`mha_multi.torch._facts.TorchFacts` takes the route from here; this
module imports nothing of it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from mha_multi import call, spec
from mha_multi.spec.memo import MISSING, KeptBy
from mha_multi.torch._cross import CrossRoute
from mha_multi.torch._kernel import folded_mask, folds_groups
from mha_multi.torch._lengths_route import LengthsRoute
from mha_multi.torch._ops import SIXTEEN_BIT, autocasting
from mha_multi.torch._projections import split_stacked
from mha_multi.torch._reads import extremes, magnitude_of, read_together
from mha_multi.torch._rotary import rotate_stacked, wide_tables
from mha_multi.torch._route_options import call_options, fused_taken, generic_plan, kernel_mask
from mha_multi.torch._step_route import StepRoute
from mha_multi.torch._steps import (
    PlainPlan,
    heads_attention,
    normalized,
    project_output,
)

__all__ = ["PlainPlan", "PlainRoute"]

#: How many shapes of a layer's calls :meth:`PlainRoute.plain_attention` keeps plans for.
_PLAIN_PLANS = 64


#: The generic flow's kernel plans of a ragged step that the route's takes: SDPA with the
#: lengths' mask, the window's too (whose fix of rows hidden whole changes nothing: every
#: query sees its own new key), and either with ALiBi's bias.
_RAGGED_KERNEL_PLANS = tuple(
    spec.KernelPlan(fused=True, mask_lens=True, bias=bias, **window)
    for bias in (False, True)
    for window in ({}, {"fix_rows": True, "mask_window": True, "fix_window": True})
)


class PlainRoute(StepRoute, LengthsRoute, CrossRoute):
    """Plain self-attention's fast route, a part of the PyTorch facts
    (:class:`mha_multi.torch._facts.TorchFacts`, whose kernel, span bucket and
    ``on_host`` it reads)."""

    kernel: spec.FusedKernel
    on_host: Any

    def __init__(self) -> None:
        # Plain self-attention's plans, by layer and shapes.
        self._plain_plans: KeptBy = KeptBy(_PLAIN_PLANS)

    def plain_attention(
        self,
        layer: call.Projections,
        queries: Any,
        cache: Any,
        *,
        causal: bool,
        dtype: torch.dtype | None,
        valid_lens: Any = None,
        options: spec.LayerOptions | None = None,
    ) -> call.Result | None:
        """Plain self-attention (:func:`mha_multi.call.plain_self_attention`) in a dozen operations.

        Taken where the generic flow would, at this call, check its arguments
        as it did for the same shapes before and run SDPA with no mask after
        one finiteness read of the projections, or (on a GPU, where a head's
        scores are too few to read for, :func:`mha_multi.spec.reads_values`)
        the generic path's attention: an eager call, no autocast, and for
        SDPA no 16-bit products. Without a cache, the queries attend to
        themselves (causal: SDPA's own flag, ``Q == K``); such a call may
        record a gradient (its operations are the generic flow's, so are
        their gradients), outside ``torch.func``'s transforms.
        With one, ``None``: a decoding step is offered at the layer's door
        instead (:meth:`~mha_multi.torch._step_route.StepRoute.plain_step`).
        The operations are the generic flow's, on the same tensors: the
        numbers are its numbers to the bit. Anything else, non-finite values
        read included, returns ``None``, and the generic flow runs the call
        (docs: "Fast paths").
        ``layer`` is a PyTorch layer: its self-attention projections are one
        product (``project_stacked``), whose one sum is the finiteness read.
        ``options``: the layer's. Rotary positions rotate the queries and
        keys together (one tensor of their heads: the rotation acts on each
        head alone) by the plan's tables, at ``arange(Q)``, the generic
        flow's default positions; the read then sums what attention takes,
        the rotated heads and the values; query/key norms act before
        (:func:`normalized`); a call's masks and bias are made once by the
        plan (:class:`PlainPlan`). ``valid_lens``: a call's lengths,
        which the route takes as a tensor, without a cache: on the host
        with the generic flow's read where the kernel may take them, and
        wherever that flow's plan is the generic path's, which reads
        nothing (a GPU's call whose scores are too few to read for), with
        their mask made at each call (:mod:`mha_multi.torch._lengths_route`).
        """
        if cache is not None:
            # A decoding step is offered at the layer's door, before its flow (plain_step):
            # one the door declined, the route declines too.
            return None
        if type(queries) is not torch.Tensor or torch.compiler.is_compiling():
            return None
        on_host = self.on_host(queries)
        records = False  # (whether the call records a gradient, where it decides the plan)
        if torch.is_grad_enabled():
            # Outside torch.func's transforms (whose values the generic flow does not read).
            if torch._C._are_functorch_transforms_active():
                return None
            # (A GPU's reads count a call's scores only where it records none,
            # spec.reads_values; the host reads whatever the count.)
            records = not on_host and layer.stacked_records_gradient(queries)
        rotary = None if options is None else options.rotary
        if valid_lens is not None and type(valid_lens) is not torch.Tensor:
            return None
        plan = self._plain_plan(
            layer,
            queries,
            None,
            causal=causal,
            dtype=dtype,
            options=options,
            records=records,
            valid_lens=valid_lens,
        )
        if plan is None:
            return None
        heads = layer.heads
        # Self-attention's three projections are one product: one pass reads them all.
        if plan.fused:
            # (A fused plan's products are neither 16-bit nor autocast's: the product
            # itself, as the layer's ``linear`` takes it.)
            projected = torch.nn.functional.linear(queries, *layer.stacked_parameters(queries))
        else:
            projected = layer.project_stacked(queries)
        if plan.norm is not None:
            projected = normalized(projected, layer, plan.norm)
        if rotary is None:
            q, k, v = split_stacked(projected, heads)
            read: tuple[torch.Tensor, ...] = (projected,)
        else:
            q, k, v, turned = rotate_stacked(
                projected, plan.tables, plan.wide_tables, rotary, heads, None
            )
            read = (turned, v)
        if plan.planned is not None:
            return self._with_lengths(layer, plan, q, k, v, valid_lens)
        try:
            if plan.fused and not self._exact(read, q, k, plan, heads.head_dim):
                return None  # (nothing made that the generic flow would not make again)
        except RuntimeError:  # (values torch.vmap batches, which no read may take)
            return None
        if plan.fused:
            # (Views, not unflatten: a Python method, and a small call's cost is such calls.)
            batch, length = q.shape[0], q.shape[1]
            kv_shape = (batch, length, heads.num_kv_heads, heads.head_dim)
            k, v = k.view(kv_shape).transpose(1, 2), v.view(kv_shape).transpose(1, 2)
            if plan.folded:  # (one query: folds_groups)
                q = q.view(batch, heads.num_kv_heads, heads.group_size, heads.head_dim)
            else:
                q = q.view(batch, length, heads.num_heads, heads.head_dim).transpose(1, 2)
            if plan.mask is None:
                context = torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, **plan.arguments
                )
            else:
                context = torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, attn_mask=plan.mask, **plan.arguments
                )
            if plan.folded:
                context = context.reshape(context.shape[0], 1, heads.query_features)
            else:
                context = context.transpose(1, 2).flatten(2)
        else:
            visible = plan.visible
            if valid_lens is not None:  # (the lengths' mask, made at each call: _lengths_plan)
                visible = self._visible_within(valid_lens, q, visible)
            context = heads_attention(
                q,
                k,
                v,
                visible,
                heads,
                softcap=plan.softcap,
                bias=plan.bias,
                sinks=layer.sink_logits() if plan.sinks else None,
            )
        return call.Result(project_output(layer, context, plan.fused), None, None)

    @staticmethod
    def _exact(
        read: tuple[torch.Tensor, ...],
        q: torch.Tensor,
        k: torch.Tensor,
        plan: PlainPlan,
        head_dim: int,
    ) -> bool:
        """The one read of a fused plan: what attention takes finite (``read``, the
        projections or the rotated heads and the values) and, where the plan hides
        keys (``bounded``), every score within the fused limit."""
        total = read[0].sum(dtype=torch.float32)
        for x in read[1:]:
            total = total + x.sum(dtype=torch.float32)
        if not plan.bounded:
            return math.isfinite(total.item())
        # (Detached: a call recording a gradient reads the sum too, and one stack takes all.)
        total, *q_k = read_together([total.detach(), *extremes(q), *extremes(k)])
        largest_q, largest_k = magnitude_of(*q_k[:2]), magnitude_of(*q_k[2:])
        return math.isfinite(total) and spec.scores_within_limit(largest_q, largest_k, head_dim)

    def _plain_plan(
        self,
        layer: call.Projections,
        queries: torch.Tensor,
        cache: spec.KVCache | None,
        *,
        causal: bool,
        dtype: torch.dtype | None,
        options: spec.LayerOptions | None = None,
        records: bool = False,
        valid_lens: torch.Tensor | None = None,
    ) -> PlainPlan | None:
        """:meth:`plain_attention`'s plan for calls of these shapes, or ``None`` where it
        takes none (``records``: a call without a cache records a gradient, and its
        plan reads only where :func:`mha_multi.spec.reads_values` says so of a
        gradient's call; ``valid_lens``: the call's lengths, unchecked, of a call
        without a cache).

        Decided once for each layer and queries, cache and flags of these
        shapes, dtypes and devices: by the generic flow's own checks (which
        raise its errors) and :func:`mha_multi.spec.plan_kernel`, for values
        read finite where the generic flow reads them
        (:func:`mha_multi.spec.reads_values`) and for values unknown where
        it does not; a step's plan is that of ``length + 1 > 1`` filled
        positions, all visible (the plan depends on no more of the lengths
        than that). A step's options are planned at the cache's last
        position (:func:`~mha_multi.torch._route_options.call_options`): their masks and
        bias there, whose positions from ``max_length - length - 1`` on are
        a step's at ``length`` (the spec's masks and ALiBi depend on the
        distance from the query alone).
        """
        device = queries.device
        # (Autocast's one flag asked first, autocasting's own first test: every call asks.)
        if torch._C._is_any_autocast_enabled() and autocasting(device.type):
            return None
        rotary = None if options is None else options.rotary
        if rotary is not None and cache is not None and rotary.depends_on_length:
            return None  # (each step's length changes every angle: no table serves them)
        # (A layer's options are fixed when it is made: others set since get plans anew.)
        plans = self._plain_plans.of(layer, made_for=options)
        # (The layer's heads and input sizes are fixed once it has been called. Inference
        # mode too: the tables and masks a plan makes under it are inference tensors, which
        # a call that records a gradient may not save for its backward.)
        key = (
            dtype,
            causal,
            queries.shape,
            queries.dtype,
            device,
            records,
            torch.is_inference_mode_enabled(),
        )
        if valid_lens is not None:
            key += (valid_lens.shape, valid_lens.dtype, valid_lens.device)
        if cache is not None:
            keys, values, lengths = cache
            key += (
                keys.shape,
                keys.dtype,
                keys.device,
                values.shape,
                values.dtype,
                values.device,
                lengths.shape,
                lengths.dtype,
                lengths.device,
            )
        plan = plans.get(key, MISSING)  # (one lookup: a plan may be None)
        if plan is not MISSING:
            return plan
        heads = layer.heads
        on_host = self.on_host(queries)
        ops = self.ops(queries)
        score_options = spec.NO_OPTIONS
        plain: PlainPlan | None = None
        if cache is None:
            lens = call.check_call(
                self, layer, queries, queries, queries, valid_lens, causal=causal, dtype=dtype
            )[3]
            batch, num_queries = queries.shape[:2]
            sizes = (batch, num_queries, num_queries)
            total_scores = None if records else batch * heads.num_heads * num_queries**2
            reads = spec.reads_values(on_host, num_queries, num_queries, total_scores=total_scores)
            if options is not None and options.touches_scores:
                score_options = call_options(options, layer, None)
        else:
            call.check_cached_call(
                self, layer, queries, queries, queries, None, cache, causal=causal, dtype=dtype
            )
            # The generic flow checks the cache against the projections before writing:
            # so does the route, once (a step's projection costs little).
            projected = layer.project_stacked(queries).dtype
            spec.check_cache_dtype(ops, cache, projected, projected)
            # The causal rule is in the lengths: one query sees every filled position.
            sizes, causal = (queries.shape[0], 1, 2), False
            # (A GPU's step whose span reads leaves the route, in plain_attention.)
            reads = on_host
            if options is not None and options.touches_scores:
                score_options = call_options(options, layer, cache.keys)
        if valid_lens is not None:
            if 0 in queries.shape[:2]:  # (an empty batch or call: the generic flow's)
                return plans.keep(key, None)
            plain = self._lengths_plan(
                layer, queries, lens, score_options, causal=causal, reads=reads
            )
        elif 0 not in queries.shape[:2]:  # (an empty batch or call: the generic flow's)
            plain = self._kernel_plan(
                layer, queries, cache, score_options, causal=causal, reads=reads, sizes=sizes
            )
        if plain is not None and cache is not None and score_options.window is not None:
            # Steps the window hides nothing from (every filled position within it) are
            # planned without it, as the generic flow plans them (call.binding_window).
            positions = (
                None if score_options.alibi_slopes is None else score_options.query_positions
            )
            within = dataclasses.replace(score_options, window=None, query_positions=positions)
            plain = plain._replace(
                window=score_options.window,
                within=self._kernel_plan(
                    layer, queries, cache, within, causal=causal, reads=reads, sizes=sizes
                ),
            )
        if plain is not None and options is not None and options.qk_norm is not None:
            plain = plain._replace(norm=options.qk_norm)
        if plain is not None and rotary is not None:
            # The generic flow's tables of the same positions (spec.rotary_tables is
            # elementwise: a table's row is that of its position alone).
            count = queries.shape[1] if cache is None else cache.keys.shape[2]
            # (A type that depends on the call's length: Q's, as the generic flow has it.)
            tables = spec.rotary_tables(
                ops, queries, ops.arange(count), rotary, heads.head_dim, length=count
            )
            plain = plain._replace(
                tables=tables, wide_tables=wide_tables(tables, rotary, heads.head_dim)
            )
        if plain is not None and plain.within is not None:
            # (What every call of the layer takes: its norms and tables.)
            plain = plain._replace(
                within=plain.within._replace(
                    norm=plain.norm, tables=plain.tables, wide_tables=plain.wide_tables
                )
            )
        return plans.keep(key, plain)

    def _kernel_plan(
        self,
        layer: call.Projections,
        queries: torch.Tensor,
        cache: spec.KVCache | None,
        score_options: spec.ScoreOptions,
        *,
        causal: bool,
        reads: bool,
        sizes: tuple[int, int, int],
    ) -> PlainPlan | None:
        """The kernel's part of :meth:`_plain_plan`'s plan for calls of these shapes and
        ``score_options`` (``sizes``: ``(B, Q, K)``, a step's ``K`` 2; ``reads``: the
        generic flow reads the values), or ``None`` where the route takes none."""
        heads = layer.heads
        ops = self.ops(queries)
        step = cache is not None
        settings = call.kernel_settings(
            self,
            queries,
            sizes=sizes,
            lens_ndim=1 if step else None,
            lens_integer=True,
            heads=heads,
            causal=causal,
            dropout=False,
            return_attention_weights=False,
            options=score_options,
        )
        optimistic = spec.plan_kernel(
            self.kernel, **settings, values_exact=True, shortest_length=2 if step else None
        )
        if reads and optimistic.fused:
            if (
                not fused_taken(optimistic)
                or queries.dtype in SIXTEEN_BIT
                or (step and self.span_bucket_of(cache.keys) != 1)
            ):
                return None
            arguments = {"is_causal": True} if optimistic.is_causal else {}
            # (SDPA called as the generic flow's fused_attention calls it, folded alike.)
            folded = folds_groups(
                heads.num_heads, heads.num_kv_heads, sizes[1], is_causal=optimistic.is_causal
            )
            if heads.grouped and not folded:
                arguments["enable_gqa"] = True
            # A step of examples at different lengths: what the generic flow plans for
            # lengths that hide keys (spec.plan_kernel's plan depends on how the sizes
            # compare: one query, more keys).
            ragged = (
                step
                and spec.plan_kernel(
                    self.kernel,
                    **{**settings, "sizes": (sizes[0], 1, 3)},
                    values_exact=True,
                    shortest_length=1,
                )
                in _RAGGED_KERNEL_PLANS
            )
            mask = kernel_mask(ops, optimistic, score_options, queries, cache)
            # Where the mask hides keys the read bounds the scores (Facts.plan_values);
            # one query seeing one key hides nothing (its one weight is 1).
            hides_keys = optimistic.is_causal or optimistic.needs_mask
            return PlainPlan(
                True,
                arguments,
                bounded=hides_keys and sizes[1] * sizes[2] > 1,
                mask=folded_mask(mask, heads.num_kv_heads, heads.group_size) if folded else mask,
                folded=folded,
                ragged=ragged,
            )
        # What call.plan decides of values it does not read (eager: no guard). (On the
        # host, a call whose options no kernel takes: it reads nothing either.)
        plan = optimistic if reads else call.unread_plan(self, queries, settings)
        if plan.fused:
            return None
        return generic_plan(
            # (A ragged step's generic path: its options of each example's position.)
            PlainPlan(False, {}, may_read=optimistic.fused, ragged=step),
            ops,
            layer,
            queries,
            score_options,
            cache,
            causal=causal,
        )

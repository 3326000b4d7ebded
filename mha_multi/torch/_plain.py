"""The PyTorch facts' fast route for plain self-attention (docs: "Fast paths").

A call whose queries are its keys and values and that asks for nothing
else (:func:`mha_multi.call.plain_self_attention`) is offered to
:meth:`PlainRoute.plain_attention` before any check: for shapes it has seen,
it runs the dozen operations the generic flow would, to its numbers, with
the checks' verdict and the kernel plan looked up, and a decoding step's
plan carried by the cache it wrote (:attr:`mha_multi.torch._cache.CacheCheck.step`).
:class:`mha_multi.torch._backend.TorchFacts` takes the route from here; this
module imports nothing of it.
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from typing import Any

import torch

from mha_multi import call, spec
from mha_multi.torch._cache import CacheCheck, written_step
from mha_multi.torch._ops import SIXTEEN_BIT
from mha_multi.torch._projections import split_stacked

__all__ = ["PlainRoute"]

#: How many shapes of a layer's calls :meth:`PlainRoute.plain_attention` keeps plans for.
_PLAIN_PLANS = 64


class PlainRoute:
    """Plain self-attention's fast route, a part of the PyTorch facts
    (:class:`mha_multi.torch._backend.TorchFacts`, whose kernel, span bucket and
    ``on_host`` it reads)."""

    kernel: spec.FusedKernel
    on_host: Any

    def __init__(self) -> None:
        # Plain self-attention's SDPA arguments, by layer and shapes.
        self._plain_plans: weakref.WeakKeyDictionary[Any, dict[tuple, dict[str, Any] | None]] = (
            weakref.WeakKeyDictionary()
        )

    def plain_attention(
        self,
        layer: call.Projections,
        queries: Any,
        cache: Any,
        *,
        causal: bool,
        dtype: torch.dtype | None,
    ) -> call.Result | None:
        """Plain self-attention (:func:`mha_multi.call.plain_self_attention`) in a dozen operations.

        Taken where the generic flow would, at this call, check its arguments
        as it did for the same shapes before, read one finiteness sum of the
        projections and run SDPA with no mask: an eager call recording no
        gradient, no 16-bit products or autocast. Without a cache, the
        queries attend to themselves (causal: SDPA's own flag, ``Q == K``).
        With one, a decoding step: one query per example, a cache whose
        check (:class:`CacheCheck`) still holds with every position below
        the lengths known finite, every example at the same length ``>= 1``
        with room for one more, and kernels that take any span (the CPU); the
        new rows are written in place at that position and SDPA attends over
        the filled ones. The operations are the generic flow's, on the same
        tensors: the numbers are its numbers to the bit, and a cache and its
        check are left as it leaves them. Anything else, non-finite values
        included, returns ``None`` before writing anything, and the generic
        flow runs the call (docs: "Fast paths"). ``layer`` is a PyTorch
        layer: its self-attention projections are one product
        (``project_stacked``), whose one sum is the finiteness read.
        """
        if torch.is_grad_enabled() or torch.compiler.is_compiling():
            return None
        if type(queries) is not torch.Tensor:
            return None
        if not self.on_host(queries) and (
            cache is not None
            or queries.dim() != 3
            or not spec.reads_values(False, queries.shape[1], queries.shape[1])
        ):
            return None  # the route's one read would wait for the GPU (a step: the CPU's only)
        step = None
        if cache is None:
            sdpa = self._plain_arguments(layer, queries, None, causal=causal, dtype=dtype)
        else:
            check = self._plain_step_check(queries, cache)
            if check is None:
                return None
            # The step before, where it was this layer's with these arguments, planned this
            # one (on the CPU: a step elsewhere has left above).
            key = (dtype, causal, queries.shape, queries.dtype)
            step = check.step
            if step is not None and step[0]() is layer and step[1] == key:
                sdpa = None if torch.is_autocast_enabled("cpu") else step[2]
            else:
                sdpa = self._plain_arguments(layer, queries, cache, causal=causal, dtype=dtype)
                step = None if sdpa is None else (weakref.ref(layer), key, sdpa)
        if sdpa is None:
            return None
        heads = layer.heads
        # Self-attention's three projections are one product: one pass reads them all.
        projected = layer.project_stacked(queries)
        if not math.isfinite(projected.sum(dtype=torch.float32).item()):  # (no gradient here)
            return None
        q, k, v = split_stacked(projected, heads)
        if cache is None:
            k, v = (x.unflatten(-1, (heads.num_kv_heads, heads.head_dim)) for x in (k, v))
            k, v, updated = k.transpose(1, 2), v.transpose(1, 2), None
        else:
            k, v, updated = written_step(cache, check, k, v, heads, step)
        context = torch.nn.functional.scaled_dot_product_attention(
            q.unflatten(-1, (heads.num_heads, heads.head_dim)).transpose(1, 2), k, v, **sdpa
        )
        output = layer.project_output(context.transpose(1, 2).flatten(2), None)
        return call.Result(output, None, updated)

    @staticmethod
    def _plain_step_check(queries: torch.Tensor, cache: Any) -> CacheCheck | None:
        """The check of a plain step's cache, whose ``uniform`` length every example
        holds, or ``None`` where the step is not plain (:meth:`plain_attention`)."""
        if type(cache) is not spec.KVCache:
            return None
        check = CacheCheck.of(cache)
        if check is None or check.pending is not None or check.poison is not None:
            return None
        length = check.uniform
        if length is None or length < 1 or check.upto != length or length >= cache.keys.shape[2]:
            return None  # (an overflow among them: the generic flow raises it)
        if cache.lengths._version != check.lengths_version:
            return None
        return check if queries.shape[:2] == (check.lengths.size, 1) else None

    def _plain_arguments(
        self,
        layer: call.Projections,
        queries: torch.Tensor,
        cache: spec.KVCache | None,
        *,
        causal: bool,
        dtype: torch.dtype | None,
    ) -> dict[str, Any] | None:
        """SDPA's arguments for :meth:`plain_attention` of these shapes, or ``None`` where it
        takes none.

        Decided once for each layer and queries, cache and flags of these
        shapes, dtypes and devices: by the generic flow's own checks (which
        raise its errors) and :func:`mha_multi.spec.plan_kernel`; a step's
        plan is that of ``length + 1 > 1`` filled positions, all visible
        (the plan depends on no more of the lengths than that).
        """
        device = queries.device
        if torch.is_autocast_enabled(device.type):
            return None
        plans = self._plain_plans.get(layer)
        if plans is None:
            plans = self._plain_plans[layer] = {}
        # (The layer's heads and input sizes are fixed once it has been called.)
        key = (dtype, causal, queries.shape, queries.dtype, device)
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
        if key in plans:
            return plans[key]
        heads = layer.heads
        if cache is None:
            call.check_call(
                self, layer, queries, queries, queries, None, causal=causal, dtype=dtype
            )
            batch, num_queries = queries.shape[:2]
            sizes, lens_ndim, shortest = (batch, num_queries, num_queries), None, None
        else:
            call.check_cached_call(
                self, layer, queries, queries, queries, None, cache, causal=causal, dtype=dtype
            )
            # The causal rule is in the lengths: one query sees every filled position.
            sizes, lens_ndim, shortest, causal = (queries.shape[0], 1, 2), 1, 2, False
        settings = call.kernel_settings(
            self,
            queries,
            sizes=sizes,
            lens_ndim=lens_ndim,
            lens_integer=True,
            heads=heads,
            causal=causal,
            dropout=False,
            return_attention_weights=False,
        )
        plan = spec.plan_kernel(
            self.kernel, **settings, values_exact=True, shortest_length=shortest
        )
        plain = (
            dataclasses.replace(plan, is_causal=False) == spec.KernelPlan(fused=True)
            and queries.dtype not in SIXTEEN_BIT
            and (cache is None or self.span_bucket_of(cache.keys) == 1)
        )
        arguments = None
        if plain:
            arguments = {"is_causal": True} if plan.is_causal else {}
            if heads.grouped:
                arguments["enable_gqa"] = True
        if len(plans) >= _PLAIN_PLANS:
            plans.clear()
        plans[key] = arguments
        return arguments

"""The PyTorch facts' route for plain cross-attention that reads nothing (docs: "Fast paths").

A call without a cache whose keys and values are its own (not both its
queries) and that asks for nothing else
(:func:`mha_multi.call.plain_cross_attention`), d2l's ``attention(X, Y, Y,
valid_lens)`` of a decoder attending to its encoder, of a layer without
options, not causal, is offered to :meth:`CrossRoute.cross_attention` before
any check. Where the generic flow's kernel plan for its signature is the
generic path's and reads nothing (on a GPU: a head's scores too few for the
read to pay, :func:`mha_multi.spec.reads_values`, or a dtype the kernel does
not serve), the first call of the signature runs the generic
flow's checks, which raise its errors, and every call of it then runs that
flow's operations and no more: the layer's projections, the generic path's
attention with the lengths' mask, the output projection. Its numbers and
gradients are the generic flow's to the bit. On the host, where the generic
flow reads the values and runs SDPA, it runs such calls at the native layer's
pace already: the route takes none of them and declines them first.
"""

from __future__ import annotations

from typing import Any

import torch

from mha_multi import call, spec
from mha_multi.spec.memo import KeptBy
from mha_multi.torch._ops import autocasting
from mha_multi.torch._steps import heads_attention

__all__ = ["CrossRoute"]

#: How many signatures of a layer's cross-attention calls the route keeps plans for.
_CROSS_PLANS = 64

#: Plans by layer, then by signature: whether the route takes the signature's calls.
_PLANS = KeptBy(_CROSS_PLANS)

#: What the plan of every call the route takes asks the kernel plan (the generic
#: flow's arguments of :func:`mha_multi.call.plan` for such a call, its heads aside).
_ARGUMENTS = {
    "causal": False,
    "dropout": False,
    "return_attention_weights": False,
    "kv_split": False,
    "options": spec.NO_OPTIONS,
}


class CrossRoute:
    """The route's part for plain cross-attention, a part of the PyTorch facts
    (:class:`mha_multi.torch._facts.TorchFacts`, whose checks, kernel facts and
    lengths' mask it takes)."""

    on_host: Any
    _visible_within: Any

    def cross_attention(
        self,
        layer: call.Projections,
        queries: Any,
        keys: Any,
        values: Any,
        *,
        causal: bool,
        dtype: torch.dtype | None,
        options: spec.LayerOptions | None,
        valid_lens: Any = None,
    ) -> call.Result | None:
        """Plain cross-attention by the generic flow's operations, or ``None`` (that flow).

        Taken by a layer without options, for a call that is not causal, of
        tensors (the lengths too, where given), eager, outside ``torch.func``'s
        transforms and autocast, whose signature's plan is the generic path's
        with nothing read (:meth:`_taken`). The arguments are those
        :meth:`mha_multi.call.Facts.cross_attention` is given: ``layer`` a
        :class:`mha_multi.torch.MultiHeadAttention`, its checked options and
        dtype; the call's inputs and lengths unchecked, its ``causal`` a bool.
        """
        if causal or not (options is None or options.is_default):
            return None
        tensor = torch.Tensor
        if type(queries) is not tensor or type(keys) is not tensor or type(values) is not tensor:
            return None
        if self.on_host(queries):
            return None  # (the generic flow reads the values and runs SDPA)
        if valid_lens is not None and type(valid_lens) is not tensor:
            return None
        if torch.compiler.is_compiling():
            return None
        records = False  # (whether the queries' projection records a gradient)
        if torch.is_grad_enabled():
            if torch._C._are_functorch_transforms_active():
                return None
            # (Every input and projection: a gradient of any may reach the queries'
            # projection, which shares a product with the keys' where they are one tensor.)
            records = (
                layer.stacked_records_gradient(queries)
                or keys.requires_grad
                or values.requires_grad
            )
        device = queries.device
        # (Autocast's one flag asked first, autocasting's own first test: every call asks.)
        if torch._C._is_any_autocast_enabled() and autocasting(device.type):
            return None
        key: tuple[Any, ...] = (dtype, records, queries.shape, queries.dtype, device)
        key += (keys.shape, keys.dtype, keys.device, values.shape, values.dtype, values.device)
        key += (keys is values, keys is queries, values is queries)
        if valid_lens is not None:
            key += (valid_lens.shape, valid_lens.dtype, valid_lens.device)
        plans = _PLANS.of(layer)
        taken = plans.get(key)
        if taken is None:
            inputs = (queries, keys, values, valid_lens)
            taken = self._taken(layer, inputs, records=records, dtype=dtype)
            if taken is None:
                return None  # (an input size not known yet: the generic flow learns it)
            plans.keep(key, taken)
        if not taken:
            return None
        q, k, v = layer.project_inputs(queries, keys, values)
        visible = (
            None if valid_lens is None else self._visible_within(valid_lens, q, None, k.shape[1])
        )
        context = heads_attention(q, k, v, visible, layer.heads)
        return call.Result(layer.project_output(context, None), None, None)

    def _taken(
        self, layer: call.Projections, inputs: tuple, *, records: bool, dtype: torch.dtype | None
    ) -> bool | None:
        """Whether the route takes the calls of a signature, after the generic flow's
        checks (which raise its errors); ``None`` while an input size is not known.
        ``inputs``: the call's queries, keys, values and lengths (or ``None``).

        Taken where the generic flow's kernel plan (:func:`mha_multi.call.plan`)
        of a call off the host is the generic path's and reads nothing: where
        the kernel serves no values of the call (:func:`mha_multi.call.decided`),
        or where :func:`mha_multi.spec.reads_values` says no read pays
        (``records``: the call may record a gradient, whose reads count a
        head's scores), for values it does not read.
        """
        queries, keys, values, valid_lens = inputs
        lengths = call.check_call(
            self, layer, queries, keys, values, valid_lens, causal=False, dtype=dtype
        )[3]
        if None in layer.input_sizes().values():
            return None
        batch, num_queries = queries.shape[:2]
        num_keys = keys.shape[1]
        if 0 in (batch, num_queries, num_keys):
            return False  # (an empty call: the generic flow's)
        heads = layer.heads
        arguments = {**_ARGUMENTS, "heads": heads}
        settings, optimistic, _ = call.decided(self, queries, keys, lengths, arguments)
        if not optimistic.fused:
            return True
        total_scores = None if records else batch * heads.num_heads * num_queries * num_keys
        if spec.reads_values(False, num_queries, num_keys, total_scores=total_scores):
            return False  # (a long call: the generic flow reads it)
        return not call.unread_plan(self, queries, settings).fused

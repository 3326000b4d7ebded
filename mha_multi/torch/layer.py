"""``MultiHeadAttention`` as a ``torch.nn.Module``."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from mha_multi import spec
from mha_multi.heads import importance
from mha_multi.torch._backend import head_mask_gradient, host_array
from mha_multi.torch._ops import (
    OPS,
    SIXTEEN_BIT,
    accumulates_in_float32,
    autocast_off,
    dtype_kind,
    ops_on,
)
from mha_multi.weights import KERNEL_NAMES, check_weights

if TYPE_CHECKING:
    from mha_multi.torch.sharding import HeadSharding

__all__ = ["MultiHeadAttention", "get_weights", "head_importance", "set_weights"]


def _projection(in_features: int | None, out_features: int, bias: bool) -> nn.Module:
    if in_features is None:
        return nn.LazyLinear(out_features, bias=bias)
    return nn.Linear(in_features, out_features, bias=bias)


def _in_features(linear: nn.Module) -> int | None:
    if isinstance(linear.weight, nn.parameter.UninitializedParameter):
        return None
    return int(linear.weight.shape[1])


def _finish_lazy(linear: nn.Module) -> None:
    """Turns a lazy projection whose weight was loaded into a plain ``nn.Linear``.

    Loading materialises the parameters but leaves the lazy class and its
    hooks until the first call; a call on an empty batch finishes the job
    now, so later calls (and ``torch.compile``) see an ordinary module.
    """
    if isinstance(linear, nn.modules.lazy.LazyModuleMixin):
        linear.in_features = int(linear.weight.shape[1])
        weight = linear.weight
        linear(torch.zeros(0, linear.in_features, device=weight.device, dtype=weight.dtype))


def _product_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype ``x @ weight.T`` is computed in: autocast's for float32 operands."""
    dtype = torch.promote_types(x.dtype, weight.dtype)
    if dtype == torch.float32 and torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return dtype


def _project_with(linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``linear(x)``, with a 16-bit product accumulated in float32 and rounded once.

    Products that are not 16-bit, or whose device kernels accumulate in
    float32 by construction, call the module itself (its hooks run); the
    others run on float32 copies.
    """
    if not _needs_float32_copies(x, linear.weight):
        return linear(x)
    if _in_features(linear) is None:
        linear(x[:0])  # a lazy projection learns its size; nothing is computed
    return _linear(x, linear.weight, linear.bias)


def _needs_float32_copies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return _product_dtype(x, weight) in SIXTEEN_BIT and not accumulates_in_float32(x.device)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` whose 16-bit products accumulate in float32 and round once."""
    if not _needs_float32_copies(x, weight):
        return nn.functional.linear(x, weight, bias)
    dtype = _product_dtype(x, weight)
    # Rounding to ``dtype`` first is what autocast does to float32 operands.
    x, weight = (t.to(dtype).float() for t in (x, weight))
    bias = None if bias is None else bias.to(dtype).float()
    with autocast_off(x.device):
        return nn.functional.linear(x, weight, bias).to(dtype)


class MultiHeadAttention(nn.Module):
    """d2l's multi-head attention, exact to the spec of :mod:`mha_multi.spec`.

    The projections are ``nn.Linear`` modules named ``W_q``, ``W_k``, ``W_v``
    and ``W_o`` as in d2l, so a d2l ``state_dict`` loads as it is. Input sizes
    left as ``None`` are inferred on the first call (``nn.LazyLinear``).

    Grouped-query attention (docs: "The spec", grouped heads): with
    ``num_kv_heads < num_heads`` query head ``h`` reads key/value head
    ``h // (num_heads // num_kv_heads)``; ``W_k`` and ``W_v`` project to
    ``num_kv_heads * head_dim`` features, ``W_q`` to ``num_heads * head_dim``.

    Args:
        num_hiddens: size of the output (and, by default, of every projection).
        num_heads: number of (query) heads ``H``; must divide ``num_hiddens``
            unless ``head_dim`` is given.
        dropout: dropout rate on the attention weights, active in ``train()``
            mode only.
        bias: whether the four projections have biases.
        query_size: last dimension of the queries (lazy when ``None``).
        key_size: last dimension of the keys (lazy when ``None``).
        value_size: last dimension of the values (lazy when ``None``).
        num_kv_heads: number of key/value heads; must divide ``num_heads``
            (``None``: ``num_heads``).
        head_dim: size of each head (``None``: ``num_hiddens // num_heads``).
        device: where to create the parameters.
        dtype: dtype of the parameters.
    """

    #: How the heads are split over processes; ``None`` until
    #: :func:`mha_multi.torch.shard_heads` (docs: "Sharding heads").
    _sharding: HeadSharding | None = None

    def __init__(
        self,
        num_hiddens: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = False,
        *,
        query_size: int | None = None,
        key_size: int | None = None,
        value_size: int | None = None,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        heads = {"num_kv_heads": num_kv_heads, "head_dim": head_dim}
        spec.check_config(num_hiddens, num_heads, dropout, **heads)
        spec.check_input_sizes(query_size=query_size, key_size=key_size, value_size=value_size)
        super().__init__()
        self._heads = spec.check_heads(num_hiddens, num_heads, **heads)
        self.num_hiddens = int(num_hiddens)
        self.num_heads = self._heads.num_heads
        self.num_kv_heads = self._heads.num_kv_heads
        self.head_dim = self._heads.head_dim
        self.bias = bool(bias)
        query_features, kv_features = self._heads.query_features, self._heads.kv_features
        self.W_q = _projection(query_size, query_features, bias)
        self.W_k = _projection(key_size, kv_features, bias)
        self.W_v = _projection(value_size, kv_features, bias)
        self.W_o = nn.Linear(query_features, num_hiddens, bias=bias)
        self.dropout = nn.Dropout(dropout)
        if device is not None or dtype is not None:
            self.to(device=device, dtype=dtype)

    def extra_repr(self) -> str:
        sharded = (
            "" if self._sharding is None else f", heads sharded {self._sharding.num_shards} ways"
        )
        return (
            f"num_hiddens={self.num_hiddens}, num_heads={self.num_heads}, "
            f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, bias={self.bias}"
            f"{sharded}"
        )

    def _canonical_heads(self) -> spec.Heads:
        """The whole layer's heads, which the canonical weights and ``head_mask`` have."""
        return self._heads if self._sharding is None else self._sharding.heads

    def input_sizes(self) -> dict[str, int | None]:
        """``query_size``, ``key_size``, ``value_size``; ``None`` where still lazy."""
        return {
            "query_size": _in_features(self.W_q),
            "key_size": _in_features(self.W_k),
            "value_size": _in_features(self.W_v),
        }

    def init_cache(
        self, batch_size: int, max_length: int, dtype: torch.dtype | None = None
    ) -> spec.KVCache:
        """An empty key/value cache for incremental decoding (docs: "Generating with a cache").

        Args:
            batch_size: ``B``, the examples decoded together.
            max_length: the positions each example can hold.
            dtype: the dtype of the cached keys and values; ``None`` for the
                layer's parameter dtype (pass autocast's dtype when decoding
                under ``torch.autocast``).

        Returns:
            A :class:`~mha_multi.spec.KVCache` on the parameters' device:
            zero ``keys`` and ``values`` ``(B, num_kv_heads, max_length,
            head_dim)`` and int32 ``lengths`` ``(B,)`` all 0.

        Raises:
            TypeError: ``batch_size`` or ``max_length`` is not an int, or
                ``dtype`` is not a floating-point ``torch.dtype``.
            ValueError: ``batch_size`` or ``max_length`` is negative.
        """
        shape = spec.cache_shape(batch_size, max_length, self._heads)
        parameter = self.W_o.weight
        dtype = parameter.dtype if dtype is None else dtype
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating-point torch.dtype or None; got {dtype!r}")
        keys, values = (torch.zeros(shape, dtype=dtype, device=parameter.device) for _ in "kv")
        lengths = torch.zeros(shape[0], dtype=torch.int32, device=parameter.device)
        return spec.KVCache(keys, values, lengths)

    def forward(
        self,
        queries: torch.Tensor,
        keys: torch.Tensor | None,
        values: torch.Tensor | None,
        valid_lens: torch.Tensor | None = None,
        *,
        causal: bool = False,
        return_attention_weights: bool = False,
        cache: spec.KVCache | None = None,
        head_mask: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Attends from ``queries`` to ``keys``/``values``, or to a cache.

        Args:
            queries: ``(B, Q, query_size)``.
            keys: ``(B, K, key_size)``. With a ``cache``: the ``T = Q`` new
                positions ``(B, T, key_size)``, or ``None`` to append nothing.
            values: ``(B, K, value_size)``; with a ``cache`` like ``keys``.
            valid_lens: ``None``, ``(B,)`` or ``(B, Q)``, integer or floating;
                key ``j`` is visible to query ``i`` iff ``j < valid_lens``.
                May live on the CPU or on the inputs' device. With a
                ``cache``: ``None`` or ``(B,)`` integers, the real new
                positions of each example (``T`` by default; the rest is
                padding and is not kept).
            causal: also hide key ``j`` from query ``i`` when
                ``j > i + (K - Q)``. With a ``cache``, query ``i`` of example
                ``b`` sits at position ``cache.lengths[b] + i`` and sees the
                keys up to it.
            return_attention_weights: also return the pre-dropout weights.
            cache: a :class:`~mha_multi.spec.KVCache` from :meth:`init_cache`
                (or from the previous cached call). The new keys and values
                are projected and written at positions ``lengths[b] ..
                lengths[b] + valid_lens[b] - 1`` of example ``b``, and the
                queries attend to every position the cache then holds. The
                update is functional: the cache passed in is not modified,
                and the returned one is differentiable with respect to the
                new keys, values and the projections' weights.
            head_mask: ``None``, or the heads' gates ``(num_heads,)`` or
                ``(B, num_heads)``, a floating-point tensor on the CPU or on
                the inputs' device (docs: "Heads"): head ``h``'s context
                (its slice of ``weights @ v``, before ``W_o``) is multiplied
                by ``head_mask[..., h]``, on every path (fused, generic,
                cached, compiled). It is cast to the context's dtype (a
                float32 mask gates a bfloat16 layer) and is differentiable:
                its gradient measures each head's importance
                (:func:`head_importance`). A gate of 0 removes the head, as
                pruning it (:func:`mha_multi.heads.prune_heads`) does.

        Returns:
            ``(B, Q, num_hiddens)``; with ``return_attention_weights`` the
            tuple ``(output, weights)`` with weights ``(B, H, Q, K)``. With a
            ``cache``, the updated cache is appended: ``(output, cache)`` or
            ``(output, weights, cache)`` with weights ``(B, H, T,
            max_length)``, zero where hidden.

        Raises:
            TypeError: an input is not a floating-point tensor of the
                parameters' dtype, ``valid_lens`` is not numeric (or, with a
                cache, not integer), ``causal`` is not a bool, the cache is
                not a ``KVCache`` of tensors of the layer's dtype, or
                ``head_mask`` is not a floating-point tensor.
            ValueError: shapes that do not fit together, the layer or the
                cache, ``head_mask``'s included; in eager mode, a cache that
                would overflow ``max_length``. Compiled code
                (``torch.compile``) reads no values: it drops the positions
                past ``max_length`` instead, overwrites no position a cache
                holds, and lets ``lengths`` count on, so ``lengths >
                max_length`` tells it happened.
        """
        self._check_tensors(queries=queries, keys=keys, values=values, cached=cache is not None)
        if self._sharding is not None:
            self._sharding.check_inputs(queries, self)
        valid_lens = _as_lens(valid_lens, queries.device)
        if cache is not None:
            cached = (causal, return_attention_weights, cache, head_mask)
            return self._cached_forward(queries, keys, values, valid_lens, *cached)
        spec.check_inputs(
            queries.shape,
            keys.shape,
            values.shape,
            None if valid_lens is None else valid_lens.shape,
            **self.input_sizes(),
            causal=causal,
        )
        head_mask = self._as_head_mask(head_mask, queries)
        q, k, v = self._project(queries, keys, values)
        context, weights = self._attend(
            q, k, v, valid_lens, causal=causal, return_attention_weights=return_attention_weights
        )
        # The gates need no device of their own: the adapter places nothing here.
        context = spec.apply_head_mask(OPS, context, head_mask, self.num_heads)
        output = _project_with(self.W_o, context)
        return (output, weights) if return_attention_weights else output

    def _as_head_mask(self, head_mask: Any, queries: torch.Tensor) -> torch.Tensor | None:
        """``head_mask`` checked (the spec's rule) and on the queries' device.

        Its dtype is left as it is: :func:`mha_multi.spec.apply_head_mask`
        casts it to the context's, so gradients flow back in its own.
        """
        if head_mask is None:
            return None
        if not isinstance(head_mask, torch.Tensor):
            raise TypeError(
                f"head_mask must be a floating-point torch.Tensor of shape (num_heads,) or "
                f"(batch, num_heads); got {type(head_mask).__name__}"
            )
        spec.check_head_mask(
            tuple(head_mask.shape),
            dtype_kind(head_mask.dtype),
            num_heads=self._canonical_heads().num_heads,
            batch=queries.shape[0],
        )
        head_mask = head_mask.to(queries.device)
        # A sharded layer gates its own heads (docs: "Sharding heads").
        return head_mask if self._sharding is None else self._sharding.local_head_mask(head_mask)

    def _check_tensors(self, *, cached: bool, **tensors: torch.Tensor | None) -> None:
        """Inputs are floating-point tensors of the parameters' dtype (or autocast's).

        A cached call may leave keys and values out (``None``); whether it
        left out both is :func:`mha_multi.spec.check_cached_inputs`'s to say.
        """
        parameter_dtype = self.W_o.weight.dtype
        for name, tensor in tensors.items():
            if tensor is None and cached and name != "queries":
                continue
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor; got {type(tensor).__name__}")
            if not tensor.is_floating_point():
                raise TypeError(f"{name} must be a floating-point tensor; got {tensor.dtype}")
            if tensor.dtype != parameter_dtype and not torch.is_autocast_enabled(
                tensor.device.type
            ):
                raise TypeError(
                    f"{name} dtype {tensor.dtype} differs from the layer's parameter dtype "
                    f"{parameter_dtype}; convert one of them (e.g. layer.to({tensor.dtype}))"
                )

    def _cached_forward(
        self,
        queries: torch.Tensor,
        keys: torch.Tensor | None,
        values: torch.Tensor | None,
        valid_lens: torch.Tensor | None,
        causal: bool,
        return_attention_weights: bool,
        cache: Any,
        head_mask: Any,
    ) -> tuple[torch.Tensor, ...]:
        """:meth:`forward` with a cache: checks, projections, the spec's update, one attend."""
        cache = _as_cache(cache, queries.device)
        spec.check_cached_call(
            queries,
            keys,
            values,
            valid_lens,
            cache,
            heads=self._heads,
            dtype_kind=dtype_kind,
            causal=causal,
            **self.input_sizes(),
        )
        head_mask = self._as_head_mask(head_mask, queries)
        num_new = 0 if keys is None else queries.shape[1]
        if not torch.compiler.is_compiling():
            # One read of the lengths. Compiled graphs cannot branch on values;
            # update_cache never overwrites a held position for them.
            lengths = cache.lengths.long()
            read = torch.stack([lengths, lengths if valid_lens is None else valid_lens]).cpu()
            new = None if valid_lens is None else read[1].numpy()
            spec.check_cache_values(read[0].numpy(), new, num_new, cache.keys.shape[2])
        if keys is None:
            q, k, v = _project_with(self.W_q, queries), None, None
        else:
            q, k, v = self._project(queries, keys, values)
        for name in ("keys", "values"):  # update_cache checks only what it writes to
            held = getattr(cache, name)
            if held.dtype != q.dtype:
                raise TypeError(
                    f"cache.{name} dtype {held.dtype} differs from the layer's projected dtype "
                    f"{q.dtype}; make the cache with layer.init_cache"
                )
        cache, lens = spec.update_cache(
            ops_on(q.device), cache, k, v, valid_lens, head_dim=self.head_dim, causal=causal
        )
        context, weights = self._attend(
            q,
            cache.keys,
            cache.values,
            lens,
            causal=False,  # the causal rule is in lens
            return_attention_weights=return_attention_weights,
            kv_split=True,
        )
        context = spec.apply_head_mask(OPS, context, head_mask, self.num_heads)
        output = _project_with(self.W_o, context)
        return (output, weights, cache) if return_attention_weights else (output, cache)

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        valid_lens: torch.Tensor | None,
        *,
        causal: bool,
        return_attention_weights: bool,
        kv_split: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attention on projected inputs through the one kernel plan.

        Args:
            q: projected queries ``(B, Q, num_heads * head_dim)``.
            k: projected keys ``(B, K, num_kv_heads * head_dim)``, or split
                into heads ``(B, num_kv_heads, K, head_dim)`` with ``kv_split``
                (a cache's layout).
            v: projected values, as ``k``.
            valid_lens: the lengths, as :func:`_as_lens` returned them.
            causal: the spec's causal flag.
            return_attention_weights: the weights are wanted (generic path).
            kv_split: ``k`` and ``v`` are split into heads.

        Returns:
            ``(context, weights)``: the concatenated heads ``(B, Q, num_heads
            * head_dim)`` and the weights ``(B, H, Q, K)``, ``None`` where
            the fused kernel ran.
        """
        dropout_p = self.dropout.p if self.training else 0.0
        plan = _plan(
            q, k, v, valid_lens, causal, dropout_p, return_attention_weights, self._heads.grouped
        )
        if plan.fused:
            return self._fused_attention(q, k, v, valid_lens, plan, dropout_p, kv_split), None
        return spec.attention(
            ops_on(q.device),
            q,
            k,
            v,
            valid_lens,
            num_heads=self.num_heads,
            head_dim=self.head_dim,
            num_kv_heads=self.num_kv_heads,
            causal=causal,
            dropout=self.dropout if dropout_p > 0 else None,
            kv_split=kv_split,
        )

    def _project(
        self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The three input projections; one GEMM for inputs that are one tensor.

        Self-attention (``queries is keys is values``) and shared keys/values
        project with the weights stacked, as ``nn.MultiheadAttention`` does:
        every output element is the same dot product, and the backward pass
        gets one input gradient instead of a sum of three.
        """
        projections = [self.W_q, self.W_k, self.W_v]
        inputs = [queries, keys, values]
        first = 0 if queries is keys else 1
        shared = [i for i in range(first, 3) if inputs[i] is inputs[first]]
        # Sharded projections run as their modules: their hooks distribute
        # the inputs and outputs (docs: "Sharding heads").
        separate = self._sharding is not None or len(shared) < 2
        if separate or any(_in_features(projections[i]) is None for i in shared):
            return tuple(  # (lazy ones infer)
                _project_with(linear, x) for linear, x in zip(projections, inputs, strict=True)
            )
        weight = torch.cat([projections[i].weight for i in shared])
        bias = torch.cat([projections[i].bias for i in shared]) if self.bias else None
        # Grouped heads project queries wider than keys and values.
        widths = [projections[i].out_features for i in shared]
        packed = _linear(inputs[first], weight, bias).split(widths, dim=-1)
        outputs = dict(zip(shared, packed, strict=True))
        q, k, v = (
            outputs[i] if i in outputs else _project_with(projections[i], inputs[i])
            for i in range(3)
        )
        return q, k, v

    def _fused_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        valid_lens: torch.Tensor | None,
        plan: spec.KernelPlan,
        dropout_p: float,
        kv_split: bool = False,
    ) -> torch.Tensor:
        """``scaled_dot_product_attention`` with the spec's masking semantics.

        Grouped key/value heads reach SDPA as they are, with ``enable_gqa``
        (query head ``h`` reads key/value head ``h // G``, the spec's rule);
        only a PyTorch whose SDPA has no ``enable_gqa`` gets them repeated,
        once, on the projected heads (the plan's ``repeat_kv``).

        Args:
            q: projected queries ``(B, Q, num_heads * head_dim)``.
            k: projected keys ``(B, K, num_kv_heads * head_dim)``, or with
                ``kv_split`` ``(B, num_kv_heads, K, head_dim)``, SDPA's own
                layout (a cache's).
            v: projected values, as ``k``.
            valid_lens: the lengths, as :func:`_as_lens` returned them.
            plan: what :func:`_plan` decided the kernel is given.
            dropout_p: dropout rate on the weights (0 in eval mode).
            kv_split: ``k`` and ``v`` are split into heads.

        Returns:
            The concatenated heads ``(B, Q, num_heads * head_dim)``.
        """
        num_queries, num_keys = q.shape[1], k.shape[-2]
        ops = ops_on(q.device)
        dtype = v.dtype
        if dtype in SIXTEEN_BIT and not accumulates_in_float32(q.device):
            # CPU kernels may sum 16-bit products in 16 bits: float32 copies,
            # one rounding at the end.
            q, k, v = q.float(), k.float(), v.float()
        # (B, T, H*dh) -> (B, H, T, dh): the spec's head layout, unflattened.
        q = q.unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2)
        if not kv_split:
            k, v = (
                x.unflatten(-1, (self.num_kv_heads, self.head_dim)).transpose(1, 2) for x in (k, v)
            )
        group_size = self._heads.group_size
        if plan.repeat_kv:
            k, v = (x.repeat_interleave(group_size, dim=1) for x in (k, v))
        grouped = self._heads.grouped and not plan.repeat_kv
        mask = plan.mask(ops, num_queries, num_keys, valid_lens)
        with autocast_off(q.device):
            output = nn.functional.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=mask,
                dropout_p=dropout_p,
                is_causal=plan.is_causal,
                # Passed only where needed: PyTorch before 2.5 has no such argument.
                **({"enable_gqa": True} if grouped else {}),
            )
        visible = plan.fix_visibility(ops, num_queries, num_keys, valid_lens)
        output = spec.fix_fully_hidden_rows(
            ops, output, v, visible, heads_axis=1, group_size=group_size if grouped else 1
        )
        return output.transpose(1, 2).flatten(2).to(dtype)


#: PyTorch's fused kernel: it applies dropout itself and adds ``-inf`` where
#: keys are hidden, so it runs only on values read as finite. Its
#: ``enable_gqa`` (PyTorch 2.5 and later) takes grouped key/value heads.
SDPA = spec.FusedKernel(
    "scaled_dot_product_attention",
    takes_dropout=True,
    takes_grouped_heads=tuple(int(n) for n in re.findall(r"\d+", str(torch.__version__))[:2])
    >= (2, 5),
)


def _plan(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    valid_lens: torch.Tensor | None,
    causal: bool,
    dropout_p: float,
    return_attention_weights: bool,
    grouped: bool,
) -> spec.KernelPlan:
    """The kernel plan of a call: SDPA only where it gives the spec's numbers.

    What :func:`mha_multi.spec.plan_kernel` needs from the values is read
    here, with one synchronisation: whether every projection is finite
    (SDPA's CPU kernel turns a NaN query row into zeros, and its added
    ``-inf`` mask lets a hidden key's non-finite score reach the weights;
    the check is O(N * d), next to O(N^2 * d) attention) and the shortest
    length (lengths that hide nothing need no mask, which lets flash kernels
    run; lengths > 0 leave no row fully hidden). Under ``torch.compile``
    values cannot be branched on, so the compiled graph runs the generic
    path, which is exact for any values (and whose masking and softmax the
    compiler fuses).
    """
    sizes = (q.shape[0], q.shape[1], k.shape[-2])  # keys (B, K, ·) or split (B, H_kv, K, dh)
    facts = {
        "sizes": sizes,
        "lens_ndim": None if valid_lens is None else valid_lens.dim(),
        "lens_integer": valid_lens is None or not valid_lens.is_floating_point(),
        "causal": causal,
        "dropout": dropout_p > 0,
        "return_attention_weights": return_attention_weights,
        "grouped": grouped,
    }
    if torch.compiler.is_compiling():
        return spec.plan_kernel(SDPA, **facts, values_exact=None)
    # Values are read only where they can still change the decision.
    optimistic = spec.plan_kernel(SDPA, **facts, values_exact=True)
    if not optimistic.fused:
        return optimistic
    # A cache's free positions count too: SDPA adds -inf to a hidden key's score.
    # x * 0 is 0 where x is finite and NaN elsewhere: one pass over a cache at
    # every decoding step, where isfinite(x).all() takes several.
    finite = torch.stack([(x.detach() * 0).sum() for x in (q, k, v)]).sum() == 0
    if valid_lens is None:
        return spec.plan_kernel(SDPA, **facts, values_exact=bool(finite.item()))
    # float64 keeps the order of every length (int64 ones round monotonically).
    read = torch.stack([finite.double(), valid_lens.min().double()]).tolist()
    return spec.plan_kernel(SDPA, **facts, values_exact=bool(read[0]), shortest_length=read[1])


def _as_cache(cache: Any, device: torch.device) -> spec.KVCache:
    """``cache`` as a :class:`~mha_multi.spec.KVCache` of tensors on ``device``, checked.

    Raises:
        TypeError: not three tensors (keys, values, lengths).
        ValueError: a tensor on another device.
    """
    if not isinstance(cache, tuple) or len(cache) != 3:
        raise TypeError(
            f"cache must be a KVCache(keys, values, lengths), as layer.init_cache makes; "
            f"got {type(cache).__name__}"
        )
    cache = spec.KVCache(*cache)
    for name, tensor in zip(cache._fields, cache, strict=True):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"cache.{name} must be a torch.Tensor; got {type(tensor).__name__}")
        if tensor.device != device:
            raise ValueError(
                f"cache.{name} is on {tensor.device}, the queries on {device}; "
                "make the cache with layer.init_cache"
            )
    return cache


def _as_lens(valid_lens: Any, device: torch.device) -> torch.Tensor | None:
    """``valid_lens`` as a tensor on ``device``; integer lengths as int64.

    int64 holds every key count, so clipping wider (uint64) lengths into it
    keeps their meaning (``>= K`` hides nothing), and narrower ones widened
    never wrap the key positions they are compared with.
    """
    if valid_lens is None:
        return None
    if isinstance(valid_lens, torch.Tensor):
        spec.check_valid_lens_dtype(dtype_kind(valid_lens.dtype))
        if valid_lens.is_floating_point():
            return valid_lens.to(device)
        lens = valid_lens.to(device, torch.int64)
        if valid_lens.dtype == torch.uint64:
            # The conversion wraps lengths >= 2**63 to negative numbers, which
            # no unsigned length is: they are the ones to clip.
            lens = torch.where(lens < 0, torch.iinfo(torch.int64).max, lens)
        return lens
    array = spec.lens_as_numpy(valid_lens, np.int64)
    return torch.from_numpy(np.array(array, copy=True)).to(device)


def set_weights(layer: MultiHeadAttention, weights: Mapping[str, Any]) -> MultiHeadAttention:
    """Loads canonical weights into ``layer`` (strict) and returns it.

    Lazy input sizes are fixed by the weights. Values are copied into the
    existing parameters, keeping their device and dtype.

    A head-sharded layer (:func:`mha_multi.torch.shard_heads`) takes the
    whole layer's weights too; it is a collective, to be called on every
    process, and process 0's weights are the ones distributed.

    Raises:
        ValueError: a missing, extra or mis-shaped entry, named.
    """
    arrays, _ = check_weights(
        weights,
        num_hiddens=layer.num_hiddens,
        bias=layer.bias,
        # num_heads, num_kv_heads, head_dim
        **dataclasses.asdict(layer._canonical_heads()),
        **layer.input_sizes(),
    )
    state = {}
    for name, array in arrays.items():
        tensor = torch.from_numpy(np.array(array, copy=True))
        if name in KERNEL_NAMES:
            state[f"{name}.weight"] = tensor.T.contiguous()
        else:
            state[f"W_{name[-1]}.bias"] = tensor
    if layer._sharding is not None:
        state = {
            key: layer._sharding.distribute_like(layer.get_parameter(key), tensor)
            for key, tensor in state.items()
        }
    with torch.no_grad():
        layer.load_state_dict(state, strict=True)
        for name in KERNEL_NAMES:
            _finish_lazy(getattr(layer, name))
    return layer


def get_weights(layer: MultiHeadAttention) -> dict[str, np.ndarray]:
    """The canonical weights of ``layer`` as numpy arrays.

    bfloat16 parameters are returned as float32 (numpy has no bfloat16);
    every other dtype is kept. A head-sharded layer
    (:func:`mha_multi.torch.shard_heads`) returns the whole layer's weights,
    gathered: a collective, to be called on every process.

    Raises:
        ValueError: some input size is still lazy (call the layer once, or
            pass ``query_size``/``key_size``/``value_size``).
    """
    lazy = [name for name, size in layer.input_sizes().items() if size is None]
    if lazy:
        raise ValueError(
            f"{', '.join(lazy)} not known yet: call the layer once or pass them to the constructor"
        )
    # Sharded parameters are gathered whole (docs: "Sharding heads").
    whole = (lambda t: t) if layer._sharding is None else layer._sharding.full_tensor
    weights = {}
    for name in KERNEL_NAMES:
        linear = getattr(layer, name)
        weights[name] = host_array(whole(linear.weight).T)
        if layer.bias:
            weights[f"b_{name[-1]}"] = host_array(whole(linear.bias))
    return weights


def head_importance(
    layer: MultiHeadAttention,
    batches: Iterable[tuple[Any, Any, Any, Any]],
    loss_fn: Callable[[torch.Tensor], torch.Tensor],
    *,
    normalize: bool = True,
) -> np.ndarray:
    """How much the loss depends on each head (docs: "Heads").

    Michel, Levy & Neubig (2019): ``I_h = mean over batches of |dL/dξ_h|``
    at ``ξ = 1``, where ``ξ`` is the ``head_mask`` (one gate per head), then
    divided by its L2 norm over the heads when ``normalize`` (gradients all
    zero stay zero). Computed in ``eval()`` mode (no dropout); the layer's
    mode is restored afterwards, and its parameters' ``.grad`` are left as
    they are. Heads of low importance are the ones to prune
    (:func:`mha_multi.heads.prune_heads`).

    Args:
        layer: the layer.
        batches: an iterable of ``(queries, keys, values, valid_lens)``
            tensors (``valid_lens`` may be ``None``), as the layer takes them.
        loss_fn: ``loss_fn(output) -> scalar tensor``, differentiable.
        normalize: divide by the L2 norm over the heads.

    Returns:
        float64 numpy ``(num_heads,)``.

    Raises:
        ValueError: ``batches`` yields nothing, or ``loss_fn`` returns more
            than one number.
        TypeError: ``loss_fn`` returns no tensor.
    """
    training = layer.training
    layer.eval()
    try:
        gradients = [
            host_array(head_mask_gradient(layer, queries, keys, values, valid_lens, loss_fn))
            for queries, keys, values, valid_lens in batches
        ]
    finally:
        layer.train(training)
    if not gradients:
        raise ValueError("batches yielded no batch: head importance needs at least one")
    return importance(gradients, normalize=normalize)

"""``MultiHeadAttention`` as a ``torch.nn.Module``: parameters, and one call of the driver.

The call flow (checks, kernel plan, cache, attention, gates, output) is
:func:`mha_multi.call.forward`'s; PyTorch's facts are
:data:`mha_multi.torch._facts.FACTS`, and the projections the driver
calls are :class:`mha_multi.torch._projections.PackedProjections`'
(docs: "Architecture").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn.parameter import UninitializedParameter

from mha_multi import _docs, call, spec
from mha_multi.canonical_layer import FromCanonical
from mha_multi.torch._cache import versioned
from mha_multi.torch._facts import FACTS, host_array
from mha_multi.torch._ops import dtype_kind
from mha_multi.torch._projections import (
    PackedProjections,
    StackedWeights,
    finish_lazy,
    parametrized_projection,
    projection,
)
from mha_multi.weights import KERNEL_NAMES, NORM_NAMES, SINKS_NAME, check_layer_weights

__all__ = ["MultiHeadAttention", "get_weights", "set_weights"]


@_docs.fill
class MultiHeadAttention(FromCanonical, PackedProjections):
    """d2l's multi-head attention, exact to the spec of :mod:`mha_multi.spec`.

    The projections are ``nn.Linear`` modules named ``W_q``, ``W_k``, ``W_v``
    and ``W_o`` as in d2l, so a d2l ``state_dict`` loads as it is. Input sizes
    left as ``None`` are inferred on the first call (``nn.LazyLinear``).

    {grouped_heads}

    Args:
        num_hiddens: size of the output (and, by default, of every projection).
        {num_heads_arg}
        dropout: dropout rate on the attention weights, active in ``train()``
            mode only.
        bias: whether the four projections have biases.
        query_size: last dimension of the queries (lazy when ``None``).
        key_size: last dimension of the keys (lazy when ``None``).
        value_size: last dimension of the values (lazy when ``None``).
        {kv_heads_args}
        {options_args}
        device: where to create the parameters.
        dtype: dtype of the parameters.
    """

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
        rotary: spec.Rotary | Mapping[str, Any] | None = None,
        alibi: bool = False,
        window: int | None = None,
        softcap: float | None = None,
        qk_norm: spec.QKNorm | Mapping[str, Any] | None = None,
        sinks: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        heads = {"num_kv_heads": num_kv_heads, "head_dim": head_dim}
        spec.check_config(num_hiddens, num_heads, dropout, **heads)
        spec.check_input_sizes(query_size=query_size, key_size=key_size, value_size=value_size)
        super().__init__()
        self._heads = spec.check_heads(num_hiddens, num_heads, **heads)
        options = spec.LayerOptions(rotary, alibi, window, softcap, sinks, qk_norm=qk_norm)
        options = options.check(self._heads.head_dim)
        self.num_hiddens = int(num_hiddens)
        self.num_heads = self._heads.num_heads
        self.num_kv_heads = self._heads.num_kv_heads
        self.head_dim = self._heads.head_dim
        self.bias = spec.check_flag("bias", bias)
        #: The positions and biases options (docs: "Positions and biases").
        self.options = options
        query_features, kv_features = self._heads.query_features, self._heads.kv_features
        self.W_q = projection(query_size, query_features, bias)
        self.W_k = projection(key_size, kv_features, bias)
        self.W_v = projection(value_size, kv_features, bias)
        self.W_o = nn.Linear(query_features, num_hiddens, bias=bias)
        if options.qk_norm is not None:
            for name, shape in options.qk_norm.shapes(self._heads).items():
                initial = torch.full(shape, options.qk_norm.initial_value)
                self.register_parameter(name, nn.Parameter(initial))
        self.dropout = nn.Dropout(dropout)
        if options.sinks:
            self.sinks = nn.Parameter(torch.zeros(self.num_heads))
        self._stacks = StackedWeights()
        self._pack()
        if device is not None or dtype is not None:
            self.to(device=device, dtype=dtype)

    def extra_repr(self) -> str:
        sharded = (
            "" if self._sharding is None else f", heads sharded {self._sharding.num_shards} ways"
        )
        return (
            f"num_hiddens={self.num_hiddens}, num_heads={self.num_heads}, "
            f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, bias={self.bias}"
            f"{_options_repr(self.options)}{sharded}"
        )

    def _canonical_heads(self) -> spec.Heads:
        """The whole layer's heads, which the canonical weights and ``head_mask`` have."""
        return self._heads if self._sharding is None else self._sharding.heads

    def qk_norm_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(q_norm, k_norm)``: the query/key norms' parameters (``qk_norm`` set)."""
        parameters = self._parameters
        q_norm, k_norm = parameters["q_norm"], parameters["k_norm"]
        if self._sharding is not None:
            return self._sharding.replicated(q_norm), self._sharding.replicated(k_norm)
        return q_norm, k_norm

    def input_sizes(self) -> dict[str, int | None]:
        """``query_size``, ``key_size``, ``value_size``; ``None`` where still lazy."""
        modules = self._modules
        # (in_features of each, spelled out: every call asks, and a small call's cost on
        # the host is its function calls.)
        sizes = {}
        for size, name in (("query_size", "W_q"), ("key_size", "W_k"), ("value_size", "W_v")):
            weight = modules[name]._parameters["weight"]
            sizes[size] = None if type(weight) is UninitializedParameter else int(weight.shape[1])
        return sizes

    def _load_canonical(self, weights: Mapping[str, Any]) -> MultiHeadAttention:
        # (FromCanonical.from_canonical's load: the module's set_weights.)
        return set_weights(self, weights)

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
            head_dim)`` and int32 ``lengths`` ``(B,)`` all 0. Ordinary
            tensors, also under ``torch.inference_mode()``: a decoding step
            trusts what the step before checked only for tensors that count
            their versions.

        Raises:
            TypeError: ``batch_size`` or ``max_length`` is not an int, or
                ``dtype`` is not a floating-point ``torch.dtype``.
            ValueError: ``batch_size`` or ``max_length`` is negative.
        """
        shape = spec.cache_shape(batch_size, max_length, self._heads)
        parameter = self.W_o.weight
        dtype = parameter.dtype if dtype is None else dtype
        spec.check_new_cache_dtype(dtype, dtype_kind)
        # Ordinary tensors even under torch.inference_mode(): their versions
        # are what lets a decoding step trust the last step's check.
        with versioned():
            keys, values = (torch.zeros(shape, dtype=dtype, device=parameter.device) for _ in "kv")
            lengths = torch.zeros(shape[0], dtype=torch.int32, device=parameter.device)
        return FACTS.empty_cache(spec.KVCache(keys, values, lengths))

    @_docs.fill
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
        positions: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        segment_ids: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
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
                queries attend to every position the cache then holds. An
                eager call that records no gradient through the cache writes
                the rows into its own ``keys`` and ``values`` (the returned
                cache shares them; docs: "Generating with a cache"); a call
                that records gradients, or ``torch.compile``, updates
                functionally, and the returned cache is differentiable with
                respect to the new keys, values and the projections' weights.
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
            positions: ``None``, or integer ``(B, Q)`` (or ``(1, Q)``)
                positions of the queries, which a layer with ``rotary``
                rotates by; they serve the keys too (self-attention, or a
                cached call's new keys). Default: ``arange(Q)``, or with a
                cache each example's ``lengths[b] + i``.
            bias: ``None``, or a floating tensor broadcastable to ``(B, H,
                Q, K)`` (``(B, H, T, max_length)`` with a cache) added to the
                scaled scores before the masks; differentiable.
            {segment_ids_arg}

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
        # The module tables, not nn.Module's attribute lookup: a small call's cost is such work.
        modules = self._modules
        if not (
            "weight" in modules["W_q"]._parameters
            and "weight" in modules["W_k"]._parameters
            and "weight" in modules["W_v"]._parameters
            and "weight" in modules["W_o"]._parameters
        ):
            raise parametrized_projection(modules)
        dropout_p = modules["dropout"].p if self.training else 0.0
        # A plain call is offered to the route at the door, before the call's flow (docs:
        # "Fast paths"): a decoding step runs straight through where the step before
        # planned it, a call without a cache by its signature's plan; anything else, the
        # route's other cases and the calls it declines included, takes the call's flow,
        # which offers them nothing again. (Each argument compared here: a small call's
        # cost is such work, the flow's keyword arguments included.)
        declined = False
        if (
            keys is queries
            and values is queries
            and return_attention_weights is False
            and head_mask is None
            and positions is None
            and bias is None
            and segment_ids is None
            and dropout_p == 0
            and self._sharding is None
            and (causal is True or causal is False)
        ):
            dtype = modules["W_o"]._parameters["weight"].dtype
            if cache is None:
                result = FACTS.plain_attention(
                    self,
                    queries,
                    None,
                    causal=causal,
                    dtype=dtype,
                    options=self.options,
                    valid_lens=valid_lens,
                )
                if result is not None:
                    return result.output
                declined = True
            elif valid_lens is None:
                step = FACTS.plain_step(
                    self, queries, cache, causal=causal, dtype=dtype, options=self.options
                )
                if step is not None:
                    return step  # (output, cache)
                declined = True
        if self._sharding is not None and isinstance(queries, torch.Tensor):
            self._sharding.check_inputs(queries, self)
        result = call.forward(
            FACTS,
            self,
            queries,
            keys,
            values,
            valid_lens,
            causal=causal,
            return_attention_weights=return_attention_weights,
            cache=cache,
            head_mask=head_mask,
            positions=positions,
            bias=bias,
            segment_ids=segment_ids,
            layer_options=self.options,
            gate_heads=None if self._sharding is None else self._sharding.heads.num_heads,
            dtype=modules["W_o"]._parameters["weight"].dtype,
            dropout=modules["dropout"] if dropout_p > 0 else None,
            dropout_rate=dropout_p,
            # A sharded layer gates its own heads (docs: "Sharding heads").
            local_gates=None if self._sharding is None else self._sharding.local_head_mask,
            declined=declined,
        )
        return result.returned(return_attention_weights)


def _options_repr(options: spec.LayerOptions) -> str:
    set_ = {f.name: getattr(options, f.name) for f in dataclasses.fields(options)}
    default = spec.LayerOptions()
    return "".join(
        f", {name}={value}" for name, value in set_.items() if value != getattr(default, name)
    )


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
    arrays, _ = check_layer_weights(weights, layer, layer._canonical_heads())
    state = {}
    for name, array in arrays.items():
        tensor = torch.from_numpy(np.array(array, copy=True))
        if name in KERNEL_NAMES:
            state[f"{name}.weight"] = tensor.T.contiguous()
        elif name in NORM_NAMES or name == SINKS_NAME:
            state[name] = tensor
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
            finish_lazy(getattr(layer, name))
    layer._pack()  # (loaded lazy projections have storage of their own)
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
    spec.check_sizes_known(layer.input_sizes())
    # Sharded parameters are gathered whole (docs: "Sharding heads").
    whole = (lambda t: t) if layer._sharding is None else layer._sharding.full_tensor
    weights = {}
    for name in KERNEL_NAMES:
        linear = getattr(layer, name)
        weights[name] = host_array(whole(linear.weight).T)
        if layer.bias:
            weights[f"b_{name[-1]}"] = host_array(whole(linear.bias))
    if layer.options.qk_norm is not None:
        # Per head, every process holds the whole (head_dim,) weights.
        weights.update(zip(NORM_NAMES, map(host_array, layer.qk_norm_weights()), strict=True))
    if layer.options.sinks:
        weights[SINKS_NAME] = host_array(whole(layer.sinks))
    return weights

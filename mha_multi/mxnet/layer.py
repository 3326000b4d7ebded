"""``MultiHeadAttention`` as a Gluon ``HybridBlock`` on MXNet 1.9's numpy interface.

The layer is a shell (docs: "Architecture"): its ``nn.Dense`` parameters,
Gluon's protocol (``forward``, ``hybridize``, ``cast``, ``export``) and one
call of :func:`mha_multi.call.forward`, which checks the call on the
concrete arrays, with MXNet's facts (:data:`mha_multi.mxnet._facts.FACTS`).
The checked call then runs through :func:`mha_multi.call.attend`
(:func:`mha_multi.mxnet._graph.run`): on the parameters' arrays, or,
hybridized, inside the configuration's graph, planned before it where shapes
are known (:mod:`mha_multi.mxnet._graph`).

A ``head_mask`` (docs: "Heads") is cast to the layer's dtype (float32 for a
16-bit layer) before it reaches a graph (the cast is recorded, so its
gradient keeps the mask's own dtype) and multiplies the heads' concatenated
context before ``W_o`` on every route. Inputs with an empty axis reach no MXNet kernel
(:func:`mha_multi.mxnet._projections.empty_attention`).

Importing the package sets ``MXNET_CUDA_TENSOR_OP_MATH_ALLOW_CONVERSION`` to
MXNet's own default, ``0``, where the environment does not set it, before
MXNet is loaded (:func:`mha_multi.mxnet._facts.exact_float32`): MXNet's
behaviour is unchanged, and the parity runs are sure of it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import mxnet as mx
import numpy as np
from mxnet import gluon, npx
from mxnet.gluon import nn

from mha_multi import _docs, call, spec
from mha_multi.canonical_layer import FromCanonical
from mha_multi.mxnet._facts import FACTS, containers_on_host
from mha_multi.mxnet._graph import Graphs, run
from mha_multi.mxnet._projections import PROJECTIONS, get_weights, in_units, set_weights
from mha_multi.weights import SINKS_NAME

__all__ = ["MultiHeadAttention", "get_weights", "set_weights"]

# The layer is written for MXNet's numpy interface (as d2l is); it is a no-op
# when already active.
npx.set_np()


@_docs.fill
class MultiHeadAttention(FromCanonical, gluon.HybridBlock):
    """d2l's multi-head attention, exact to the spec of :mod:`mha_multi.spec`.

    The projections are ``nn.Dense(..., flatten=False)`` blocks named
    ``W_q``, ``W_k``, ``W_v`` and ``W_o`` as in d2l, so ``save_parameters``
    writes ``W_q.weight`` and so on. Input sizes left as ``None`` are inferred
    on the first call (Gluon's deferred initialization), or fixed by
    :func:`set_weights`.

    Parameters are created by ``initialize()`` or by :func:`set_weights`.
    The layer runs on concrete ``mxnet.numpy`` arrays; it cannot be traced
    with symbols inside another block's ``hybrid_forward`` (MXNet 1.9
    symbols have no dtype or rank, which the masks depend on).
    ``hybridize()`` compiles one graph per call configuration
    (:mod:`mha_multi.mxnet._graph`); the numbers are those of the imperative
    mode, a cached call's to its dtype's rounding (its graph's operations
    round otherwise; docs: "Generating with a cache"). Dropout acts only
    in training mode (``autograd.record()``). Calls that do not ask for the
    attention weights take a faster route to the
    same numbers (:mod:`mha_multi.mxnet._kernel`); plain self-attention
    called imperatively, and a hybridized layer's plain decoding step that
    records nothing, run it by a plan made once per signature
    (:mod:`mha_multi.mxnet._plain`; docs: "Fast paths").

    float16 products are taken in float32 and rounded once, on every device.
    Inputs with no batch, no queries or no keys are answered without a
    graph: no keys give the output ``b_o`` (zeros without bias) and weights
    of shape ``(B, H, Q, 0)``, and gradients flow as in the spec.

    Incremental decoding (docs: "Generating with a cache"): :meth:`init_cache`
    makes an empty :class:`mha_multi.spec.KVCache`, and a call given
    ``cache=`` appends its new keys and values to it and returns the cache
    after the call with the output; see :meth:`forward`.

    Heads (docs: "Heads"): ``head_mask=`` gates each head's context, on every
    route and with a cache; :func:`head_importance` scores the heads by the
    gates' gradients, and :func:`mha_multi.heads.prune_heads` gives the
    weights and ``MultiHeadAttention(**config.kwargs())`` of a layer without
    some of them.

    {grouped_heads}

    Args:
        num_hiddens: size of the output (and, by default, of every projection).
        {num_heads_arg}
        dropout: dropout rate on the attention weights, in training mode only.
        bias: whether the four projections have biases.
        query_size: last dimension of the queries (deferred when ``None``).
        key_size: last dimension of the keys (deferred when ``None``).
        value_size: last dimension of the values (deferred when ``None``).
        {kv_heads_args}
        {options_args}
            A call of a layer with any of them, or given ``positions``,
            ``bias`` or ``segment_ids``, runs on the parameters' arrays,
            hybridized or not.
        dtype: dtype of the parameters ("float32", "float64" or "float16").
        **kwargs: Gluon's ``prefix`` and ``params``.
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
        dtype: Any = "float32",
        **kwargs: Any,
    ) -> None:
        heads = {"num_kv_heads": num_kv_heads, "head_dim": head_dim}
        spec.check_config(num_hiddens, num_heads, dropout, **heads)
        spec.check_input_sizes(query_size=query_size, key_size=key_size, value_size=value_size)
        super().__init__(**kwargs)
        self._heads = spec.check_heads(num_hiddens, num_heads, **heads)
        self.options = spec.LayerOptions(
            rotary, alibi, window, softcap, sinks, qk_norm=qk_norm
        ).check(self._heads.head_dim)
        self.num_hiddens = int(num_hiddens)
        self.num_heads = self._heads.num_heads
        self.num_kv_heads = self._heads.num_kv_heads
        self.head_dim = self._heads.head_dim
        self.dropout = float(dropout)
        self.bias = spec.check_flag("bias", bias)
        query_features, kv_features = self._heads.query_features, self._heads.kv_features
        in_units = {"q": query_size, "k": key_size, "v": value_size, "o": query_features}
        units = {"q": query_features, "k": kv_features, "v": kv_features, "o": self.num_hiddens}
        with self.name_scope():
            for name in PROJECTIONS:
                dense = nn.Dense(
                    units[name],
                    flatten=False,
                    use_bias=self.bias,
                    dtype=dtype,
                    in_units=in_units[name] or 0,
                    prefix=f"W_{name}_",
                )
                setattr(self, f"W_{name}", dense)
            norm = self.options.qk_norm
            for name, shape in ({} if norm is None else norm.shapes(self._heads)).items():
                initial = mx.init.Constant(norm.initial_value)
                setattr(self, name, self.params.get(name, shape=shape, init=initial, dtype=dtype))
            # Each head's sink logit, zeros at first (docs: "Positions and biases").
            self.sinks = (
                self.params.get(SINKS_NAME, shape=(self.num_heads,), init="zeros", dtype=dtype)
                if self.options.sinks
                else None
            )
        self._graphs = Graphs(hybridize_args=None)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(num_hiddens={self.num_hiddens}, "
            f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, dropout={self.dropout}, bias={self.bias})"
        )

    # -- configuration --------------------------------------------------------

    @property
    def heads(self) -> spec.Heads:
        """The layer's head layout (:class:`mha_multi.spec.Heads`)."""
        return self._heads

    def input_sizes(self) -> dict[str, int | None]:
        """``query_size``, ``key_size``, ``value_size``; ``None`` where still deferred."""
        return {
            f"{kind}_size": in_units(getattr(self, f"W_{name}"))
            for name, kind in (("q", "query"), ("k", "key"), ("v", "value"))
        }

    @property
    def dtype(self) -> np.dtype:
        """The parameters' dtype."""
        return np.dtype(self.W_o.weight.dtype)

    def hybridize(self, active: bool = True, *args: Any, **kwargs: Any) -> None:
        """Gluon's ``hybridize``, applied to every configuration's graph."""
        super().hybridize(active, *args, **kwargs)
        self._graphs.hybridize(active, *args, **kwargs)

    def cast(self, dtype: Any) -> None:
        """Casts the parameters; graphs are rebuilt for the new dtype."""
        super().cast(dtype)
        # MXNet 1.9 caches each parameter's symbol with its old dtype, so a
        # graph traced after the cast would fail type inference.
        for parameter in self.collect_params().values():
            parameter._var = None
        self._graphs = Graphs(self._graphs.hybridize_args)

    def export(self, path: str, epoch: int = 0, remove_amp_cast: bool = True) -> None:
        """Exports the graph of the most recent call (hybridized) to files.

        Writes ``path-symbol.json`` and ``path-%04d.params``, loadable with
        ``gluon.SymbolBlock.imports(symbol_file, names, params_file)``, where
        ``names`` are ``["data0", "data1", "data2"]`` (queries, keys, values)
        plus ``"data3"`` (``valid_lens``) if that call had lengths. The graph
        computes that call's configuration (``causal``,
        ``return_attention_weights``, lengths' rank and dtype).

        The graph of a cached call takes queries, keys, values, ``valid_lens``
        (``(B,)`` int32, always present), ``cache.keys``, ``cache.values`` and
        ``cache.lengths`` (int32), ``data0`` to ``data6``, or queries and the
        cache's three arrays (``data0`` to ``data3``) for a call without keys;
        it returns the output, the weights if that call asked for them, and,
        when it appends, the cache's new keys, values and lengths: the
        functional update, also where the call itself wrote in place. It runs
        without the layer's checks: see :meth:`forward` for what it does with
        lengths the layer would have refused.

        A call given a ``head_mask`` has it as the graph's last input (the
        next ``data`` name after the others), of that call's rank and of the
        layer's dtype.

        Raises:
            RuntimeError: the block is not hybridized or was not called yet, or
                its most recent call ran without a graph (positions, a bias,
                segment ids or layer options such as rotary).
        """
        graph = self._graphs.exportable(self) if self._active else None
        if graph is None and self._active and self._graphs.graphless is not None:
            raise RuntimeError(
                f"the most recent call has no graph to export: {self._graphs.graphless}"
            )
        if graph is None:
            raise RuntimeError("call hybridize() and then the layer at least once before export()")
        graph.export(path, epoch=epoch, remove_amp_cast=remove_amp_cast)

    def _load_canonical(self, weights: Mapping[str, Any]) -> MultiHeadAttention:
        # (FromCanonical.from_canonical's load: the module's set_weights.)
        return set_weights(self, weights)

    def init_cache(
        self,
        batch_size: int,
        max_length: int,
        dtype: Any = None,
        *,
        ctx: mx.Context | None = None,
    ) -> spec.KVCache:
        """An empty key/value cache for incremental decoding (docs: "Generating with a cache").

        Args:
            batch_size: ``B``, the examples decoded together.
            max_length: the positions each example can hold.
            dtype: of the keys and values; ``None`` for the layer's (a call
                refuses any other).
            ctx: the device; ``None`` for the parameters' (the first, when
                they are on several), or the current context before they are
                initialized.

        Returns:
            :class:`mha_multi.spec.KVCache` of ``mxnet.numpy`` arrays: zero
            ``keys`` and ``values`` ``(batch_size, num_kv_heads, max_length,
            head_dim)`` and zero ``lengths`` ``(batch_size,)`` int32.

        Raises:
            TypeError: ``batch_size`` or ``max_length`` is not an int, or
                ``dtype`` is not floating.
            ValueError: either is negative.
        """
        shape = spec.cache_shape(batch_size, max_length, self._heads)
        if dtype is None:
            dtype = self.dtype
        else:
            spec.check_new_cache_dtype(dtype, lambda given: np.dtype(given).kind)
            dtype = np.dtype(dtype)
        if ctx is None:
            try:
                ctx = self.W_o.weight.list_ctx()[0]
            except RuntimeError:  # not initialized yet
                ctx = mx.context.current_context()
        return spec.KVCache(
            mx.np.zeros(shape, dtype=dtype, ctx=ctx),
            mx.np.zeros(shape, dtype=dtype, ctx=ctx),
            mx.np.zeros(shape[:1], dtype=np.int32, ctx=ctx),
        )

    # -- calling -------------------------------------------------------------

    def __call__(  # type: ignore[override]
        self, queries: Any, keys: Any, values: Any, valid_lens: Any = None, **options: Any
    ) -> Any:
        """:meth:`forward` with Gluon's hooks; ``options`` are its keyword arguments."""
        # Gluon's Block.__call__ takes positional arguments only.
        args = (queries, keys, values, valid_lens)
        for hook in self._forward_pre_hooks.values():
            hook(self, args)
        out = self.forward(*args, **options)
        for hook in self._forward_hooks.values():
            hook(self, args, out)
        return out

    @_docs.fill
    def forward(  # type: ignore[override]
        self,
        queries: Any,
        keys: Any,
        values: Any,
        valid_lens: Any = None,
        *,
        causal: bool = False,
        return_attention_weights: bool = False,
        cache: spec.KVCache | None = None,
        head_mask: Any = None,
        positions: Any = None,
        bias: Any = None,
        segment_ids: Any = None,
    ) -> Any:
        """Attends from ``queries`` to ``keys``/``values``, or to a key/value cache.

        With a ``cache`` (from :meth:`init_cache`), the call is one step of
        incremental decoding (docs: "Generating with a cache"): ``keys`` and
        ``values`` are ``T`` new positions, of which example ``b`` keeps the
        first ``valid_lens[b]`` (all ``T`` by default) and writes them at
        positions ``cache.lengths[b]`` on; query ``i`` sees the example's
        kept positions up to its own, ``cache.lengths[b] + i``, when
        ``causal`` (else all of them). ``keys=values=None`` attends to the
        cache as it is and appends nothing. A call that records nothing
        (outside ``autograd.record()``), imperative or hybridized, writes
        the rows into the given cache's ``keys`` and ``values`` and attends
        over the filled positions only, rounded up to
        :data:`mha_multi.spec.SPAN_BUCKET` (hybridized, in a graph, but for
        a plain decoding step, which runs the imperative plan); the
        returned cache shares them. A recorded call leaves the given cache as it was and
        returns a new one (docs: "Generating with a cache").

        The layer reads the cache's lengths and ``valid_lens`` (one wait for
        the device) and refuses a call that would overflow the cache, in
        imperative and hybridized mode alike. An exported graph
        (:meth:`export`) has no such checks: it clips ``valid_lens`` into
        ``[0, T]``, never writes at or past ``max_length`` nor below
        ``cache.lengths``, and counts the positions it dropped in the new
        lengths, so ``lengths > max_length`` tells that it happened.

        Args:
            queries: ``(B, Q, query_size)`` ``mxnet.numpy.ndarray``; with a
                cache ``(B, T, query_size)``.
            keys: ``(B, K, key_size)``, same dtype and device; with a cache
                ``(B, T, key_size)`` or ``None``.
            values: ``(B, K, value_size)``, same dtype and device; with a
                cache ``(B, T, value_size)`` or ``None``.
            valid_lens: ``None``, ``(B,)`` or ``(B, Q)``, integer or floating
                (MXNet's default float32 included); an ``mxnet.numpy`` array
                on any device, a numpy array (any integer dtype: lengths
                beyond int32 are clipped, which keeps their meaning) or a
                list. Key ``j`` is visible to query ``i`` iff ``j < valid_lens``.
                With a cache: ``None`` or ``(B,)`` integers in ``[0, T]``,
                the new positions each example keeps.
            causal: a bool; also hide key ``j`` from query ``i`` when
                ``j > i + (K - Q)``.
            return_attention_weights: also return the pre-dropout weights.
            cache: ``None``, or a :class:`mha_multi.spec.KVCache` of
                ``mxnet.numpy`` arrays on the queries' device: ``keys`` and
                ``values`` ``(B, num_kv_heads, max_length, head_dim)`` of the
                layer's dtype, ``lengths`` ``(B,)`` integers.
            head_mask: ``None``, or ``(num_heads,)`` or ``(B, num_heads)``
                floating ``mxnet.numpy`` gates on the queries' device (docs:
                "Heads"): head ``h``'s context, its slice of ``weights @ v``
                before ``W_o``, is multiplied by ``head_mask[..., h]``. Any
                floating dtype; it is cast to the layer's, float32 for a
                16-bit layer (the cast is recorded, so ``head_mask.grad``
                has the gates' own dtype).
                Gradients reach it through ``autograd`` as through any input.
            {positions_arg}
            bias: ``None``, or a floating ``mxnet.numpy`` array broadcastable
                to ``(B, H, Q, K)``, added to the scaled scores before the
                masks; differentiable.
            {segment_ids_arg}

        Returns:
            ``(B, Q, num_hiddens)``, and with ``return_attention_weights`` the
            tuple ``(output, weights)`` with weights ``(B, H, Q, K)``. With a
            cache, ``(output, cache)`` or ``(output, weights, cache)``, the
            weights ``(B, H, T, max_length)`` (zero where hidden) and the
            cache's lengths int32.

        Raises:
            TypeError: an input is not a floating ``mxnet.numpy.ndarray`` of
                the parameters' dtype, ``valid_lens`` is not numeric (not
                integer, with a cache), ``causal`` is not a bool, the cache
                is not a ``KVCache`` of the layer's dtype, or ``head_mask`` is
                not a floating ``mxnet.numpy.ndarray``.
            ValueError: mismatched shapes or devices (``head_mask``'s
                included); with a cache, lengths out of range or a cache that
                would overflow.
        """
        # (The other frameworks' arrays stack as numpy arrays; MXNet's do not.)
        valid_lens, positions = containers_on_host(valid_lens), containers_on_host(positions)
        query_ids, key_ids = spec.split_segment_ids(segment_ids)
        if query_ids is segment_ids:  # (one array, or nested lists: not a pair)
            segment_ids = containers_on_host(segment_ids)
        else:
            segment_ids = (containers_on_host(query_ids), containers_on_host(key_ids))
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
            layer_options=None if self.options.is_default else self.options,
            dtype=self.dtype,
            # Dropout is the layer's own, in its computation (npx.dropout acts
            # only while autograd records in training mode).
            run=run,
        )
        return result.returned(return_attention_weights)

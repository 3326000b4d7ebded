"""``MultiHeadAttention`` as a Gluon ``HybridBlock`` on MXNet 1.9's numpy interface.

MXNet 1.9 builds one static graph per ``HybridBlock``, from positional
arrays only, and its symbols have neither shape nor dtype. The public block
therefore does the checks on the concrete arrays it is called with, then
hands them to a private graph block built for that call's *configuration*:
device type, dtype, whether ``valid_lens`` is given and its rank and dtype,
``causal`` and ``return_attention_weights``. The graph blocks share the
public block's parameters (Gluon's ``params=`` sharing), are hybridized
with it, and each keeps its own cached graph, so alternating configurations
never rebuild a graph.

When the attention weights are not asked for, a graph takes a faster route
to the same numbers (:meth:`_AttentionGraph._fused_attention`): the scale
applied to the queries rather than to the scores, ``batch_dot`` with the
transposed keys instead of an explicit transpose, and the mask applied by
``SequenceMask`` (which replaces hidden scores by ``MASK_VALUE``, exactly the
spec's rule) instead of a broadcast ``where``, so the softmax is MXNet's
plain (oneDNN) one. Every mask of the spec hides a suffix of the keys
(lengths and the causal rule both do), so the number of visible keys,
counted from :func:`mha_multi.spec.visibility`, is that mask's length.
Grouped key/value heads take the spec's grouped layout
(:func:`mha_multi.spec.transpose_grouped_queries`): one ``batch_dot`` per
key/value head scores its whole group, and no key or value is repeated.
Asking for the weights runs the generic :func:`mha_multi.spec.attention`.

A call with a key/value cache (docs: "Generating with a cache") is one more
configuration: the cache's three arrays are graph inputs and, when the call
appends, the new cache's three arrays graph outputs, so one graph serves a
prefill and every decoding step (MXNet's cached graph takes each new length
as it comes). The graph writes the new positions with
:func:`mha_multi.spec.update_cache` and attends over the cache by the same
kernel plan as any call, the causal rule inside its ``(B, T)`` lengths. The
public block reads the lengths first and refuses what would overflow the
cache; an exported graph, which cannot, drops what does not fit.

A ``head_mask`` (docs: "Heads") is one more configuration too, by its rank:
the gates are the graph's last input, cast to the layer's dtype by the
public block, and multiply the heads' concatenated context before ``W_o``
(:func:`mha_multi.spec.apply_head_mask`) on every route, so the fast route
stays the fast route. Its gradient is Gluon's, as for any input:
:func:`head_importance` reads it at gates of ones.

Importing the layer sets ``MXNET_CUDA_TENSOR_OP_MATH_ALLOW_CONVERSION`` to
MXNet's own default, ``0``, where the environment does not set it, before
MXNet is loaded (:func:`mha_multi.mxnet._backend.exact_float32`): MXNet's
behaviour is unchanged, and the parity runs are sure of it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

# First: the backend module puts MXNet's exact-float32 environment in place
# before MXNet is loaded (docs: "Architecture").
from mha_multi.mxnet._backend import head_mask_gradient, host_array  # isort: split

import mxnet as mx
import numpy as np
from mxnet import gluon, npx
from mxnet.gluon import nn

from mha_multi import spec
from mha_multi.heads import importance
from mha_multi.mxnet._ops import MXNetOps, dtype_kind
from mha_multi.weights import KERNEL_NAMES, check_weights

__all__ = ["MultiHeadAttention", "get_weights", "head_importance", "set_weights"]

# The layer is written for MXNet's numpy interface (as d2l is); it is a no-op
# when already active.
npx.set_np()

_PROJECTIONS = ("q", "k", "v", "o")


@dataclass(frozen=True)
class _Config:
    """What a graph is built for; everything else is a runtime input."""

    device_type: str
    dtype: str
    lens_ndim: int | None  # None: no valid_lens
    lens_dtype: str | None
    causal: bool
    return_attention_weights: bool
    plan: spec.KernelPlan  # the SequenceMask route, or spec.attention where not fused
    cached: bool = False  # a call with a key/value cache (the cache's arrays are inputs)
    appends: bool = False  # a cached call given new keys and values
    head_mask_ndim: int | None = None  # None: no head_mask; else 1 (H,) or 2 (B, H), an input


class _Graphs:
    """Holds the per-configuration graph blocks.

    A plain dict attribute holding blocks would make Gluon warn about an
    unregistered container; these blocks are deliberately not children, so
    that the public block's parameter names stay d2l's.
    """

    def __init__(self) -> None:
        self.by_config: dict[_Config, _AttentionGraph] = {}
        self.last: _AttentionGraph | None = None


class _AttentionGraph(gluon.HybridBlock):
    """The layer's computation for one configuration, on shared parameters."""

    def __init__(
        self,
        config: _Config,
        *,
        num_hiddens: int,
        heads: spec.Heads,
        dropout: float,
        prefix: str,
        params: gluon.ParameterDict,
        shared: Mapping[str, gluon.Parameter],
    ) -> None:
        super().__init__(prefix=prefix, params=params)
        self._config = config
        self._num_hiddens = num_hiddens
        self._heads = heads
        self._dropout = dropout
        self._low_precision = np.dtype(config.dtype).itemsize < 4
        #: dtypes and shapes of the call's inputs, by Gluon's graph input names.
        self.input_dtypes: dict[str, str] = {}
        self.input_shapes: dict[str, tuple[int, ...]] = {}
        with self.name_scope():
            for name, parameter in shared.items():
                found = self.params.get(name)
                if found is not parameter:
                    raise RuntimeError(f"parameter {parameter.name!r} could not be shared")
                setattr(self, name, found)

    def _project(self, F: Any, x: Any, weight: Any, bias: Any, features: int) -> Any:
        if self._low_precision:
            # The spec accumulates 16-bit products in float32 and rounds once;
            # MXNet's kernels promise nothing (its CPU kernel has no float16
            # at all), so the product is taken in float32 on every device.
            x, weight = x.astype(np.float32), weight.astype(np.float32)
            bias = None if bias is None else bias.astype(np.float32)
        y = F.npx.fully_connected(
            x, weight, bias, no_bias=bias is None, num_hidden=features, flatten=False
        )
        return y.astype(self._config.dtype) if self._low_precision else y

    def hybrid_forward(
        self,
        F: Any,
        queries: Any,
        keys: Any,
        values: Any,
        valid_lens: Any = None,
        cache_keys: Any = None,
        cache_values: Any = None,
        cache_lengths: Any = None,
        head_mask: Any = None,
        **params: Any,
    ) -> Any:
        # Symbols (a graph being traced) get the traced call's input dtypes
        # and shapes: MXNet 1.9 symbols carry neither.
        ops = MXNetOps(
            F,
            input_dtypes=self.input_dtypes,
            input_shapes=self.input_shapes,
        )

        heads = self._heads
        features = {
            "q": heads.query_features,
            "k": heads.kv_features,
            "v": heads.kv_features,
            "o": self._num_hiddens,
        }

        def project(x: Any, name: str) -> Any:
            weight, bias = params[f"W_{name}_weight"], params.get(f"W_{name}_bias")
            return self._project(F, x, weight, bias, features[name])

        q = project(queries, "q")
        if self._config.cached:
            cache = spec.KVCache(cache_keys, cache_values, cache_lengths)
            k = v = new = None
            if self._config.appends:
                k, v = project(keys, "k"), project(values, "v")
                new = _new_positions(F, ops, k, valid_lens)
            cache, lens = spec.update_cache(
                ops, cache, k, v, new, head_dim=heads.head_dim, causal=self._config.causal
            )
            # The causal rule is in lens: (B, T) keys seen by each query.
            context, weights = self._attend(
                F, ops, q, cache.keys, cache.values, lens, causal=False, kv_split=True
            )
            appended = tuple(cache) if self._config.appends else ()
        else:
            k, v = project(keys, "k"), project(values, "v")
            context, weights = self._attend(
                F, ops, q, k, v, valid_lens, causal=self._config.causal, kv_split=False
            )
            appended = ()
        # The gates act on each head's slice of the concatenated context, on
        # either route (the fast route's result is that context too).
        context = spec.apply_head_mask(ops, context, head_mask, heads.num_heads)
        outputs = (project(context, "o"),)
        if self._config.return_attention_weights:
            outputs += (weights,)
        outputs += appended
        return outputs if len(outputs) > 1 else outputs[0]

    def _attend(
        self,
        F: Any,
        ops: MXNetOps,
        q: Any,
        k: Any,
        v: Any,
        valid_lens: Any,
        *,
        causal: bool,
        kv_split: bool,
    ) -> tuple[Any, Any]:
        """The concatenated heads before ``W_o``, and the weights (``None`` on the fast route).

        ``kv_split``: keys and values are ``(B, H_kv, K, dh)``, as a cache
        holds them, rather than ``(B, K, H_kv*dh)``.
        """
        if self._config.plan.fused:
            return self._fused_attention(F, ops, q, k, v, valid_lens, kv_split=kv_split), None

        def dropout(weights: Any) -> Any:
            # mode="training": active only while autograd is in training mode.
            return F.npx.dropout(weights, p=self._dropout)

        return spec.attention(
            ops,
            q,
            k,
            v,
            valid_lens,
            num_heads=self._heads.num_heads,
            head_dim=self._heads.head_dim,
            num_kv_heads=self._heads.num_kv_heads,
            causal=causal,
            dropout=dropout if self._dropout > 0 else None,
            kv_split=kv_split,
        )

    def _batch_dot(self, F: Any, a: Any, b: Any) -> Any:
        """``a @ b`` of the layer's dtype; 16-bit accumulated in float32, as in MXNetOps.matmul."""
        if self._low_precision:
            product = F.npx.batch_dot(a.astype(np.float32), b.astype(np.float32))
            return product.astype(self._config.dtype)
        return F.npx.batch_dot(a, b)

    def _fused_attention(
        self,
        F: Any,
        ops: MXNetOps,
        q: Any,
        k: Any,
        v: Any,
        valid_lens: Any,
        *,
        kv_split: bool = False,
    ) -> Any:
        """Attention through MXNet's fastest CPU kernels, to the spec's numbers.

        Heads are in the spec's grouped layout (docs: "The spec", grouped
        heads): the ``G`` query heads that read key/value head ``j`` are rows
        of one ``(G*Q, dh)`` block, which meets that head's ``(K, dh)`` keys
        and values in one ``batch_dot``; with ``G = 1`` it is d2l's layout.

        Args:
            F: ``mxnet.ndarray`` or ``mxnet.symbol``.
            ops: the adapter for ``F``.
            q: projected queries ``(B, Q, num_heads * head_dim)``.
            k, v: projected keys and values ``(B, K, num_kv_heads * head_dim)``,
                or with ``kv_split`` ``(B, num_kv_heads, K, head_dim)`` (a cache's).
            valid_lens: ``None``, ``(B,)`` or ``(B, Q)``.
            kv_split: the layout of ``k`` and ``v``.

        Returns:
            The concatenated heads ``(B, Q, num_heads * head_dim)``.
        """
        kv_heads, group_size = self._heads.num_kv_heads, self._heads.group_size
        if self._low_precision:
            # As spec.scaled_scores: 16-bit heads give float32 scores, which
            # stay float32 into the float32 softmax (inputs of magnitude 300
            # give scores beyond float16's range).
            q, k = q.astype(np.float32), k.astype(np.float32)
        # Scaling the queries instead of the (B*H, Q, K) scores is K / head_dim
        # times less work; it is exact when sqrt(head_dim) is a power of two
        # (head_dim 4, 16, 64, 256), and otherwise differs by rounding only.
        q = q / math.sqrt(self._heads.head_dim)
        q = spec.transpose_grouped_queries(ops, q, kv_heads, group_size)  # (B*H_kv, G*Q, dh)
        if kv_split:
            k, v = (ops.merge_axes(x, 0) for x in (k, v))  # (B*H_kv, K, dh)
        else:
            k, v = (spec.transpose_qkv(ops, x, kv_heads) for x in (k, v))
        scores = F.npx.batch_dot(q, k, transpose_b=True)  # (B*H_kv, G*Q, K)
        # Row ((b*H_kv + j)*G + g)*Q + i is query i of head h = j*G + g: as
        # (B, H, Q, K), a view, the rows line up with the spec's masks.
        head_scores = spec.grouped_to_heads(ops, scores, kv_heads, group_size)  # (B, H, Q, K)
        mask = self._config.plan.mask(
            ops, ops.size(head_scores, 2), ops.size(head_scores, 3), valid_lens
        )
        if mask is not None:
            # Visible keys form a prefix of each row (lengths and the causal
            # rule hide suffixes, and so does their AND), so the number of
            # visible keys is a SequenceMask length, and SequenceMask
            # *replaces* the rest by the spec's MASK_VALUE: fully hidden rows
            # get uniform weights and hidden scores no gradient, as in the spec.
            counts = F.np.sum(mask.astype(np.int32), axis=-1)  # (B, 1, 1|Q) or (Q,)
            rows = F.np.zeros_like(head_scores[:, :, :, 0], dtype=np.int32)  # (B, H, Q)
            lengths = F.npx.reshape(rows + counts, (-1,))  # (B*H*Q,), the order of scores' rows
            masked = F.npx.sequence_mask(
                F.npx.reshape(scores, (-5, -2)),  # (B*H*Q, K)
                lengths,
                use_sequence_length=True,
                value=spec.MASK_VALUE,
                axis=1,
            )
            scores = F.npx.reshape_like(masked, scores)
        weights = F.npx.softmax(scores, axis=-1)
        if self._low_precision:
            weights = weights.astype(self._config.dtype)
        if self._dropout > 0:
            weights = F.npx.dropout(weights, p=self._dropout)
        context = self._batch_dot(F, weights, v)  # (B*H_kv, G*Q, dh)
        return spec.transpose_grouped_output(ops, context, kv_heads, group_size)


def _new_positions(F: Any, ops: MXNetOps, k: Any, valid_lens: Any) -> Any:
    """``valid_lens`` clipped to ``[0, T]``: the call's positions each example keeps.

    Counted as the positions ``t < valid_lens[b]``, which needs no concrete
    ``T``: an exported graph, which runs without the layer's checks, still
    never writes more positions than the call has, nor a negative number
    (which would let the next call overwrite kept positions).
    """
    positions = ops.expand_dims(ops.arange(ops.size(k, 1)), 0)  # (1, T)
    kept = ops.less(positions, ops.expand_dims(valid_lens, 1))  # (B, T)
    return F.np.sum(kept.astype(np.int32), axis=1).astype(np.int32)


#: The fast route's kernel: SequenceMask *replaces* hidden scores by the
#: spec's MASK_VALUE, so fully hidden rows get uniform weights, non-finite
#: hidden scores do not reach the weights, and dropout on the weights is the
#: generic path's; it has no causal flag (the rule goes into the mask).
SEQUENCE_MASK = spec.FusedKernel(
    "npx.sequence_mask",
    takes_dropout=True,
    causal_flag=False,
    replaces_hidden_scores=True,
    hidden_rows_uniform=True,
    takes_grouped_heads=True,
)


class MultiHeadAttention(gluon.HybridBlock):
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
    ``hybridize()`` compiles one graph per call configuration (see the module
    docstring); the numbers are those of the imperative mode. Dropout acts
    only in training mode (``autograd.record()``). Calls that do not ask for
    the attention weights take a faster route to the same numbers (see the
    module docstring).

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

    Grouped-query attention (docs: "The spec", grouped heads): with
    ``num_kv_heads < num_heads`` query head ``h`` reads key/value head
    ``h // (num_heads // num_kv_heads)``; ``W_k`` and ``W_v`` project to
    ``num_kv_heads * head_dim`` features, ``W_q`` to ``num_heads * head_dim``.

    Args:
        num_hiddens: size of the output (and, by default, of every projection).
        num_heads: number of (query) heads ``H``; must divide ``num_hiddens``
            unless ``head_dim`` is given.
        dropout: dropout rate on the attention weights, in training mode only.
        bias: whether the four projections have biases.
        query_size: last dimension of the queries (deferred when ``None``).
        key_size: last dimension of the keys (deferred when ``None``).
        value_size: last dimension of the values (deferred when ``None``).
        num_kv_heads: number of key/value heads; must divide ``num_heads``
            (``None``: ``num_heads``).
        head_dim: size of each head (``None``: ``num_hiddens // num_heads``).
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
        dtype: Any = "float32",
        **kwargs: Any,
    ) -> None:
        heads = {"num_kv_heads": num_kv_heads, "head_dim": head_dim}
        spec.check_config(num_hiddens, num_heads, dropout, **heads)
        spec.check_input_sizes(query_size=query_size, key_size=key_size, value_size=value_size)
        super().__init__(**kwargs)
        self._heads = spec.check_heads(num_hiddens, num_heads, **heads)
        self.num_hiddens = int(num_hiddens)
        self.num_heads = self._heads.num_heads
        self.num_kv_heads = self._heads.num_kv_heads
        self.head_dim = self._heads.head_dim
        self.dropout = float(dropout)
        self.bias = bool(bias)
        query_features, kv_features = self._heads.query_features, self._heads.kv_features
        in_units = {"q": query_size, "k": key_size, "v": value_size, "o": query_features}
        units = {"q": query_features, "k": kv_features, "v": kv_features, "o": self.num_hiddens}
        with self.name_scope():
            for name in _PROJECTIONS:
                dense = nn.Dense(
                    units[name],
                    flatten=False,
                    use_bias=self.bias,
                    dtype=dtype,
                    in_units=in_units[name] or 0,
                    prefix=f"W_{name}_",
                )
                setattr(self, f"W_{name}", dense)
        self._graphs = _Graphs()
        self._hybridize_args: tuple[tuple[Any, ...], dict[str, Any]] | None = None

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(num_hiddens={self.num_hiddens}, "
            f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, dropout={self.dropout}, bias={self.bias})"
        )

    # -- configuration --------------------------------------------------------

    def input_sizes(self) -> dict[str, int | None]:
        """``query_size``, ``key_size``, ``value_size``; ``None`` where still deferred."""
        return {
            f"{kind}_size": _in_units(getattr(self, f"W_{name}"))
            for name, kind in (("q", "query"), ("k", "key"), ("v", "value"))
        }

    @property
    def dtype(self) -> np.dtype:
        """The parameters' dtype."""
        return np.dtype(self.W_o.weight.dtype)

    def hybridize(self, active: bool = True, *args: Any, **kwargs: Any) -> None:
        """Gluon's ``hybridize``, applied to every configuration's graph."""
        super().hybridize(active, *args, **kwargs)
        self._hybridize_args = ((active, *args), kwargs)
        for graph in self._graphs.by_config.values():
            graph.hybridize(active, *args, **kwargs)

    def cast(self, dtype: Any) -> None:
        """Casts the parameters; graphs are rebuilt for the new dtype."""
        super().cast(dtype)
        # MXNet 1.9 caches each parameter's symbol with its old dtype, so a
        # graph traced after the cast would fail type inference.
        for parameter in self.collect_params().values():
            parameter._var = None
        self._graphs = _Graphs()

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
        when it appends, the cache's new keys, values and lengths. It runs
        without the layer's checks: see :meth:`forward` for what it does with
        lengths the layer would have refused.

        A call given a ``head_mask`` has it as the graph's last input (the
        next ``data`` name after the others), of that call's rank and of the
        layer's dtype.

        Raises:
            RuntimeError: the block is not hybridized or was not called yet.
        """
        graph = self._graphs.last
        if graph is None or not self._active:
            raise RuntimeError("call hybridize() and then the layer at least once before export()")
        graph.export(path, epoch=epoch, remove_amp_cast=remove_amp_cast)

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
            TypeError: ``batch_size`` or ``max_length`` is not an int.
            ValueError: either is negative.
        """
        shape = spec.cache_shape(batch_size, max_length, self._heads)
        dtype = self.dtype if dtype is None else np.dtype(dtype)
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
    ) -> Any:
        # Gluon's Block.__call__ takes positional arguments only.
        args = (queries, keys, values, valid_lens)
        for hook in self._forward_pre_hooks.values():
            hook(self, args)
        out = self.forward(
            *args,
            causal=causal,
            return_attention_weights=return_attention_weights,
            cache=cache,
            head_mask=head_mask,
        )
        for hook in self._forward_hooks.values():
            hook(self, args, out)
        return out

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
    ) -> Any:
        """Attends from ``queries`` to ``keys``/``values``, or to a key/value cache.

        With a ``cache`` (from :meth:`init_cache`), the call is one step of
        incremental decoding (docs: "Generating with a cache"): ``keys`` and
        ``values`` are ``T`` new positions, of which example ``b`` keeps the
        first ``valid_lens[b]`` (all ``T`` by default) and writes them at
        positions ``cache.lengths[b]`` on; query ``i`` sees the example's
        kept positions up to its own, ``cache.lengths[b] + i``, when
        ``causal`` (else all of them). ``keys=values=None`` attends to the
        cache as it is and appends nothing. The cache is not changed in
        place: the call returns the cache after it.

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
                floating dtype; it is cast to the layer's (the cast is
                recorded, so ``head_mask.grad`` has the gates' own dtype).
                Gradients reach it through ``autograd`` as through any input.

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
        if cache is not None:
            return self._cached_forward(
                queries,
                keys,
                values,
                valid_lens,
                cache,
                causal=causal,
                return_attention_weights=bool(return_attention_weights),
                head_mask=head_mask,
            )
        for name, array in (("queries", queries), ("keys", keys), ("values", values)):
            _check_array(name, array, self.dtype)
        for name, array in (("keys", keys), ("values", values)):
            if array.ctx != queries.ctx:
                raise ValueError(f"{name} is on {array.ctx} but queries on {queries.ctx}")
        lens = _as_lens(valid_lens, queries.ctx)
        spec.check_inputs(
            queries.shape,
            keys.shape,
            values.shape,
            None if lens is None else lens.shape,
            causal=causal,
            **self.input_sizes(),
        )
        gates = self._gates(head_mask, queries)
        if 0 in (queries.shape[0], queries.shape[1], keys.shape[1]):
            # MXNet 1.9's kernels fail on these shapes (some crash the process,
            # some leave the engine unusable), so the result is built here.
            return self._empty_attention(
                queries, keys, values, keys.shape[1], bool(return_attention_weights), gates
            )
        config = _Config(
            device_type=queries.ctx.device_type,
            dtype=self.dtype.name,
            lens_ndim=None if lens is None else lens.ndim,
            lens_dtype=None if lens is None else np.dtype(lens.dtype).name,
            causal=bool(causal),
            return_attention_weights=bool(return_attention_weights),
            plan=spec.plan_kernel(
                SEQUENCE_MASK,
                sizes=(queries.shape[0], queries.shape[1], keys.shape[1]),
                lens_ndim=None if lens is None else lens.ndim,
                causal=bool(causal),
                dropout=self.dropout > 0,
                return_attention_weights=bool(return_attention_weights),
                grouped=self._heads.grouped,
            ),
            head_mask_ndim=None if gates is None else gates.ndim,
        )
        out = self._run(config, (queries, keys, values, lens, None, None, None, gates))
        return tuple(out) if config.return_attention_weights else out

    def _cached_forward(
        self,
        queries: Any,
        keys: Any,
        values: Any,
        valid_lens: Any,
        cache: Any,
        *,
        causal: Any,
        return_attention_weights: bool,
        head_mask: Any,
    ) -> tuple[Any, ...]:
        """:meth:`forward` with a cache: checks, then the configuration's graph."""
        _check_array("queries", queries, self.dtype)
        for name, array in (("keys", keys), ("values", values)):
            if array is not None:
                _check_array(name, array, self.dtype)
                if array.ctx != queries.ctx:
                    raise ValueError(f"{name} is on {array.ctx} but queries on {queries.ctx}")
        cache = _check_cache(cache, queries.ctx, self.dtype)
        lens = _as_lens(valid_lens, queries.ctx)
        spec.check_cached_call(
            queries,
            keys,
            values,
            lens,
            cache,
            heads=self._heads,
            dtype_kind=dtype_kind,
            causal=causal,
            **self.input_sizes(),
        )
        gates = self._gates(head_mask, queries)
        appends = keys is not None
        batch, num_new = queries.shape[:2]
        max_length = cache.keys.shape[2]
        spec.check_cache_values(
            host_array(cache.lengths),
            None if lens is None else host_array(lens),
            num_new if appends else 0,
            max_length,
        )
        # Checked: every length fits in int32, the graphs' one integer type.
        lengths = _as_int32(cache.lengths)
        if 0 in (batch, num_new, max_length):
            # Nothing to write: no example, no new position, or (checked) no
            # position held or added.
            result = self._empty_attention(
                queries, keys, values, max_length, return_attention_weights, gates
            )
            result = result if return_attention_weights else (result,)
            return (*result, spec.KVCache(cache.keys, cache.values, lengths))
        if appends:
            if lens is None:
                lens = mx.np.full((batch,), num_new, dtype=np.int32, ctx=queries.ctx)
            lens = _as_int32(lens)
        config = _Config(
            device_type=queries.ctx.device_type,
            dtype=self.dtype.name,
            lens_ndim=1 if appends else None,
            lens_dtype="int32" if appends else None,
            causal=bool(causal) and appends,  # without new positions, nothing is causal
            return_attention_weights=return_attention_weights,
            # The attention over the cache: the causal rule is in its (B, T)
            # lengths (docs: "Fast paths").
            plan=spec.plan_kernel(
                SEQUENCE_MASK,
                sizes=(batch, num_new, max_length),
                lens_ndim=2 if appends and causal else 1,
                causal=False,
                dropout=self.dropout > 0,
                return_attention_weights=return_attention_weights,
                grouped=self._heads.grouped,
            ),
            cached=True,
            appends=appends,
            head_mask_ndim=None if gates is None else gates.ndim,
        )
        out = self._run(config, (queries, keys, values, lens, *cache[:2], lengths, gates))
        out = tuple(out) if isinstance(out, (list, tuple)) else (out,)
        if appends:
            return (*out[:-3], spec.KVCache(*out[-3:]))
        if mx.autograd.is_recording():
            # W_k and W_v had no part in this call: their gradient is zero,
            # not what an earlier backward pass left there.
            unused = self._parameter_arrays(queries.ctx, None, None, None, projections=("k", "v"))
            out = (sum((_zero_link(x) for x in unused), out[0]), *out[1:])
        return (*out, spec.KVCache(cache.keys, cache.values, lengths))

    def _gates(self, head_mask: Any, queries: Any) -> Any:
        """``head_mask`` checked (docs: "Heads") and cast to the layer's dtype; ``None`` stays.

        The cast is recorded by ``autograd``, so a mask of another dtype gets
        its gradient in its own dtype; each graph takes the layer's.

        Raises:
            TypeError: not an ``mxnet.numpy.ndarray``, or not floating.
            ValueError: not ``(num_heads,)`` or ``(B, num_heads)``, or on
                another device than the queries.
        """
        if head_mask is None:
            return None
        if not isinstance(head_mask, mx.np.ndarray):
            hint = " (use .as_np_ndarray())" if isinstance(head_mask, mx.nd.NDArray) else ""
            raise TypeError(
                f"head_mask must be an mxnet.numpy.ndarray{hint}; got {type(head_mask).__name__}"
            )
        spec.check_head_mask(
            head_mask.shape,
            dtype_kind(head_mask.dtype),
            num_heads=self.num_heads,
            batch=queries.shape[0],
        )
        if head_mask.ctx != queries.ctx:
            raise ValueError(f"head_mask is on {head_mask.ctx} but queries on {queries.ctx}")
        if np.dtype(head_mask.dtype) == self.dtype:
            return head_mask
        return head_mask.astype(self.dtype)

    def _run(self, config: _Config, inputs: tuple[Any, ...]) -> Any:
        """The configuration's graph on ``inputs`` (``None`` for an absent one)."""
        graph = self._graph(config)
        given = [x for x in inputs if x is not None]
        graph.input_dtypes = {f"data{i}": np.dtype(x.dtype).name for i, x in enumerate(given)}
        graph.input_shapes = {f"data{i}": x.shape for i, x in enumerate(given)}
        while inputs and inputs[-1] is None:
            inputs = inputs[:-1]
        out = graph(*inputs)
        self._graphs.last = graph
        return out

    def _empty_attention(
        self,
        queries: Any,
        keys: Any,
        values: Any,
        num_keys: int,
        return_attention_weights: bool,
        head_mask: Any = None,
    ) -> Any:
        """The spec's result when ``B``, ``Q`` or ``K`` is 0, built from shapes.

        With no keys every query's context is empty (zero), so the output is
        ``b_o`` broadcast (zeros without bias) and the weights are
        ``(B, H, Q, 0)``; with no queries or no batch everything is empty.
        Every input and parameter is linked into the result with a zero
        contribution, so that a backward pass writes them zero gradients of
        their own shapes (and ``b_o`` the sum of the output's gradient), as
        the reference does, instead of leaving earlier gradients in place.
        ``keys`` and ``values`` may be ``None`` (a cached call without them);
        ``num_keys`` is ``K``, or a cache's ``max_length``. A ``head_mask``
        gates a zero context: its gradient is zero too.
        """
        ctx, dtype = queries.ctx, self.dtype
        batch, num_queries = queries.shape[0], queries.shape[1]
        parameters = self._parameter_arrays(ctx, queries, keys, values)
        output = mx.np.zeros((batch, num_queries, self.num_hiddens), dtype=dtype, ctx=ctx)
        if self.bias and output.size:
            output = output + self.W_o.bias.data(ctx)
        if mx.autograd.is_recording():
            for x in (queries, keys, values, head_mask, *parameters):
                if x is not None:
                    output = output + _zero_link(x)
        if not return_attention_weights:
            return output
        weights_shape = (batch, self.num_heads, num_queries, num_keys)
        return output, mx.np.zeros(weights_shape, dtype=dtype, ctx=ctx)

    def _parameter_arrays(
        self,
        ctx: mx.Context,
        queries: Any,
        keys: Any,
        values: Any,
        *,
        projections: tuple[str, ...] = _PROJECTIONS,
    ) -> list[Any]:
        """The parameters' arrays on ``ctx``; deferred sizes fixed by the inputs.

        A parameter whose size is deferred and no input fixes (``keys`` or
        ``values`` ``None``) has no value yet, and is left out.
        """
        inputs = {"q": queries, "k": keys, "v": values, "o": None}
        arrays = []
        for name in projections:
            dense, x = getattr(self, f"W_{name}"), inputs[name]
            for parameter in (dense.weight, dense.bias):
                if parameter is None:
                    continue
                if x is not None and parameter is dense.weight and _in_units(dense) is None:
                    # Gluon's deferred initialization, which a graph call would do.
                    parameter.shape = (parameter.shape[0], x.shape[2])
                    parameter._finish_deferred_init()
                if x is None and parameter._deferred_init:
                    continue  # its size is still unknown, so it has no value
                arrays.append(parameter.data(ctx))
        return arrays

    def _graph(self, config: _Config) -> _AttentionGraph:
        graph = self._graphs.by_config.get(config)
        if graph is None:
            shared = {}
            # A cached call without keys projects none: W_k and W_v stay out
            # of its graph (Gluon would warn, or wait for their sizes).
            used = ("q", "o") if config.cached and not config.appends else _PROJECTIONS
            for name in used:
                dense = getattr(self, f"W_{name}")
                shared[f"W_{name}_weight"] = dense.weight
                if self.bias:
                    shared[f"W_{name}_bias"] = dense.bias
            graph = _AttentionGraph(
                config,
                num_hiddens=self.num_hiddens,
                heads=self._heads,
                dropout=self.dropout,
                prefix=self.prefix,
                params=self.collect_params(),
                shared=shared,
            )
            if self._hybridize_args is not None:
                args, kwargs = self._hybridize_args
                graph.hybridize(*args, **kwargs)
            self._graphs.by_config[config] = graph
        return graph


def _zero_link(x: Any) -> Any:
    """A 0-d zero whose gradient to ``x`` is zeros of ``x``'s shape, whatever ``x`` holds.

    ``0 * x`` would be NaN where ``x`` is not finite.
    """
    return mx.np.zeros_like(x).sum()


def _in_units(dense: nn.Dense) -> int | None:
    size = dense.weight.shape[1]
    return int(size) if size > 0 else None


def _check_array(name: str, array: Any, dtype: np.dtype) -> None:
    if isinstance(array, mx.sym.Symbol):
        raise TypeError(
            f"{name} is a Symbol: MultiHeadAttention runs on concrete arrays, because MXNet "
            "1.9 symbols have no dtype or rank and the masks depend on them; hybridize the "
            "layer itself instead of tracing it inside another block's hybrid_forward"
        )
    if not isinstance(array, mx.np.ndarray):
        hint = " (use .as_np_ndarray())" if isinstance(array, mx.nd.NDArray) else ""
        raise TypeError(f"{name} must be an mxnet.numpy.ndarray{hint}; got {type(array).__name__}")
    if dtype_kind(array.dtype) != "f":
        raise TypeError(f"{name} must be a floating-point array; got {np.dtype(array.dtype)}")
    if np.dtype(array.dtype) != dtype:
        raise TypeError(
            f"{name} dtype {np.dtype(array.dtype)} differs from the layer's parameter dtype "
            f"{dtype}; convert one of them (e.g. layer.cast({np.dtype(array.dtype).name!r}))"
        )


def _check_cache(cache: Any, ctx: mx.Context, dtype: np.dtype) -> spec.KVCache:
    """``cache`` as a ``KVCache`` of ``mxnet.numpy`` arrays on ``ctx``; keys, values of ``dtype``.

    Raises:
        TypeError: not a triple of ``mxnet.numpy`` arrays, or keys or values
            of another dtype.
        ValueError: an array on another device.
    """
    if not isinstance(cache, tuple) or len(cache) != 3:
        raise TypeError(
            "cache must be a KVCache(keys, values, lengths), as layer.init_cache makes it; "
            f"got {type(cache).__name__}"
        )
    cache = spec.KVCache(*cache)
    for name, array in zip(spec.KVCache._fields, cache, strict=True):
        if not isinstance(array, mx.np.ndarray):
            raise TypeError(
                f"cache.{name} must be an mxnet.numpy.ndarray; got {type(array).__name__}"
            )
        if array.ctx != ctx:
            raise ValueError(f"cache.{name} is on {array.ctx} but queries on {ctx}")
    for name, array in (("keys", cache.keys), ("values", cache.values)):
        if np.dtype(array.dtype) != dtype:
            raise TypeError(
                f"cache.{name} dtype {np.dtype(array.dtype)} differs from the layer's parameter "
                f"dtype {dtype}; make the cache with layer.init_cache"
            )
    return cache


def _as_int32(array: mx.np.ndarray) -> mx.np.ndarray:
    return array if np.dtype(array.dtype) == np.int32 else array.astype(np.int32)


def _as_lens(valid_lens: Any, ctx: mx.Context) -> mx.np.ndarray | None:
    if valid_lens is None:
        return None
    if isinstance(valid_lens, mx.nd.NDArray):
        lens = valid_lens if isinstance(valid_lens, mx.np.ndarray) else valid_lens.as_np_ndarray()
        spec.check_valid_lens_dtype(dtype_kind(lens.dtype))
        return lens.as_in_ctx(ctx)
    # MXNet has no unsigned integers beyond uint8; any length past int32's
    # range means what int32's bound means (key counts fit in it).
    array = spec.lens_as_numpy(valid_lens, np.int32)
    return mx.np.array(array, dtype=array.dtype, ctx=ctx)


def _initialized(parameter: gluon.Parameter) -> bool:
    try:
        parameter.data()
    except (gluon.parameter.DeferredInitializationError, RuntimeError):
        return False
    return True


def _load(parameter: gluon.Parameter, array: np.ndarray, ctx: mx.Context | None) -> None:
    if not _initialized(parameter):
        try:
            contexts = parameter.list_ctx()  # deferred initialization keeps its devices
        except RuntimeError:
            contexts = [ctx or mx.context.current_context()]
        parameter.shape = array.shape
        # Zeros, not the default random initializer: the values are replaced
        # at once, and MXNet 1.9's numpy uniform sampler rejects float64 outputs.
        parameter.initialize(init=mx.init.Zero(), ctx=contexts, force_reinit=True)
    parameter.set_data(mx.np.array(array, dtype=parameter.dtype))


def set_weights(
    layer: MultiHeadAttention, weights: Mapping[str, Any], *, ctx: mx.Context | None = None
) -> MultiHeadAttention:
    """Loads canonical weights into ``layer`` (strict) and returns it.

    Entries may be numpy arrays, ``mxnet.numpy`` arrays or legacy
    ``mxnet.nd`` arrays, on any device.

    Deferred input sizes are fixed by the weights. Parameters not initialized
    yet are created on ``ctx`` (default: the current context); initialized
    ones keep their devices. Values are converted to the parameters' dtype.

    Raises:
        ValueError: a missing, extra or mis-shaped entry, named.
    """
    if isinstance(weights, Mapping):
        # numpy would wrap an MXNet array as a 0-d object array, not read it.
        weights = {name: host_array(value) for name, value in weights.items()}
    arrays, _ = check_weights(
        weights,
        num_hiddens=layer.num_hiddens,
        bias=layer.bias,
        **asdict(layer._heads),  # num_heads, num_kv_heads, head_dim
        **layer.input_sizes(),
    )
    for name, array in arrays.items():
        dense = getattr(layer, f"W_{name[-1]}")
        if name in KERNEL_NAMES:
            _load(dense.weight, np.ascontiguousarray(array.T), ctx)
        else:
            _load(dense.bias, array, ctx)
    return layer


def get_weights(layer: MultiHeadAttention) -> dict[str, np.ndarray]:
    """The canonical weights of ``layer`` as numpy arrays (the parameters' dtype).

    Raises:
        ValueError: some input size is still deferred (call the layer once,
            or pass ``query_size``/``key_size``/``value_size``).
        RuntimeError: the parameters are not initialized.
    """
    lazy = [name for name, size in layer.input_sizes().items() if size is None]
    if lazy:
        raise ValueError(
            f"{', '.join(lazy)} not known yet: call the layer once or pass them to the constructor"
        )
    weights = {}
    for name in KERNEL_NAMES:
        dense = getattr(layer, name)
        weights[name] = np.ascontiguousarray(host_array(dense.weight).T)
        if layer.bias:
            weights[f"b_{name[-1]}"] = host_array(dense.bias)
    return weights


def head_importance(
    layer: MultiHeadAttention,
    batches: Iterable[tuple[Any, Any, Any, Any]],
    loss_fn: Callable[[Any], Any],
    *,
    normalize: bool = True,
) -> np.ndarray:
    """How much each head matters to ``loss_fn`` (docs: "Heads"; Michel, Levy & Neubig 2019).

    ``I_h`` is the mean over the batches of ``|dL/dξ_h|``, the gradient of
    the loss with respect to head ``h``'s gate (``head_mask``) at gates of
    ones, out of training mode (no dropout); with ``normalize`` it is divided
    by its L2 norm over the heads (gradients all zero give zeros). Only the
    gates' gradients are taken: the parameters' ``grad`` are left as they are.

    Args:
        layer: the layer, initialized (or with deferred sizes the first
            batch fixes), imperative or hybridized.
        batches: yields ``(queries, keys, values, valid_lens)``, as the
            layer's call takes them.
        loss_fn: ``output -> loss``, a scalar ``mxnet.numpy`` array built
            from the output with MXNet operations.
        normalize: divide by the L2 norm over the heads.

    Returns:
        float64 numpy ``(num_heads,)``.

    Raises:
        ValueError: ``batches`` yields nothing.
        TypeError: ``loss_fn`` does not return a scalar ``mxnet.numpy`` array;
            and the layer's errors for the batches.
    """
    gradients = [
        head_mask_gradient(layer, queries, keys, values, valid_lens, loss_fn)
        for queries, keys, values, valid_lens in batches
    ]
    if not gradients:
        raise ValueError("batches yielded no batch: head importance needs at least one")
    return importance(gradients, normalize=normalize)

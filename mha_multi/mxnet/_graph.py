"""The MXNet layer's hybridized graphs: one ``HybridBlock`` per call configuration.

MXNet 1.9 builds one static graph per ``HybridBlock``, from positional
arrays only, and its symbols have neither shape nor dtype. The layer
therefore checks a call on the concrete arrays it is given
(:func:`mha_multi.call.forward`), makes the call's kernel plan there, where
shapes are known (:func:`configure`), and hands the arrays to a private
graph block built for that call's *configuration*: device type, dtype,
whether ``valid_lens`` is given and its rank and dtype, ``causal``,
``return_attention_weights``, the plan, the cache and the gates' rank. The
graph runs :func:`mha_multi.call.attend` with that plan. The graph blocks
share the layer's parameters (Gluon's ``params=`` sharing), are hybridized
with it, and each keeps its own cached graph, so alternating configurations
never rebuild a graph.

A call with a key/value cache (docs: "Generating with a cache") is one more
configuration: the cache's three arrays are graph inputs and, when the call
appends, the new cache's three arrays graph outputs (the spec's functional
update), so one graph serves a prefill and every decoding step (MXNet's
cached graph takes each new length as it comes). That graph serves recorded
calls and :meth:`~mha_multi.mxnet.MultiHeadAttention.export`. A cached call
that records nothing writes its rows into the cache's own arrays outside
the graphs and attends in the graph of a call without keys, over the filled
positions (:func:`write_in_place`); a plain decoding step runs its signature's
plan instead, as an imperative layer's (:mod:`mha_multi.mxnet._plain`), and
leaves ``export`` the shapes of its functional graph. A ``head_mask`` (docs: "Heads") is the
graph's last input.

An imperative call runs the same computation (:func:`compute`) on the
parameters' arrays: the graph runs the imperative code's operations, to the
bit. The exception is an imperative cached call that records nothing: it
writes the cache in place and attends over the filled positions, through
:func:`mha_multi.call.attend` (see :func:`run`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import mxnet as mx
import numpy as np
from mxnet import gluon

from mha_multi import call, spec
from mha_multi.mxnet._facts import FACTS, as_int32, gates_dtype
from mha_multi.mxnet._kernel import weights_dropout
from mha_multi.mxnet._ops import MXNetOps
from mha_multi.mxnet._projections import (
    PROJECTIONS,
    Projections,
    empty_attention,
    parameter_arrays,
    zero_link,
)

__all__ = ["AttentionGraph", "Config", "Graphs", "compute", "configure", "new_positions", "run"]

Array = Any
#: A call's arrays, as a graph takes them: queries, keys, values,
#: valid_lens, the cache's keys, values and lengths, and the gates (``None``
#: where absent).
Inputs = tuple[Any, ...]
#: :data:`Inputs` as ``(shape, dtype)`` pairs (``None`` where absent): what a graph
#: is traced and exported for, without the arrays.
Shapes = tuple[tuple[tuple[int, ...], Any] | None, ...]


@dataclass(frozen=True)
class Config:
    """What a graph is built for; everything else is a runtime input."""

    device_type: str
    dtype: np.dtype
    lens_ndim: int | None  # None: no valid_lens
    lens_dtype: np.dtype | None
    causal: bool
    return_attention_weights: bool
    plan: spec.KernelPlan  # the SequenceMask route, or spec.attention where not fused
    cached: bool = False  # a call with a key/value cache (the cache's arrays are inputs)
    appends: bool = False  # a cached call given new keys and values
    head_mask_ndim: int | None = None  # None: no head_mask; else 1 (H,) or 2 (B, H), an input
    #: A cached call's attended lengths: 1 ``(B,)``, or 2 ``(B, T)`` where a
    #: causal chunk was written in place and its rule is in the lengths.
    held_ndim: int = 1

    @property
    def projections(self) -> tuple[str, ...]:
        """The projections the call uses: a cached call without keys projects none."""
        return ("q", "o") if self.cached and not self.appends else PROJECTIONS


class _Lengths(NamedTuple):
    """What :func:`mha_multi.call.plan` reads of lengths: their shape and dtype."""

    shape: tuple[int, ...]
    dtype: Any


def configure(
    layer: gluon.HybridBlock, inputs: Inputs, *, causal: bool, return_attention_weights: bool
) -> Config:
    """The configuration of a checked call, with its kernel plan (:func:`mha_multi.call.plan`).

    Args:
        layer: the layer (its heads, dtype and dropout).
        inputs: the checked call's arrays; with a cache, ``valid_lens``
            ``(B,)`` int32 where it appends, and the cache's lengths int32.
        causal, return_attention_weights: the call's flags.
    """
    queries, keys, values, valid_lens, cache_keys, cache_values, cache_lengths, gates = inputs
    options = {
        "heads": layer.heads,
        "dropout": layer.dropout > 0,
        "return_attention_weights": return_attention_weights,
    }
    common = {
        "device_type": queries.ctx.device_type,
        "dtype": layer.dtype,
        "return_attention_weights": return_attention_weights,
        "head_mask_ndim": None if gates is None else gates.ndim,
    }
    if cache_keys is None:
        plan = call.plan(
            FACTS, queries, keys, values, valid_lens, causal=causal, kv_split=False, **options
        )
        return Config(
            lens_ndim=None if valid_lens is None else valid_lens.ndim,
            lens_dtype=None if valid_lens is None else np.dtype(valid_lens.dtype),
            causal=causal,
            plan=plan,
            **common,
        )
    appends = keys is not None
    causal = causal and appends  # without new positions, nothing is causal
    # The attention over the cache: the causal rule is in the lengths
    # spec.update_cache gives, (B, T) when causal, else (B,). A call without
    # keys attends with the cache's lengths as given: (B,), or the (B, T)
    # visibility of rows written in place before the graph (write_in_place).
    held_ndim = cache_lengths.ndim
    attended = _Lengths(queries.shape[:2] if causal else cache_lengths.shape, np.int32)
    plan = call.plan(
        FACTS, queries, cache_keys, cache_values, attended, causal=False, kv_split=True, **options
    )
    return Config(
        lens_ndim=1 if appends else None,
        lens_dtype=np.dtype(np.int32) if appends else None,
        causal=causal,
        plan=plan,
        cached=True,
        appends=appends,
        held_ndim=held_ndim,
        **common,
    )


def new_positions(ops: MXNetOps, keys: Array, valid_lens: Array) -> Array:
    """``valid_lens`` clipped to ``[0, T]``: the call's positions each example keeps.

    Counted as the positions ``t < valid_lens[b]``, which needs no concrete
    ``T``: an exported graph, which runs without the layer's checks, still
    never writes more positions than the call has, nor a negative number
    (which would let the next call overwrite kept positions).
    """
    positions = ops.expand_dims(ops.arange(ops.size(keys, 1)), 0)  # (1, T)
    kept = ops.less(positions, ops.expand_dims(valid_lens, 1))  # (B, T)
    return ops.np.sum(kept.astype(np.int32), axis=1).astype(np.int32)


def compute(
    ops: MXNetOps,
    params: Mapping[str, Array],
    config: Config,
    inputs: Inputs,
    *,
    heads: spec.Heads,
    num_hiddens: int,
    dropout: float,
) -> tuple[Array, ...]:
    """A configuration's computation: :func:`mha_multi.call.attend` with its plan.

    On arrays (an imperative call) or on symbols (a graph being traced).

    Args:
        ops: the adapter of the arrays or symbols.
        params: ``W_q_weight``... (:class:`~mha_multi.mxnet._projections.Projections`).
        config: the call's configuration.
        inputs: the call's arrays or the graph's symbols, ``None`` where absent.
        heads, num_hiddens, dropout: the layer's.

    Returns:
        The output; the weights if the configuration returns them; the
        cache's keys, values and lengths if it appends.
    """
    queries, keys, values, valid_lens, *held, head_mask = inputs
    cache = None
    if config.cached:
        cache = spec.KVCache(*held)
        if config.appends:
            valid_lens = new_positions(ops, keys, valid_lens)
    projections = Projections(ops, params, heads=heads, num_hiddens=num_hiddens, dtype=config.dtype)
    result = call.attend(
        FACTS,
        projections,
        ops,
        queries,
        keys,
        values,
        valid_lens,
        cache=cache,
        gates=head_mask,
        causal=config.causal,
        return_attention_weights=config.return_attention_weights,
        dropout=weights_dropout(ops, dropout),
        dropout_rate=dropout,
        kernel_plan=config.plan,
    )
    outputs = (result.output,)
    if config.return_attention_weights:
        outputs += (result.weights,)
    if config.appends:
        outputs += tuple(result.cache)
    return outputs


class AttentionGraph(gluon.HybridBlock):
    """The layer's computation for one configuration, on shared parameters."""

    def __init__(
        self,
        config: Config,
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
        self._layout = {"heads": heads, "num_hiddens": num_hiddens, "dropout": dropout}
        #: The arrays of the call being run, in the graph's input order: a
        #: trace reads their dtypes and shapes.
        self.arrays: list[Array] = []
        with self.name_scope():
            for name, parameter in shared.items():
                found = self.params.get(name)
                if found is not parameter:
                    raise RuntimeError(f"parameter {parameter.name!r} could not be shared")
                setattr(self, name, found)

    def hybrid_forward(self, F: Any, *inputs: Any, **params: Any) -> Any:
        """:func:`compute` on the graph's inputs (:data:`Inputs`, trailing ``None`` left out)."""
        # Symbols (a graph being traced) get the traced call's input dtypes
        # and shapes, by Gluon's input names: MXNet 1.9 symbols carry neither.
        names = [f"data{i}" for i in range(len(self.arrays))]
        ops = MXNetOps(
            F,
            input_dtypes={name: x.dtype for name, x in zip(names, self.arrays, strict=True)},
            input_shapes={name: x.shape for name, x in zip(names, self.arrays, strict=True)},
        )
        inputs = (*inputs, *(None,) * (8 - len(inputs)))
        outputs = compute(ops, params, self._config, inputs, **self._layout)
        return outputs if len(outputs) > 1 else outputs[0]


class Graphs:
    """A layer's graph blocks, by configuration, and how they are hybridized.

    A plain dict attribute holding blocks would make Gluon warn about an
    unregistered container; these blocks are deliberately not children, so
    that the layer's parameter names stay d2l's.
    """

    def __init__(self, hybridize_args: tuple[tuple[Any, ...], dict[str, Any]] | None) -> None:
        self.by_config: dict[Config, AttentionGraph] = {}
        #: The graph of the most recent call (what ``export`` writes).
        self.last: AttentionGraph | None = None
        #: ``hybridize``'s arguments, for graphs built later; ``None`` before.
        self.hybridize_args = hybridize_args
        #: The most recent call, where it wrote a cache in place outside the
        #: graphs: its inputs' shapes and dtypes, device and flags (:meth:`stand_in`).
        self.standing: tuple[Shapes, mx.Context, dict[str, bool]] | None = None
        #: Why the most recent call ran outside the graphs, where it did (:meth:`ran_without`):
        #: it has no graph to export.
        self.graphless: str | None = None

    def hybridize(self, *args: Any, **kwargs: Any) -> None:
        """Gluon's ``hybridize`` of every graph, built or to be built."""
        self.hybridize_args = (args, kwargs)
        for graph in self.by_config.values():
            graph.hybridize(*args, **kwargs)

    def run(self, layer: gluon.HybridBlock, config: Config, inputs: Inputs) -> Any:
        """The configuration's graph on ``inputs``."""
        graph = self._graph(layer, config)
        graph.arrays = [x for x in inputs if x is not None]
        while inputs and inputs[-1] is None:
            inputs = inputs[:-1]
        try:
            out = graph(*inputs)
        finally:
            graph.arrays = []  # not kept alive by the graph
        self.last = graph
        self.standing = self.graphless = None
        return out

    def ran_without(self, reason: str) -> None:
        """Notes a call that ran outside the graphs, on the parameters' arrays: the
        most recent call has no graph (:meth:`exportable` gives none)."""
        self.last = self.standing = None
        self.graphless = reason

    def stand_in(self, shapes: Shapes, ctx: mx.Context, **flags: bool) -> None:
        """Notes a cached call made outside one graph (:func:`write_in_place`, or a
        hybridized layer's decoding step by its plan, :mod:`mha_multi.mxnet._plain`),
        for export.

        Args:
            shapes: the call's inputs as its functional graph takes them
                (:meth:`functional_inputs`).
            ctx: their device.
            flags: the call's ``causal`` and ``return_attention_weights``.
        """
        self.standing = (shapes, ctx, flags)
        self.graphless = None

    @staticmethod
    def functional_inputs(
        queries: Array, keys: Array, values: Array, cache: spec.KVCache, gates: Array | None
    ) -> Shapes:
        """The inputs of an appending cached call's functional graph, as ``(shape, dtype)``
        (:data:`Inputs`' order, ``None`` for gates it has not): the queries, keys and
        values, int32 ``valid_lens`` ``(B,)`` (:func:`run` makes them for every such
        call), the cache's keys and values, its lengths in int32."""
        batch = (queries.shape[0],)
        int32 = np.dtype(np.int32)
        arrays = ((x.shape, x.dtype) for x in (queries, keys, values))
        held = ((x.shape, x.dtype) for x in cache[:2])
        gated = None if gates is None else (gates.shape, gates.dtype)
        return (*arrays, (batch, int32), *held, (batch, int32), gated)

    def exportable(self, layer: gluon.HybridBlock) -> AttentionGraph | None:
        """The graph of the most recent call: a call that wrote in place gets its functional one.

        That graph is traced, and run once on zeros of the call's shapes,
        here (Gluon exports only a graph that ran).
        """
        if self.standing is not None:
            shapes, ctx, flags = self.standing
            inputs = tuple(
                None if found is None else mx.np.zeros(found[0], dtype=found[1], ctx=ctx)
                for found in shapes
            )
            self.run(layer, configure(layer, inputs, **flags), inputs)
        return self.last

    def _graph(self, layer: gluon.HybridBlock, config: Config) -> AttentionGraph:
        graph = self.by_config.get(config)
        if graph is None:
            shared = {}
            # W_k and W_v stay out of a graph that does not use them (Gluon
            # would warn, or wait for their sizes).
            for name in config.projections:
                dense = getattr(layer, f"W_{name}")
                shared[f"W_{name}_weight"] = dense.weight
                if layer.bias:
                    shared[f"W_{name}_bias"] = dense.bias
            graph = AttentionGraph(
                config,
                num_hiddens=layer.num_hiddens,
                heads=layer.heads,
                dropout=layer.dropout,
                prefix=layer.prefix,
                params=layer.collect_params(),
                shared=shared,
            )
            if self.hybridize_args is not None:
                args, kwargs = self.hybridize_args
                graph.hybridize(*args, **kwargs)
            self.by_config[config] = graph
        return graph


def run(
    facts: call.Facts,
    layer: gluon.HybridBlock,
    ops: MXNetOps,
    queries: Array,
    keys: Array | None,
    values: Array | None,
    valid_lens: Array | None,
    *,
    cache: spec.KVCache | None,
    gates: Array | None,
    causal: bool,
    return_attention_weights: bool,
    dropout: Any = None,
    dropout_rate: float = 0.0,
    head_parallel: bool = False,
    layer_options: spec.LayerOptions | None = None,
    positions: Array | None = None,
    bias: Array | None = None,
    fill: spec.CacheFill | None = None,
    segment_ids: tuple[Array, Array] | None = None,
) -> call.Result:
    """A checked call of ``layer``, given as :func:`mha_multi.call.attend` takes it.

    Planned here (:func:`configure`), then computed in the configuration's
    graph where the layer is hybridized (Gluon's ``_active``), else on the
    parameters' arrays (:func:`compute`); dropout is the layer's own
    (``dropout``, ``dropout_rate`` and ``head_parallel`` are not read). What
    MXNet adds: a cache's lengths and a cached call's ``valid_lens`` (``T``
    by default) in int32, the graphs' one integer type (every length fits
    in it, checked); the gates in the layer's dtype, float32 for a 16-bit
    layer (the cast is recorded, so their gradient keeps their own); empty axes answered from shapes
    (:func:`mha_multi.mxnet._projections.empty_attention`); and zero
    gradients for ``W_k`` and ``W_v`` from a cached call that used neither.

    A cached call that records no gradient writes its rows into the given
    cache's arrays and attends over the filled positions (``fill``, the
    lengths read on the host; docs: "Generating with a cache"): imperative,
    through :func:`mha_multi.call.attend` on the parameters' arrays;
    hybridized, in a graph (:func:`write_in_place`). A recorded call updates
    the cache functionally.
    """
    batch, num_queries = queries.shape[:2]
    appends = keys is not None
    if cache is not None:
        cache = cache._replace(lengths=as_int32(cache.lengths))
        if appends:
            if valid_lens is None:
                valid_lens = mx.np.full((batch,), num_queries, dtype=np.int32, ctx=queries.ctx)
            valid_lens = as_int32(valid_lens)
    if gates is not None and np.dtype(gates.dtype) != gates_dtype(layer.dtype):
        gates = gates.astype(gates_dtype(layer.dtype))
    num_keys = keys.shape[1] if cache is None else cache.keys.shape[2]
    if 0 in (batch, num_queries, num_keys):
        layer._graphs.ran_without("it had an empty batch, queries or keys, which no graph runs")
        output, weights = empty_attention(layer, queries, keys, values, num_keys, gates)
        return call.Result(output, weights if return_attention_weights else None, cache)
    in_place = fill is not None and appends and not mx.autograd.is_recording()
    scored = (
        positions is not None
        or bias is not None
        or layer_options is not None
        or segment_ids is not None
    )
    if in_place and layer._active and not scored:
        flags = {"causal": causal, "return_attention_weights": return_attention_weights}
        return write_in_place(
            layer, ops, queries, keys, values, valid_lens, cache, gates, fill, **flags
        )
    if in_place or scored:
        # Positions and biases run on the parameters' arrays, hybridized or
        # not: MXNet graphs take no host constants (the angles' frequencies,
        # the ALiBi slopes). So does an imperative call that writes in place.
        if scored:
            layer._graphs.ran_without(
                "its positions, bias, segment_ids or layer options (rotary, alibi, window, "
                "softcap, sinks, qk_norm) run on the parameters' arrays, with no graph"
            )
        used = PROJECTIONS if keys is not None else ("q", "o")
        params = parameter_arrays(layer, queries.ctx, queries, keys, values, projections=used)
        layout = {"heads": layer.heads, "num_hiddens": layer.num_hiddens, "dtype": layer.dtype}
        return call.attend(
            facts,
            Projections(ops, params, **layout),
            ops,
            queries,
            keys,
            values,
            valid_lens,
            cache=cache,
            gates=gates,
            causal=causal,
            return_attention_weights=return_attention_weights,
            dropout=weights_dropout(ops, layer.dropout),
            dropout_rate=layer.dropout,
            layer_options=layer_options,
            positions=positions,
            bias=bias,
            fill=fill if in_place else None,
            segment_ids=segment_ids,
        )
    held = (None,) * 3 if cache is None else tuple(cache)
    inputs = (queries, keys, values, valid_lens, *held, gates)
    flags = {"causal": causal, "return_attention_weights": return_attention_weights}
    config = configure(layer, inputs, **flags)
    if layer._active:
        out = layer._graphs.run(layer, config, inputs)
        out = tuple(out) if isinstance(out, (list, tuple)) else (out,)
    else:
        params = parameter_arrays(
            layer, queries.ctx, queries, keys, values, projections=config.projections
        )
        layout = {"heads": layer.heads, "num_hiddens": layer.num_hiddens, "dropout": layer.dropout}
        out = compute(ops, params, config, inputs, **layout)
    if config.appends:
        keys_out, values_out, lengths_out = out[-3:]
        # (The lengths count positions: no gradient flows through them, and a graph's
        # integer outputs must carry none into the next recorded call's backward pass,
        # where MXNet 1.9's integer operations refuse one.)
        cache = spec.KVCache(keys_out, values_out, lengths_out.detach())
    elif cache is not None and mx.autograd.is_recording():
        # W_k and W_v had no part in this call: their gradient is zero,
        # not what an earlier backward pass left there.
        unused = parameter_arrays(layer, queries.ctx, None, None, None, projections=("k", "v"))
        out = (sum((zero_link(x) for x in unused.values()), out[0]), *out[1:])
    return call.Result(out[0], out[1] if return_attention_weights else None, cache)


def write_in_place(
    layer: gluon.HybridBlock,
    ops: MXNetOps,
    queries: Array,
    keys: Array,
    values: Array,
    valid_lens: Array,
    cache: spec.KVCache,
    gates: Array | None,
    fill: spec.CacheFill,
    *,
    causal: bool,
    return_attention_weights: bool,
) -> call.Result:
    """A hybridized layer's appending cached call that records nothing.

    The new keys and values are projected and written into the given
    cache's own arrays by slice assignment (``FACTS.write_cache``, as an
    imperative call writes them), outside any graph; then the graph of a
    call without keys attends over the filled positions, rounded up to
    :data:`mha_multi.spec.SPAN_BUCKET` (:meth:`mha_multi.spec.CacheFill.span`;
    all ``max_length`` when the weights are returned), with the lengths each
    query sees, the causal rule in them. MXNet's cached graph takes each
    span as it comes: a decoding loop traces at most two graphs, one for
    ``(B,)`` and one for ``(B, T)`` lengths. The returned cache shares
    ``keys`` and ``values`` with the given one.

    :meth:`Graphs.export` still writes the functional graph of such a call
    (:meth:`Graphs.stand_in`): an exported graph cannot write in place.
    """
    heads = layer.heads
    params = parameter_arrays(layer, queries.ctx, None, keys, values, projections=("k", "v"))
    projections = Projections(
        ops, params, heads=heads, num_hiddens=layer.num_hiddens, dtype=layer.dtype
    )
    k, v = projections.project_new(keys, values)
    written, visible = FACTS.write_cache(
        ops, cache, k, v, valid_lens, head_dim=heads.head_dim, causal=causal, fill=fill
    )
    del k, v  # in the cache now: not kept alive while the graph runs
    held_keys, held_values = written.keys, written.values
    if not return_attention_weights:
        held_keys, held_values, _ = call.attended_positions(
            FACTS, held_keys, held_values, fill, queries.shape[1]
        )
    inputs = (queries, None, None, None, held_keys, held_values, visible, gates)
    flags = {"causal": False, "return_attention_weights": return_attention_weights}
    out = layer._graphs.run(layer, configure(layer, inputs, **flags), inputs)
    out = tuple(out) if isinstance(out, (list, tuple)) else (out,)
    layer._graphs.stand_in(
        Graphs.functional_inputs(queries, keys, values, cache, gates),
        queries.ctx,
        causal=causal,
        return_attention_weights=return_attention_weights,
    )
    return call.Result(out[0], out[1] if return_attention_weights else None, written)

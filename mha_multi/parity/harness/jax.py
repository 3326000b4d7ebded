"""What drives the NNX and Linen layers: building them, calls, gradients, the kernel spy.

The parity runners, the benchmark and the tests reach JAX through this
module (docs: "Architecture"). :func:`make_layer` builds the NNX layer and
:func:`linen_layer` the Linen one; :func:`forward` and :func:`vjp` take
either. It sits above the layers: it imports them and
:mod:`mha_multi.jax._facts` (JAX's facts, whose public names are read
through this module too: ``harness.to_numpy``), and nothing in
:mod:`mha_multi.jax` imports it.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mha_multi import spec
from mha_multi.call import INPUT_NAMES
from mha_multi.interop.jax import to_flax_nnx
from mha_multi.jax import _facts, _kernel, linen
from mha_multi.jax._facts import DTYPES
from mha_multi.jax.layer import MultiHeadAttention
from mha_multi.parity.harness import KernelCall, facts_passthrough
from mha_multi.weights import KERNEL_NAMES, NORM_NAMES, SINKS_NAME

__all__ = [
    "INPUT_NAMES",
    "LinenLayer",
    "forward",
    "init_cache",
    "kernel_spy",
    "linen_layer",
    "make_layer",
    "native_layer",
    "vjp",
]

__getattr__ = facts_passthrough(__name__, _facts)


# -- layers: construction, one call, one vector-Jacobian product ----------------


def make_layer(
    num_hiddens: int,
    num_heads: int,
    *,
    device: str = "cpu",
    dtype: str = "float32",
    **kwargs: Any,
) -> MultiHeadAttention:
    """Our NNX layer with ``dtype`` parameters on ``device`` (``nnx.Rngs(0)``).

    ``kwargs`` are the layer's (``dropout``, ``bias``, sizes,
    ``implementation``...). It starts in NNX's default mode, training;
    :func:`forward` sets the mode of each call.
    """
    with jax.default_device(_facts.device(device)):
        return MultiHeadAttention(
            num_hiddens, num_heads, param_dtype=DTYPES[dtype], rngs=nnx.Rngs(0), **kwargs
        )


@dataclass
class LinenLayer:
    """A Linen module with its variables, device and the rng its dropout draws from."""

    module: linen.MultiHeadAttention
    variables: dict[str, Any] | None
    device: jax.Device
    rng: jax.Array

    def next_rng(self) -> jax.Array:
        """A fresh key; the stream advances."""
        self.rng, key = jax.random.split(self.rng)
        return key

    def set_weights(self, weights: Mapping[str, Any]) -> LinenLayer:
        """Loads canonical weights (strict) onto the layer's device; returns the layer."""
        variables = linen.variables_from_weights(weights, self.module)
        self.variables = jax.device_put(variables, self.device)
        return self

    def get_weights(self) -> dict[str, np.ndarray]:
        """The canonical weights, as numpy arrays.

        Raises:
            ValueError: the layer has no variables yet.
        """
        if self.variables is None:
            raise ValueError("the layer has no variables yet: call init or set its weights")
        return linen.weights_from_variables(self.variables)


def linen_layer(
    num_hiddens: int,
    num_heads: int,
    *,
    device: str = "cpu",
    dtype: str = "float32",
    **kwargs: Any,
) -> LinenLayer:
    """Our Linen module with ``dtype`` parameters on ``device``.

    Its variables are initialised where the module fixes every input size;
    otherwise they stay ``None`` until weights are set.
    """
    module = linen.MultiHeadAttention(num_hiddens, num_heads, param_dtype=DTYPES[dtype], **kwargs)
    layer = LinenLayer(module, None, _facts.device(device), jax.random.key(0))
    sizes = (module.query_size, module.key_size, module.value_size)
    if all(size is not None for size in sizes):
        shapes = [jnp.zeros((1, 1, size), DTYPES[dtype]) for size in sizes]
        with jax.default_device(layer.device):
            layer.variables = module.init(layer.next_rng(), *shapes)
    return layer


def forward(
    layer: MultiHeadAttention | LinenLayer,
    queries: jax.Array,
    keys: jax.Array | None,
    values: jax.Array | None,
    valid_lens: Any = None,
    *,
    training: bool = False,
    head_mask: jax.Array | None = None,
    **kwargs: Any,
) -> Any:
    """One call of an NNX layer (in ``train()`` or ``eval()`` mode) or a Linen
    layer (whose dropout draws a fresh key in training; initialised by its first
    call where it has no variables yet).

    ``head_mask`` is the layer's, passed as it is; ``kwargs`` are the
    layer's (``causal``, ``return_attention_weights``, ``cache``).
    """
    kwargs["head_mask"] = head_mask
    if isinstance(layer, LinenLayer):
        if layer.variables is None:
            # A layer of sizes its first call gives: initialised from the call's inputs, as
            # a Linen user's init is.
            variables = layer.module.init(
                layer.next_rng(), queries, keys, values, valid_lens, **kwargs
            )
            layer.variables = jax.device_put(variables, layer.device)
        rngs = {"dropout": layer.next_rng()} if training else {}
        return layer.module.apply(
            layer.variables,
            queries,
            keys,
            values,
            valid_lens,
            training=training,
            rngs=rngs,
            **kwargs,
        )
    if training:
        layer.train()
    else:
        layer.eval()
    return layer(queries, keys, values, valid_lens, **kwargs)


def vjp(
    layer: MultiHeadAttention | LinenLayer,
    queries: jax.Array,
    keys: jax.Array,
    values: jax.Array,
    valid_lens: Any,
    *,
    causal: bool,
    output_gradient: jax.Array,
    cache: spec.KVCache | None = None,
    head_mask: jax.Array | None = None,
    bias: jax.Array | None = None,
    positions: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
) -> dict[str, jax.Array]:
    """The vector-Jacobian product of an eval-mode call at ``output_gradient``.

    Both layers hold their parameters in one tree,
    ``{'W_q': {'kernel': ..., 'bias': ...}, ...}`` (an NNX state, Linen's
    ``params``), in the canonical orientation. With a ``cache``, of the
    output of that cached call, the cache held fixed; with a ``head_mask``
    or a ``bias``, of the call given it; ``positions`` are passed on.

    Returns:
        Keyed ``queries``, ``keys``, ``values`` and the canonical weight
        names; with a ``head_mask`` or a ``bias``, its gradient too (in its
        dtype), keyed by its name.
    """
    options: dict[str, Any] = {"causal": causal, "positions": positions}
    if segment_ids is not None:
        options["segment_ids"] = segment_ids
    if cache is not None:
        options["cache"] = cache
    differentiated = {"head_mask": head_mask, "bias": bias}

    def output_of(result: Any) -> jax.Array:
        return result if cache is None else result[0]

    if isinstance(layer, LinenLayer):
        module = layer.module

        def call(
            variables: Any, extras: Any, q: jax.Array, k: jax.Array, v: jax.Array
        ) -> jax.Array:
            return output_of(module.apply(variables, q, k, v, valid_lens, **extras, **options))

        params = layer.variables
        projections: Callable[[Any], Any] = operator.itemgetter("params")
    else:
        layer.eval()
        graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

        def call(
            params: nnx.State, extras: Any, q: jax.Array, k: jax.Array, v: jax.Array
        ) -> jax.Array:
            layer = nnx.merge(graphdef, params, rest)
            return output_of(layer(q, k, v, valid_lens, **extras, **options))

        projections = nnx.to_pure_dict

    # One compiled program per call: eager JAX would compile each operation
    # of the forward and backward passes for each new shape instead, several
    # times slower for the one product wanted here.
    @jax.jit
    def gradients(params: Any, extras: Any, q: Any, k: Any, v: Any, cotangent: Any) -> Any:
        _, pullback = jax.vjp(call, params, extras, q, k, v)
        return pullback(cotangent)

    param_grads, extra_grads, *input_grads = gradients(
        params, differentiated, queries, keys, values, output_gradient
    )
    grads = dict(zip(INPUT_NAMES, input_grads, strict=True))
    grads.update({name: extra_grads[name] for name, x in differentiated.items() if x is not None})
    tree = projections(param_grads)
    for name in KERNEL_NAMES:
        grads[name] = tree[name]["kernel"]
        if tree[name].get("bias") is not None:
            grads[f"b_{name[-1]}"] = tree[name]["bias"]
    grads.update({name: tree[name] for name in NORM_NAMES if name in tree})
    if SINKS_NAME in tree:
        grads[SINKS_NAME] = tree[SINKS_NAME]
    return grads


def init_cache(
    layer: MultiHeadAttention | LinenLayer, batch_size: int, max_length: int
) -> spec.KVCache:
    """The layer's empty cache (its ``init_cache``), of its dtype, on its device."""
    if isinstance(layer, LinenLayer):
        with jax.default_device(layer.device):
            return layer.module.init_cache(batch_size, max_length)
    return layer.init_cache(batch_size, max_length)


def native_layer(
    weights: Mapping[str, Any],
    num_heads: int,
    *,
    device: str = "cpu",
    dtype: str = "float32",
    **kwargs: Any,
) -> nnx.MultiHeadAttention:
    """``flax.nnx.MultiHeadAttention`` holding canonical ``weights``, in eval mode.

    Its parameters have ``dtype`` and live on ``device``; ``kwargs`` are
    further constructor arguments (see
    :func:`mha_multi.interop.jax.to_flax_nnx`).
    """
    with jax.default_device(_facts.device(device)):
        layer = to_flax_nnx(weights, num_heads, param_dtype=DTYPES[dtype], **kwargs)
    layer.eval()
    return layer


# -- the fused kernel -----------------------------------------------------------


@contextlib.contextmanager
def kernel_spy() -> Iterator[list[KernelCall]]:
    """Records every :func:`jax.nn.dot_product_attention` call of our layers while active.

    The layers look the kernel up at call time through
    ``mha_multi.jax._kernel._dot_product_attention``, which this replaces
    for the duration. A call is recorded while it is traced; an eager call
    is traced too (:func:`mha_multi.jax.functional.attend_compiled`), and
    the compiled programs are dropped on entry and exit, so that each eager
    call inside the spy is traced and recorded and none outside it records.
    Under the caller's ``jax.jit`` a call is recorded once, when traced.
    Key lengths are read when the program runs: a recorded call's
    ``key_lengths`` are numpy once it has run (the traced array until then).

    Yields:
        The list that gets one ``KernelCall`` per call.
    """
    calls: list[KernelCall] = []
    original = _kernel._dot_product_attention

    def recording(*args: Any) -> jax.Array:
        _, _, _, mask, is_causal, lengths, _ = args
        index = len(calls)
        calls.append(
            KernelCall(mask=mask is not None, is_causal=bool(is_causal), key_lengths=lengths)
        )
        if lengths is not None:

            def read(value: np.ndarray) -> None:
                calls[index] = calls[index]._replace(key_lengths=np.asarray(value))

            jax.debug.callback(read, lengths)
        return original(*args)

    jax.clear_caches()
    _kernel._dot_product_attention = recording
    try:
        yield calls
    finally:
        _kernel._dot_product_attention = original
        jax.clear_caches()

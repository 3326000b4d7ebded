"""What drives the Keras layer: building it, calls, gradients, the kernel spy, the native one.

The parity runners, the benchmark and the tests reach Keras through this
module (docs: "Architecture"). It sits above the layer: it imports the layer
and :mod:`mha_multi.keras._facts` (Keras' facts, whose public names are
read through this module too: ``harness.to_numpy``), and nothing in
:mod:`mha_multi.keras` imports it.

How a call is compiled and differentiated differs per Keras backend
(``tf.function``, ``jax.jit`` of ``stateless_call``, ``torch.compile``):
:mod:`mha_multi.parity.harness.keras_calls` has one driver each, and its
functions are read through this module too.
"""

from __future__ import annotations

import contextlib
import inspect
import json
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import keras

from mha_multi import _docs, spec
from mha_multi.call import INPUT_NAMES, check_cache_values
from mha_multi.keras import _facts, _kernel
from mha_multi.keras._facts import FACTS, device_of, device_scope
from mha_multi.keras._native import native_gqa_layer, native_layer
from mha_multi.keras.importance import head_mask_gradient
from mha_multi.keras.layer import MultiHeadAttention
from mha_multi.parity.harness import KernelCall, facts_passthrough
from mha_multi.parity.harness.keras_calls import (
    LayerCall,
    compile_function,
    driver,
    forward_function,
    gradient_function,
    state,
)

__all__ = [
    "INPUT_NAMES",
    "LayerCall",
    "compile_function",
    "forward",
    "forward_function",
    "gradient_function",
    "head_mask_gradient",
    "init_cache",
    "kernel_spy",
    "make_layer",
    "native_gqa_layer",
    "native_layer",
    "state",
    "vjp",
]

__getattr__ = facts_passthrough(__name__, _facts)

Tensor = Any


# -- the layer ---------------------------------------------------------------------


@_docs.fill
def make_layer(
    num_hiddens: int,
    num_heads: int,
    *,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    device: str = "cpu",
    dtype: str = "float32",
    **kwargs: Any,
) -> MultiHeadAttention:
    """The layer with its variables on ``device`` in ``dtype``.

    Its kernels start from zeros unless ``kernel_initializer`` says otherwise:
    callers load weights right away, and Keras' random initializers compile
    anew for every shape on the JAX backend (about half a second a layer).

    Args:
        {harness_layer_args}
        dtype: one of :data:`DTYPES`, or a Keras dtype policy.
        **kwargs: the layer's other arguments (``dropout``, ``bias``, sizes, ``seed``).
    """
    kwargs.setdefault("kernel_initializer", "zeros")
    with device_scope(device):
        return MultiHeadAttention(
            num_hiddens,
            num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            dtype=dtype,
            **kwargs,
        )


def _runner_call(
    layer: keras.layers.Layer,
    causal: bool,
    return_attention_weights: bool,
    cached: bool = False,
    first: bool = False,
    extras: tuple[str, ...] = (),
) -> LayerCall:
    """The runner's call: ``(queries, keys, values, *differentiated, valid_lens, *given[, cache])``.

    ``extras`` names the call's other arguments given: those of
    :data:`DIFFERENTIATED` (``head_mask``, ``bias``) follow the values, in
    that order, and are differentiated with them; the others
    (``positions``, ``segment_ids``) follow ``valid_lens``. With ``cached`` the last input
    is the cache, passed as ``cache=``; with ``first`` the call gives the
    output alone.
    """
    differentiated, given = _split_extras(extras)

    def arguments(*inputs: Tensor) -> tuple[tuple[Any, ...], dict[str, Any]]:
        options = {"causal": causal, "return_attention_weights": return_attention_weights}
        if cached:
            *inputs, options["cache"] = inputs
        first_given = len(inputs) - len(given)
        options.update(zip(given, inputs[first_given:], strict=True))
        inputs = inputs[:first_given]
        *inputs, valid_lens = inputs
        options.update(zip(differentiated, inputs[3:], strict=True))
        return (*inputs[:3], valid_lens), options

    return LayerCall(layer, arguments, first=first)


#: The call's arguments besides the inputs that gradients are taken of, in input order.
DIFFERENTIATED = ("head_mask", "bias")
#: Every array argument of the call besides the inputs, the lengths and the cache.
_EXTRAS = (*DIFFERENTIATED, "positions", "segment_ids")


def _split_extras(extras: Sequence[str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(differentiated, given)``: the names of ``extras`` in input order."""
    return (
        tuple(name for name in DIFFERENTIATED if name in extras),
        tuple(sorted(name for name in extras if name not in DIFFERENTIATED)),
    )


def _ordered(
    kwargs: Mapping[str, Any],
    extras: Sequence[str],
    queries: Tensor,
    keys: Tensor,
    values: Tensor,
    valid_lens: Any,
) -> list[Any]:
    """The inputs of a :func:`_runner_call` with ``extras``, from the call's ``kwargs``."""
    differentiated, given = _split_extras(extras)
    return [
        queries,
        keys,
        values,
        *(kwargs[name] for name in differentiated),
        valid_lens,
        *(kwargs[name] for name in given),
    ]


#: Layer configuration -> a layer of it whose variable order compiled functions follow.
_TEMPLATES: dict[str, keras.layers.Layer] = {}
#: (kind, configuration, causal, return_attention_weights, cached, gated) -> compiled function.
_COMPILED: dict[tuple[Any, ...], Any] = {}


def _shared(
    kind: str,
    layer: keras.layers.Layer,
    causal: bool,
    return_attention_weights: bool,
    cached: bool = False,
    extras: tuple[str, ...] = (),
) -> tuple[Any, keras.layers.Layer]:
    """A compiled function shared by every layer of ``layer``'s configuration.

    Op by op, JAX compiles every operation again for every new shape; one
    compiled program per configuration, flags and input shapes is evaluated
    on the variable values of the layer at hand (what ``stateless_call`` is
    for). Returns the function and the template layer whose variable order
    it follows.
    """
    config = layer.get_config()
    config.pop("name", None)
    configuration = json.dumps(config, sort_keys=True, default=str)
    if configuration not in _TEMPLATES:
        _TEMPLATES[configuration] = type(layer).from_config(config)
    template = _TEMPLATES[configuration]
    key = (kind, configuration, causal, return_attention_weights, cached, extras)
    if key not in _COMPILED:
        # Gradients are of the output alone (a cached call returns the cache too).
        first = kind == "gradients" and cached
        call = _runner_call(template, causal, return_attention_weights, cached, first, extras)
        if kind == "forward":
            _COMPILED[key] = forward_function(call, compiled=True)
        else:
            wrt = len(INPUT_NAMES) + len(_split_extras(extras)[0])
            _COMPILED[key] = gradient_function(call, wrt=wrt, compiled=True)
    return _COMPILED[key], template


def forward(
    layer: MultiHeadAttention,
    queries: Tensor,
    keys: Tensor,
    values: Tensor,
    valid_lens: Any,
    *,
    training: bool = False,
    **kwargs: Any,
) -> Tensor | tuple[Any, ...]:
    """One call of the layer, on the device of ``queries``, recording no gradient.

    On JAX an evaluation-mode call runs compiled, once per configuration,
    flags and shapes (Keras' JAX users run compiled steps; see
    :func:`_shared`); a cached call too, after which the lengths are read
    and checked as an eager call checks them (compiled code cannot). Calls
    with values that cannot be traced (a ``causal`` that is not a bool,
    lengths that are no tensor), in training or of a layer not built yet go
    through the layer as a user's call does.

    Args:
        layer: the layer.
        queries: ``(B, Q, query_size)``; keys, values likewise with ``K``.
        valid_lens: passed to the layer as it is.
        training: dropout active.
        **kwargs: the layer's ``causal``, ``return_attention_weights``,
            ``cache``, ``head_mask``, ``positions`` and ``bias``.
    """
    causal = kwargs.get("causal", False)
    return_attention_weights = kwargs.get("return_attention_weights", False)
    cache = kwargs.get("cache")
    extras = tuple(name for name in _EXTRAS if kwargs.get(name) is not None)
    traceable = (
        driver().stateless
        and layer.built
        and not training
        and set(kwargs) <= {"causal", "return_attention_weights", "cache", *_EXTRAS}
        and type(causal) is bool
        and type(return_attention_weights) is bool
        and (valid_lens is None or keras.ops.is_tensor(valid_lens))
        and (cache is None or isinstance(cache, spec.KVCache))
        and all(keras.ops.is_tensor(kwargs[name]) for name in extras)
    )
    with device_scope(device_of(queries)):
        if not traceable:
            with driver().no_gradients():
                return layer(queries, keys, values, valid_lens, training=training, **kwargs)
        cached = cache is not None
        function, template = _shared(
            "forward", layer, causal, return_attention_weights, cached, extras
        )
        inputs = _ordered(kwargs, extras, queries, keys, values, valid_lens)
        result = function(state(layer, template), *inputs, *([cache] if cached else []))
        if cached:
            # Tracing checked the shapes and dtypes; the result is dropped on an error.
            check_cache_values(FACTS, cache, valid_lens, 0 if keys is None else queries.shape[1])
        return result


def vjp(
    layer: MultiHeadAttention,
    queries: Tensor,
    keys: Tensor,
    values: Tensor,
    valid_lens: Any,
    *,
    causal: bool,
    output_gradient: Tensor,
    cache: spec.KVCache | None = None,
    **kwargs: Any,
) -> dict[str, Tensor]:
    """The gradients of ``sum(output * output_gradient)`` of an evaluation-mode call.

    With a ``cache``, of the output of that cached call, the cache held
    fixed (an input like ``valid_lens``, not differentiated). With a
    ``head_mask`` or a ``bias`` (``kwargs``), of the call given it, and with
    respect to it too; ``positions`` are passed on.

    Returns:
        Tensors keyed ``queries``, ``keys``, ``values`` and the canonical
        weight names (the variables are canonical as they are), and
        ``head_mask`` and ``bias`` where given.
    """
    cached = cache is not None
    extras = tuple(name for name in _EXTRAS if kwargs.get(name) is not None)
    names = (*INPUT_NAMES, *_split_extras(extras)[0])
    if driver().stateless:
        function, owner = _shared("gradients", layer, causal, False, cached, extras)
    else:
        owner = layer
        call = _runner_call(layer, causal, False, cached, first=cached, extras=extras)
        function = gradient_function(call, wrt=len(names), compiled=False)
    inputs = _ordered(kwargs, extras, queries, keys, values, valid_lens)
    if cached:
        # A cache made by eager PyTorch calls still leads back to the weights
        # that wrote it.
        inputs.append(spec.KVCache(*(keras.ops.stop_gradient(x) for x in cache)))
    with device_scope(device_of(queries)):
        input_grads, weight_grads = function(state(layer, owner), inputs, output_gradient)
    grads = dict(zip(names, input_grads, strict=True))
    trainable = owner.trainable_variables
    for name, variable in owner.canonical_variables().items():
        index = next(i for i, v in enumerate(trainable) if v is variable)
        grads[name] = weight_grads[index]
    return grads


def init_cache(layer: MultiHeadAttention, batch_size: int, max_length: int) -> spec.KVCache:
    """The layer's empty cache (:meth:`MultiHeadAttention.init_cache`), of its dtype and device."""
    return layer.init_cache(batch_size, max_length)


@contextlib.contextmanager
def kernel_spy() -> Iterator[list[KernelCall]]:
    """Records every call of the fused kernel while active
    (:func:`mha_multi.keras._kernel.dot_product_attention`).

    Yields:
        A list that gets one :class:`~mha_multi.parity.harness.KernelCall`
        per call: whether a mask was passed and the kernel's causal flag
        (the kernel takes no key lengths and no dropout).
    """
    calls: list[KernelCall] = []
    original = _kernel.dot_product_attention
    signature = inspect.signature(original)

    def recording(*args: Any, **kwargs: Any) -> Tensor:
        given = signature.bind(*args, **kwargs).arguments
        calls.append(
            KernelCall(
                mask=given.get("mask") is not None, is_causal=bool(given.get("is_causal", False))
            )
        )
        return original(*args, **kwargs)

    _kernel.dot_product_attention = recording  # type: ignore[assignment]
    try:
        yield calls
    finally:
        _kernel.dot_product_attention = original  # type: ignore[assignment]

"""What drives the Keras layer: building it, calls, gradients, the kernel spy, the native one.

The parity runners, the benchmark and the tests reach Keras through this
module (docs: "Architecture"). It sits above the layer: it imports the layer
and :mod:`mha_multi.keras._backend` (Keras' facts, whose public names are
read through this module too: ``harness.to_numpy``), and nothing below
imports it.

How a call is compiled and differentiated differs per Keras backend
(``tf.function``, ``jax.jit`` of ``stateless_call``, ``torch.compile``); one
driver class each below, of which only the active backend's is created.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import keras

from mha_multi import _docs, spec
from mha_multi.call import INPUT_NAMES, check_cache_values
from mha_multi.keras import _backend, _kernel
from mha_multi.keras._backend import BACKEND, FACTS, device_of, device_scope
from mha_multi.keras._native import native_gqa_layer, native_layer
from mha_multi.keras.importance import head_mask_gradient
from mha_multi.keras.layer import MultiHeadAttention
from mha_multi.parity.runners import KernelCall, facts_passthrough

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

__getattr__ = facts_passthrough(__name__, _backend)

Tensor = Any
#: A layer's variable values: ``(trainable, non_trainable)``.
State = tuple[list[Any], list[Any]]


# -- a layer's call, eager or compiled ------------------------------------------------


@dataclass(frozen=True)
class LayerCall:
    """A layer called on its inputs the same way every time, in evaluation mode.

    Attributes:
        layer: the Keras layer (ours or a native one).
        arguments: the inputs -> the layer's positional and keyword arguments.
        first: the layer returns a tuple whose first item is the output.
    """

    layer: keras.layers.Layer
    arguments: Callable[..., tuple[tuple[Any, ...], dict[str, Any]]]
    first: bool = False

    def __call__(self, *inputs: Tensor) -> Tensor:
        args, kwargs = self.arguments(*inputs)
        result = self.layer(*args, training=False, **kwargs)
        return result[0] if self.first else result

    def stateless(self, values: State, *inputs: Tensor) -> Tensor:
        """The call on the variable values ``values`` (``Layer.stateless_call``)."""
        args, kwargs = self.arguments(*inputs)
        result, _ = self.layer.stateless_call(*values, *args, training=False, **kwargs)
        return result[0] if self.first else result


#: ``(values, *inputs) -> output``.
ForwardFunction = Callable[..., Tensor]
#: ``(values, inputs, cotangent) -> (input gradients, trainable variable gradients)``.
GradientFunction = Callable[[State, Sequence[Tensor], Tensor], tuple[list[Any], list[Any]]]


# -- what differs per Keras backend --------------------------------------------------


class _Driver:
    """How one Keras backend compiles and differentiates a layer's call."""

    #: Whether forward and gradient functions take the variables as values
    #: (``stateless_call``), so that one compiled function serves every layer
    #: of a configuration.
    stateless: bool = False

    def compile(self, function: Callable[..., Any]) -> Callable[..., Any]:
        """``function`` of tensors, compiled the backend's way."""
        raise NotImplementedError

    def no_gradients(self) -> contextlib.AbstractContextManager[Any]:
        """A scope whose eager calls record no gradient (a no-op where none is recorded)."""
        return contextlib.nullcontext()

    def forward_function(self, call: LayerCall, compiled: bool) -> ForwardFunction:
        raise NotImplementedError

    def gradient_function(self, call: LayerCall, wrt: int, compiled: bool) -> GradientFunction:
        raise NotImplementedError


class _TensorFlow(_Driver):
    """Keras on TensorFlow: ``tf.GradientTape``, ``tf.function(jit_compile=True)``."""

    def __init__(self) -> None:
        import tensorflow as tf

        self.tf = tf

    def compile(self, function: Callable[..., Any]) -> Callable[..., Any]:
        return self.tf.function(function, jit_compile=True)

    def forward_function(self, call: LayerCall, compiled: bool) -> ForwardFunction:
        function = self.tf.function(call, jit_compile=True) if compiled else call
        return lambda values, *inputs: function(*inputs)

    def gradient_function(self, call: LayerCall, wrt: int, compiled: bool) -> GradientFunction:
        tf = self.tf
        variables = call.layer.trainable_variables

        def gradients(inputs: list[Tensor], cotangent: Tensor) -> tuple[list[Any], list[Any]]:
            with tf.GradientTape() as tape:
                tape.watch(inputs[:wrt])
                output = call(*inputs)
            grads = tape.gradient(output, [*inputs[:wrt], *variables], output_gradients=cotangent)
            return grads[:wrt], grads[wrt:]

        function = tf.function(gradients, jit_compile=True) if compiled else gradients
        return lambda values, inputs, cotangent: function(list(inputs), cotangent)


class _Jax(_Driver):
    """Keras on JAX: ``Layer.stateless_call`` under ``jax.vjp`` and ``jax.jit``."""

    stateless = True

    def __init__(self) -> None:
        import jax

        self.jax = jax

    def compile(self, function: Callable[..., Any]) -> Callable[..., Any]:
        return self.jax.jit(function)

    def forward_function(self, call: LayerCall, compiled: bool) -> ForwardFunction:
        if compiled:
            return self.jax.jit(call.stateless)
        return lambda values, *inputs: call(*inputs)

    def gradient_function(self, call: LayerCall, wrt: int, compiled: bool) -> GradientFunction:
        jax = self.jax

        def gradients(
            values: State, inputs: Sequence[Tensor], cotangent: Tensor
        ) -> tuple[list[Any], list[Any]]:
            trainable, non_trainable = values

            def of_differentiated(trainable: list[Any], *differentiated: Tensor) -> Tensor:
                return call.stateless((trainable, non_trainable), *differentiated, *inputs[wrt:])

            _, pullback = jax.vjp(of_differentiated, trainable, *inputs[:wrt])
            trainable_grads, *input_grads = pullback(cotangent)
            return input_grads, trainable_grads

        return jax.jit(gradients) if compiled else gradients


class _Torch(_Driver):
    """Keras on PyTorch: ``torch.autograd.grad``, ``torch.compile``."""

    def __init__(self) -> None:
        import torch

        self.torch = torch

    def no_gradients(self) -> contextlib.AbstractContextManager[Any]:
        # Torch variables require gradients: an eager call records its graph,
        # and a decode feeding each cache back would keep every step's.
        return self.torch.no_grad()

    def compile(self, function: Callable[..., Any]) -> Callable[..., Any]:
        compiled = self.torch.compile(function)

        def run(*args: Any) -> Any:
            with self.torch.no_grad():
                return compiled(*args)

        return run

    def forward_function(self, call: LayerCall, compiled: bool) -> ForwardFunction:
        function = self.torch.compile(call) if compiled else call

        def forward(values: State, *inputs: Tensor) -> Tensor:
            with self.torch.no_grad():
                return function(*inputs)

        return forward

    def gradient_function(self, call: LayerCall, wrt: int, compiled: bool) -> GradientFunction:
        torch = self.torch
        function = torch.compile(call) if compiled else call

        def gradients(
            values: State, inputs: Sequence[Tensor], cotangent: Tensor
        ) -> tuple[list[Any], list[Any]]:
            differentiated = [x.detach().requires_grad_(True) for x in inputs[:wrt]]
            output = function(*differentiated, *inputs[wrt:])
            variables = [v.value for v in call.layer.trainable_variables]
            grads = torch.autograd.grad(
                output, [*differentiated, *variables], grad_outputs=cotangent
            )
            return list(grads[:wrt]), list(grads[wrt:])

        return gradients


@functools.cache
def _active() -> _Driver:
    """The driver of the Keras backend this process runs, made on first use."""
    return {"tensorflow": _TensorFlow, "jax": _Jax, "torch": _Torch}[BACKEND]()


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


def state(layer: keras.layers.Layer, order: keras.layers.Layer | None = None) -> State:
    """The values of ``layer``'s trainable and non-trainable variables.

    Args:
        layer: the layer whose values are read.
        order: a layer of the same configuration whose variables give the
            order (``layer`` itself by default).
    """
    by_path = {v.path.split("/", 1)[-1]: v.value for v in layer.variables}
    order = layer if order is None else order

    def values(variables: list[Any]) -> list[Any]:
        return [by_path[v.path.split("/", 1)[-1]] for v in variables]

    return values(order.trainable_variables), values(order.non_trainable_variables)


def compile_function(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` of tensors compiled as :func:`forward_function` compiles a call
    (PyTorch's runs without autograd)."""
    return _active().compile(function)


def forward_function(call: LayerCall, *, compiled: bool) -> ForwardFunction:
    """``call`` as ``f(values, *inputs)``, eager or compiled the backend's way.

    Compiled is ``tf.function(jit_compile=True)``, ``jax.jit`` of
    ``stateless_call`` or ``torch.compile``; ``values`` is :func:`state` of
    the layer, which only JAX's functions read. PyTorch's run without
    autograd.
    """
    return _active().forward_function(call, compiled)


def gradient_function(call: LayerCall, *, wrt: int, compiled: bool) -> GradientFunction:
    """The vector-Jacobian product of ``call`` as ``g(values, inputs, cotangent)``.

    ``g`` returns the gradients of ``sum(call(*inputs) * cotangent)`` with
    respect to the first ``wrt`` inputs and to the layer's trainable
    variables (in their order), eager or compiled as in
    :func:`forward_function`.
    """
    return _active().gradient_function(call, wrt, compiled)


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
    (``positions``) follow ``valid_lens``. With ``cached`` the last input
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
_EXTRAS = (*DIFFERENTIATED, "positions")


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
    lengths that are no tensor) or in training go through the layer as a
    user's call does.

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
        _active().stateless
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
            with _active().no_gradients():
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
    if _active().stateless:
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
        A list that gets one :class:`~mha_multi.parity.runners.KernelCall`
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

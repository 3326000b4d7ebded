"""Keras' facts, once, for whichever Keras backend the process runs on.

The layer, the parity runners, the benchmark, the converters and the tests
reach Keras through this module (docs: "Architecture"): the dtypes, devices
and GPU detection, the process-wide settings for exact float32 products,
conversions to and from numpy (bfloat16 included), how the layer is built,
called and differentiated (with respect to the heads' gates too), how a call
of the fused kernel is observed, and
``keras.layers.MultiHeadAttention`` and ``keras.layers.GroupQueryAttention``
holding canonical weights.

Keras fixes its backend per process (``KERAS_BACKEND``); what differs
between TensorFlow, JAX and PyTorch underneath is one class each below, of
which only the active backend's is created, so only that framework is ever
imported here.

The layer imports this module, so the layer is imported here only inside
the function that builds one.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import keras
import numpy as np

from mha_multi import spec
from mha_multi.weights import WeightsConfig, check_weights

if TYPE_CHECKING:
    from mha_multi.keras.layer import MultiHeadAttention
    from mha_multi.parity.runners import KernelCall

__all__ = [
    "BACKEND",
    "DTYPES",
    "INPUT_NAMES",
    "NATIVE_GQA_PROJECTIONS",
    "NATIVE_PROJECTIONS",
    "LayerCall",
    "as_numpy",
    "check_native_mha_layout",
    "device_description",
    "device_of",
    "device_scope",
    "enable_float64",
    "exact_float32",
    "forward",
    "forward_function",
    "head_mask_gradient",
    "gpu_available",
    "gradient_function",
    "host_array",
    "init_cache",
    "kernel_spy",
    "lens_to_native",
    "make_layer",
    "gqa_projections",
    "gqa_state",
    "native_gqa_layer",
    "native_layer",
    "state",
    "sync",
    "to_native",
    "to_numpy",
    "values_readable",
    "vjp",
]

#: The Keras backend of this process: ``"tensorflow"``, ``"jax"`` or ``"torch"``.
BACKEND: str = keras.backend.backend()

#: The dtypes the layer runs in on every Keras backend, by Keras' names.
DTYPES: tuple[str, ...] = ("float64", "float32", "bfloat16", "float16")

#: ``keras.layers.MultiHeadAttention``'s projection sublayers (``<name>_dense``)
#: -> canonical projection letter.
NATIVE_PROJECTIONS: dict[str, str] = {"query": "q", "key": "k", "value": "v", "output": "o"}

#: ``keras.layers.GroupQueryAttention``'s projection sublayers, by their
#: names (which its variable paths and weights files use) -> canonical
#: projection letter.
NATIVE_GQA_PROJECTIONS: dict[str, str] = {
    "query": "q",
    "key": "k",
    "value": "v",
    "attention_output": "o",
}

#: The differentiable inputs of a call, in order.
INPUT_NAMES = ("queries", "keys", "values")

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


class _Backend:
    """What one Keras backend does its own way."""

    #: Whether forward and gradient functions take the variables as values
    #: (``stateless_call``), so that one compiled function serves every layer
    #: of a configuration.
    stateless: bool = False

    def gpu_available(self) -> bool:
        raise NotImplementedError

    def gpu_name(self) -> str:
        raise NotImplementedError

    def device_of(self, x: Tensor) -> str:
        raise NotImplementedError

    def exact_float32(self) -> None:
        raise NotImplementedError

    def enable_float64(self) -> None:
        """Nothing to enable where float64 arrays are always available."""

    def values_readable(self, x: Tensor) -> bool:
        raise NotImplementedError

    def forward_function(self, call: LayerCall, compiled: bool) -> ForwardFunction:
        raise NotImplementedError

    def gradient_function(self, call: LayerCall, wrt: int, compiled: bool) -> GradientFunction:
        raise NotImplementedError

    def scalar_gradient(self, function: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
        """The gradient of the scalar ``function(x)`` with respect to ``x``, eagerly."""
        raise NotImplementedError

    def sync(self, value: Any) -> None:
        # Reading one element waits for the operation that produced the array.
        for leaf in keras.tree.flatten(value):
            if leaf is not None:
                keras.ops.convert_to_numpy(keras.ops.reshape(leaf, (-1,))[:1])


class _TensorFlow(_Backend):
    """Keras on TensorFlow: ``tf.GradientTape``, ``tf.function(jit_compile=True)``."""

    def __init__(self) -> None:
        import tensorflow as tf

        self.tf = tf

    def gpu_available(self) -> bool:
        return bool(self.tf.config.list_physical_devices("GPU"))

    def gpu_name(self) -> str:
        gpu = self.tf.config.list_physical_devices("GPU")[0]
        return str(self.tf.config.experimental.get_device_details(gpu).get("device_name", "gpu"))

    def device_of(self, x: Tensor) -> str:
        return "gpu" if "GPU" in x.device.upper() else "cpu"

    def exact_float32(self) -> None:
        self.tf.config.experimental.enable_tensor_float_32_execution(False)

    def values_readable(self, x: Tensor) -> bool:
        return self.tf.executing_eagerly() and not isinstance(x, keras.KerasTensor)

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

    def scalar_gradient(self, function: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
        with self.tf.GradientTape() as tape:
            tape.watch(x)
            y = function(x)
        return tape.gradient(y, x)


class _Jax(_Backend):
    """Keras on JAX: ``Layer.stateless_call`` under ``jax.vjp`` and ``jax.jit``.

    The facts of plain JAX are written again here rather than taken from
    :mod:`mha_multi.jax`: that package imports Flax, which Keras' JAX
    environment does not install.
    """

    stateless = True

    def __init__(self) -> None:
        import jax

        self.jax = jax

    def gpu_available(self) -> bool:
        try:
            return bool(self.jax.devices("gpu"))
        except RuntimeError:
            return False

    def gpu_name(self) -> str:
        return str(self.jax.devices("gpu")[0].device_kind)

    def device_of(self, x: Tensor) -> str:
        platform = next(iter(x.devices())).platform
        return "cpu" if platform == "cpu" else "gpu"

    def exact_float32(self) -> None:
        self.jax.config.update("jax_default_matmul_precision", "highest")

    def enable_float64(self) -> None:
        self.jax.config.update("jax_enable_x64", True)

    def values_readable(self, x: Tensor) -> bool:
        return not isinstance(x, (self.jax.core.Tracer, keras.KerasTensor))

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

    def scalar_gradient(self, function: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
        # The layer's variables enter the trace as the constants they are.
        return self.jax.grad(function)(x)

    def sync(self, value: Any) -> None:
        self.jax.block_until_ready(value)


class _Torch(_Backend):
    """Keras on PyTorch: ``torch.autograd.grad``, ``torch.compile``.

    Devices and precision are plain PyTorch's (:mod:`mha_multi.torch._backend`).
    """

    def __init__(self) -> None:
        import torch

        from mha_multi.torch import _backend as torch_backend

        self.torch = torch
        self.plain = torch_backend

    def gpu_available(self) -> bool:
        return self.plain.gpu_available()

    def gpu_name(self) -> str:
        return self.plain.device_description("gpu")

    def device_of(self, x: Tensor) -> str:
        return "gpu" if x.device.type == "cuda" else "cpu"

    def exact_float32(self) -> None:
        self.plain.exact_float32()

    def values_readable(self, x: Tensor) -> bool:
        return not self.torch.compiler.is_compiling()

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

    def scalar_gradient(self, function: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
        x = x.detach().requires_grad_(True)
        (grad,) = self.torch.autograd.grad(function(x), [x], allow_unused=True)
        return self.torch.zeros_like(x) if grad is None else grad

    def sync(self, value: Any) -> None:
        for leaf in keras.tree.flatten(value):
            self.plain.sync(leaf)


@functools.cache
def _active() -> _Backend:
    """The facts of the Keras backend this process runs, made on first use.

    Not at import: the documentation imports this module against mocked
    frameworks, where there is no backend to look up.
    """
    return {"tensorflow": _TensorFlow, "jax": _Jax, "torch": _Torch}[BACKEND]()


# -- devices and precision ---------------------------------------------------------


def gpu_available() -> bool:
    """Whether the framework under Keras sees a GPU."""
    return _active().gpu_available()


def device_description(name: str) -> str:
    """The device as reports name it: the GPU's model, or ``"cpu"``.

    Args:
        name: ``"cpu"`` or ``"gpu"``.
    """
    return _active().gpu_name() if name == "gpu" else "cpu"


def device_scope(name: str) -> contextlib.AbstractContextManager[Any]:
    """Creates tensors and variables on ``name`` (``"cpu"`` or ``"gpu"``) while active.

    No device index: Keras on PyTorch turns variables created under
    ``"cpu:0"`` into plain tensors (its Parameter is moved with ``.to()``).
    """
    return keras.device(name)


def device_of(x: Tensor) -> str:
    """``"gpu"`` or ``"cpu"``: where the tensor ``x`` lives."""
    return _active().device_of(x)


def exact_float32() -> None:
    """IEEE float32 products on GPU: TF32 off, or the highest matmul precision.

    Process-wide settings the layer leaves to its caller (docs: "Architecture").
    """
    _active().exact_float32()


def enable_float64() -> None:
    """float64 arrays, which JAX gives only with ``jax_enable_x64``."""
    _active().enable_float64()


def values_readable(x: Tensor) -> bool:
    """Whether the values of ``x`` can be read now (eager execution).

    Inside ``tf.function``, under ``jax.jit`` or while ``torch.compile``
    traces, a tensor has no value yet, and a branch on one would fail (or,
    in PyTorch, break the graph).
    """
    return _active().values_readable(x)


def sync(value: Any) -> None:
    """Waits until ``value`` (a tensor, or a nest of them) is computed."""
    _active().sync(value)


# -- conversions -------------------------------------------------------------------


def to_native(x: np.ndarray, device: str = "cpu", dtype: str = "float32") -> Tensor:
    """``x`` as a tensor of ``dtype`` on ``device`` (a copy: ``x`` stays the caller's)."""
    with device_scope(device):
        return keras.ops.cast(keras.ops.convert_to_tensor(np.array(x, copy=True)), dtype)


def lens_to_native(valid_lens: Any, device: str = "cpu") -> Any:
    """Numeric numpy ``valid_lens`` as a tensor on ``device``, keeping their dtype.

    Anything else is returned as it is, for the layer's own checks to answer;
    so is a dtype the backend has no tensors of (uint64 on PyTorch), which
    the layer takes as numpy.
    """
    if not (isinstance(valid_lens, np.ndarray) and valid_lens.dtype.kind in "iuf"):
        return valid_lens
    try:
        with device_scope(device):
            return keras.ops.convert_to_tensor(np.array(valid_lens, copy=True))
    except (TypeError, ValueError):
        return np.array(valid_lens, copy=True)


def as_numpy(x: Any) -> np.ndarray:
    """A tensor or variable as a new numpy array of its dtype (bfloat16 as ml_dtypes')."""
    with warnings.catch_warnings():
        # Keras converts with np.array(x), and the __array__ of TensorFlow
        # variables and PyTorch tensors predates numpy 2's copy keyword.
        warnings.filterwarnings(
            "ignore", "__array__ implementation doesn't accept a copy keyword", DeprecationWarning
        )
        return np.array(keras.ops.convert_to_numpy(x), copy=True)


def host_array(x: Any) -> np.ndarray:
    """A tensor or variable as numpy, floats in their own dtype.

    bfloat16 comes back as float32, which holds every bfloat16 value exactly
    (ml_dtypes' bfloat16 is no numpy float: its kind is ``'V'``).
    """
    array = as_numpy(x)
    return array if array.dtype.kind != "V" else array.astype(np.float32)


def to_numpy(x: Any) -> np.ndarray:
    """A tensor of any dtype (bfloat16 included), on any device, as float64 numpy."""
    return as_numpy(x).astype(np.float64)


# -- the layer ---------------------------------------------------------------------


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
        num_hiddens: the layer's ``num_hiddens``.
        num_heads: the layer's ``num_heads``.
        num_kv_heads: the layer's ``num_kv_heads`` (``None``: ``num_heads``).
        head_dim: the layer's ``head_dim`` (``None``: ``num_hiddens // num_heads``).
        device: ``"cpu"`` or ``"gpu"``.
        dtype: one of :data:`DTYPES`, or a Keras dtype policy.
        **kwargs: the layer's other arguments (``dropout``, ``bias``, sizes, ``seed``).
    """
    from mha_multi.keras.layer import MultiHeadAttention

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
    gated: bool = False,
) -> LayerCall:
    """The runner's call: ``(queries, keys, values[, head_mask], valid_lens[, cache])``.

    With ``gated`` the fourth input is the heads' gates, passed as
    ``head_mask=`` (differentiated with the first three); with ``cached``
    the last input is the cache, passed as ``cache=``; with ``first`` the
    call gives the output alone.
    """

    def arguments(*inputs: Tensor) -> tuple[tuple[Any, ...], dict[str, Any]]:
        options = {"causal": causal, "return_attention_weights": return_attention_weights}
        if cached:
            *inputs, options["cache"] = inputs
        if gated:
            *inputs, options["head_mask"], valid_lens = inputs
            inputs = [*inputs, valid_lens]
        return tuple(inputs), options

    return LayerCall(layer, arguments, first=first)


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
    gated: bool = False,
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
    key = (kind, configuration, causal, return_attention_weights, cached, gated)
    if key not in _COMPILED:
        # Gradients are of the output alone (a cached call returns the cache too).
        first = kind == "gradients" and cached
        call = _runner_call(template, causal, return_attention_weights, cached, first, gated)
        if kind == "forward":
            _COMPILED[key] = forward_function(call, compiled=True)
        else:
            wrt = len(INPUT_NAMES) + gated
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
    """One call of the layer, on the device of ``queries``.

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
            ``cache`` and ``head_mask``.
    """
    causal = kwargs.get("causal", False)
    return_attention_weights = kwargs.get("return_attention_weights", False)
    cache = kwargs.get("cache")
    head_mask = kwargs.get("head_mask")
    traceable = (
        _active().stateless
        and not training
        and set(kwargs) <= {"causal", "return_attention_weights", "cache", "head_mask"}
        and type(causal) is bool
        and type(return_attention_weights) is bool
        and (valid_lens is None or keras.ops.is_tensor(valid_lens))
        and (cache is None or isinstance(cache, spec.KVCache))
        and (head_mask is None or keras.ops.is_tensor(head_mask))
    )
    with device_scope(device_of(queries)):
        if not traceable:
            return layer(queries, keys, values, valid_lens, training=training, **kwargs)
        cached, gated = cache is not None, head_mask is not None
        function, template = _shared(
            "forward", layer, causal, return_attention_weights, cached, gated
        )
        gates = [head_mask] if gated else []
        inputs = (queries, keys, values, *gates, valid_lens, *([cache] if cached else []))
        result = function(state(layer, template), *inputs)
        if cached:
            # Tracing checked the shapes and dtypes; the result is dropped on an error.
            from mha_multi.keras.layer import check_cache_lengths

            check_cache_lengths(queries, keys, valid_lens, cache)
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
    head_mask: Tensor | None = None,
) -> dict[str, Tensor]:
    """The gradients of ``sum(output * output_gradient)`` of an evaluation-mode call.

    With a ``cache``, of the output of that cached call, the cache held
    fixed (an input like ``valid_lens``, not differentiated). With a
    ``head_mask``, of the call gated by it, and with respect to it too.

    Returns:
        Tensors keyed ``queries``, ``keys``, ``values`` and the canonical
        weight names (the variables are canonical as they are), and
        ``head_mask`` with a ``head_mask``.
    """
    cached, gated = cache is not None, head_mask is not None
    names = (*INPUT_NAMES, "head_mask") if gated else INPUT_NAMES
    if _active().stateless:
        function, owner = _shared("gradients", layer, causal, False, cached, gated)
    else:
        owner = layer
        call = _runner_call(layer, causal, False, cached, first=cached, gated=gated)
        function = gradient_function(call, wrt=len(names), compiled=False)
    inputs = [queries, keys, values, *([head_mask] if gated else []), valid_lens]
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


def head_mask_gradient(
    layer: MultiHeadAttention,
    queries: Tensor,
    keys: Tensor,
    values: Tensor,
    valid_lens: Any,
    loss_fn: Callable[[Tensor], Tensor],
) -> np.ndarray:
    """``dL/dξ`` at gates of ones, ``L = loss_fn(layer(..., head_mask=ξ))`` in evaluation mode.

    The block :func:`mha_multi.keras.head_importance` is made of: one batch,
    the layer called eagerly as a user calls it (fused path included), its
    ``(num_heads,)`` gates differentiated the backend's way
    (``tf.GradientTape``, ``jax.grad``, ``torch.autograd.grad``). The gates
    are float32 (float64 for a float64 layer), so 16-bit layers sum their
    gradient in float32.

    Returns:
        ``(num_heads,)`` numpy, in the gates' dtype.
    """
    dtype = "float64" if layer.compute_dtype == "float64" else "float32"
    with device_scope(device_of(queries)):
        gates = keras.ops.ones((layer.num_heads,), dtype)

        def loss(gates: Tensor) -> Tensor:
            output = layer(queries, keys, values, valid_lens, head_mask=gates, training=False)
            return loss_fn(output)

        return host_array(_active().scalar_gradient(loss, gates))


def init_cache(layer: MultiHeadAttention, batch_size: int, max_length: int) -> spec.KVCache:
    """The layer's empty cache (:meth:`MultiHeadAttention.init_cache`), of its dtype and device."""
    return layer.init_cache(batch_size, max_length)


@contextlib.contextmanager
def kernel_spy() -> Iterator[list[KernelCall]]:
    """Records every call of ``keras.ops.dot_product_attention`` while active.

    Yields:
        A list that gets one :class:`~mha_multi.parity.runners.KernelCall`
        per call: whether a mask was passed and the kernel's causal flag
        (the kernel takes no key lengths and no dropout).
    """
    from mha_multi.parity.runners import KernelCall

    calls: list[KernelCall] = []
    original = keras.ops.dot_product_attention
    signature = inspect.signature(original)

    def recording(*args: Any, **kwargs: Any) -> Tensor:
        given = signature.bind(*args, **kwargs).arguments
        calls.append(
            KernelCall(
                mask=given.get("mask") is not None, is_causal=bool(given.get("is_causal", False))
            )
        )
        return original(*args, **kwargs)

    keras.ops.dot_product_attention = recording
    try:
        yield calls
    finally:
        keras.ops.dot_product_attention = original


def native_layer(
    weights: Mapping[str, Any], num_heads: int, *, device: str = "cpu", **kwargs: Any
) -> keras.layers.MultiHeadAttention:
    """``keras.layers.MultiHeadAttention`` holding canonical weights, built.

    Each canonical array, reshaped to its variable's shape, is that variable:
    head ``h`` owns columns ``[h*dh, (h+1)*dh)`` in both layouts (see
    :mod:`mha_multi.interop.keras`). It is called ``(query, value, key)`` and
    takes key padding as ``attention_mask``
    (:func:`mha_multi.interop.keras.attention_mask`).

    Args:
        weights: canonical weights.
        num_heads: ``H``; ``key_dim`` is ``num_hiddens / H``.
        device: ``"cpu"`` or ``"gpu"``.
        **kwargs: more ``keras.layers.MultiHeadAttention`` arguments
            (``dropout``, ``dtype``, ``name``...).

    Returns:
        The layer, built for ``(B, Q, query_size)`` queries and
        ``(B, K, key_size|value_size)`` keys and values, with ``num_hiddens``
        output features (``output_shape`` is set when ``query_size`` differs).

    Raises:
        ValueError: invalid weights, ``num_hiddens`` not divisible by
            ``num_heads``, or a head layout other than d2l's
            (:func:`check_native_mha_layout`).
    """
    arrays, config = check_weights(weights)
    check_native_mha_layout(config)
    head_dim = spec.check_config(config.num_hiddens, num_heads, 0.0)
    with device_scope(device):
        layer = keras.layers.MultiHeadAttention(
            num_heads,
            head_dim,
            use_bias=config.bias,
            output_shape=None if config.query_size == config.num_hiddens else config.num_hiddens,
            **kwargs,
        )
        layer.build(
            (None, None, config.query_size),
            (None, None, config.value_size),
            (None, None, config.key_size),
        )
    for name, letter in NATIVE_PROJECTIONS.items():
        dense = getattr(layer, f"{name}_dense")
        dense.kernel.assign(arrays[f"W_{letter}"].reshape(dense.kernel.shape))
        if config.bias:
            dense.bias.assign(arrays[f"b_{letter}"].reshape(dense.bias.shape))
    return layer


def check_native_mha_layout(config: WeightsConfig) -> None:
    """Refuses weights whose head layout the ``keras.layers.MultiHeadAttention``
    converters do not hold: grouped key/value heads, which that layer lacks
    (every head has its own key and value), or an explicit ``head_dim``.

    Args:
        config: what :func:`mha_multi.weights.check_weights` read.

    Raises:
        ValueError: saying which, and that ``keras.layers.GroupQueryAttention``
            holds both.
    """
    if config.kv_features != config.query_features:
        raise ValueError(
            "keras.layers.MultiHeadAttention has no grouped key/value heads "
            f"(num_kv_heads < num_heads): W_k and W_v have {config.kv_features} columns, "
            f"W_q {config.query_features}; keras.layers.GroupQueryAttention holds them "
            "(mha_multi.interop.keras.to_keras_gqa)"
        )
    if config.query_features != config.num_hiddens:
        raise ValueError(
            "the keras.layers.MultiHeadAttention converters hold the default head size "
            f"(num_heads * key_dim = num_hiddens): W_q has {config.query_features} columns, "
            f"not num_hiddens = {config.num_hiddens}; keras.layers.GroupQueryAttention takes "
            "an explicit head_dim (mha_multi.interop.keras.to_keras_gqa)"
        )


def gqa_projections(layer: keras.layers.GroupQueryAttention) -> dict[str, keras.layers.Layer]:
    """The ``EinsumDense`` projections of a built ``keras.layers.GroupQueryAttention``.

    Keyed by their names (:data:`NATIVE_GQA_PROJECTIONS`); the layer holds
    them as private attributes (``_query_dense``...), created by ``build``.

    Raises:
        ValueError: the layer is not built yet.
    """
    if not layer.built:
        raise ValueError("the keras.layers.GroupQueryAttention is not built yet: call it once")
    sublayers = (layer._query_dense, layer._key_dense, layer._value_dense, layer._output_dense)
    return {dense.name: dense for dense in sublayers}


def gqa_state(
    weights: Mapping[str, Any], num_heads: int, *, num_kv_heads: int | None = None
) -> dict[str, np.ndarray]:
    """The variables of a ``keras.layers.GroupQueryAttention`` holding canonical weights.

    Kernels ``(in, heads, head_dim)`` (``query``: ``num_heads`` heads,
    ``key``/``value``: ``num_kv_heads``) and ``(num_heads, head_dim, out)``
    (``attention_output``), biases ``(heads, head_dim)`` and ``(out,)``: the
    canonical arrays reshaped, head ``h`` in columns ``[h*dh, (h+1)*dh)`` in
    both layouts.

    Args:
        weights: canonical weights.
        num_heads: the query heads (``num_query_heads``); ``head_dim`` is
            ``W_q``'s width over it.
        num_kv_heads: the key/value heads (``num_key_value_heads``); ``None``
            reads them from ``W_k``'s width.

    Returns:
        ``query/kernel`` ... ``attention_output/bias``, keyed by the names of
        :data:`NATIVE_GQA_PROJECTIONS` (biases iff the weights have them).

    Raises:
        ValueError: invalid weights, widths no head layout of ``num_heads``
            heads explains, or ``query_size != num_hiddens`` (the layer
            projects back to the query size).
    """
    arrays, config = check_weights(weights)
    heads = spec.heads_of_weights(arrays, num_heads, num_kv_heads=num_kv_heads)
    if config.query_size != config.num_hiddens:
        raise ValueError(
            "keras.layers.GroupQueryAttention projects back to the query size: "
            f"query_size ({config.query_size}) must equal num_hiddens ({config.num_hiddens})"
        )
    head_counts = {"q": heads.num_heads, "k": heads.num_kv_heads, "v": heads.num_kv_heads}
    state = {}
    for name, letter in NATIVE_GQA_PROJECTIONS.items():
        kernel = arrays[f"W_{letter}"]
        if letter == "o":
            shape = (heads.num_heads, heads.head_dim, config.num_hiddens)
        else:
            shape = (kernel.shape[0], head_counts[letter], heads.head_dim)
        state[f"{name}/kernel"] = np.ascontiguousarray(kernel.reshape(shape))
        if config.bias:
            bias = arrays[f"b_{letter}"]
            shape = bias.shape if letter == "o" else (head_counts[letter], heads.head_dim)
            state[f"{name}/bias"] = np.ascontiguousarray(bias.reshape(shape))
    return state


def native_gqa_layer(
    weights: Mapping[str, Any],
    num_heads: int,
    *,
    num_kv_heads: int | None = None,
    device: str = "cpu",
    **kwargs: Any,
) -> keras.layers.GroupQueryAttention:
    """``keras.layers.GroupQueryAttention`` holding canonical weights, built.

    Its variables are :func:`gqa_state` of the weights. It is called
    ``(query, value, key)``; see :mod:`mha_multi.interop.keras` for how it
    computes.

    Args:
        weights: canonical weights.
        num_heads: the query heads (``num_query_heads``).
        num_kv_heads: the key/value heads; ``None`` reads them from ``W_k``'s width.
        device: ``"cpu"`` or ``"gpu"``.
        **kwargs: more ``keras.layers.GroupQueryAttention`` arguments
            (``dropout``, ``dtype``, ``name``...).

    Returns:
        The layer, built for ``(B, Q, query_size)`` queries and
        ``(B, K, key_size|value_size)`` keys and values.

    Raises:
        ValueError: as :func:`gqa_state`.
    """
    state = gqa_state(weights, num_heads, num_kv_heads=num_kv_heads)
    in_features = {name: state[f"{name}/kernel"].shape[0] for name in ("query", "key", "value")}
    _, num_kv_heads, head_dim = state["key/kernel"].shape
    with device_scope(device):
        layer = keras.layers.GroupQueryAttention(
            head_dim, num_heads, num_kv_heads, use_bias="query/bias" in state, **kwargs
        )
        layer.build(
            (None, None, in_features["query"]),
            (None, None, in_features["value"]),
            (None, None, in_features["key"]),
        )
    for name, dense in gqa_projections(layer).items():
        dense.kernel.assign(state[f"{name}/kernel"])
        if dense.bias is not None:
            dense.bias.assign(state[f"{name}/bias"])
    return layer

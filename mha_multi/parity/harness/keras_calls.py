"""A Keras layer's call, eager or compiled, and its gradients, each Keras backend's way.

How a call is compiled and differentiated differs per Keras backend
(``tf.function``, ``jax.jit`` of ``stateless_call``, ``torch.compile``); one
driver class each below, of which only the active backend's is created
(:func:`driver`). The Keras harness (:mod:`mha_multi.parity.harness.keras`)
drives the layer with them, and reads them out to the benchmark and the
tests.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import keras

from mha_multi.keras._facts import BACKEND

__all__ = [
    "ForwardFunction",
    "GradientFunction",
    "LayerCall",
    "State",
    "compile_function",
    "driver",
    "forward_function",
    "gradient_function",
    "state",
]

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
def driver() -> _Driver:
    """The driver of the Keras backend this process runs, made on first use."""
    return {"tensorflow": _TensorFlow, "jax": _Jax, "torch": _Torch}[BACKEND]()


# -- a layer's variables and its compiled functions -------------------------------


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
    return driver().compile(function)


def forward_function(call: LayerCall, *, compiled: bool) -> ForwardFunction:
    """``call`` as ``f(values, *inputs)``, eager or compiled the backend's way.

    Compiled is ``tf.function(jit_compile=True)``, ``jax.jit`` of
    ``stateless_call`` or ``torch.compile``; ``values`` is :func:`state` of
    the layer, which only JAX's functions read. PyTorch's run without
    autograd.
    """
    return driver().forward_function(call, compiled)


def gradient_function(call: LayerCall, *, wrt: int, compiled: bool) -> GradientFunction:
    """The vector-Jacobian product of ``call`` as ``g(values, inputs, cotangent)``.

    ``g`` returns the gradients of ``sum(call(*inputs) * cotangent)`` with
    respect to the first ``wrt`` inputs and to the layer's trainable
    variables (in their order), eager or compiled as in
    :func:`forward_function`.
    """
    return driver().gradient_function(call, wrt, compiled)

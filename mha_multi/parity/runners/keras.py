"""Parity runners for :mod:`mha_multi.keras`, one per Keras backend.

Keras picks its backend once per process from ``KERAS_BACKEND``; each nox
environment sets it. A runner whose backend is not the active one raises
``ImportError`` when created, so it counts as unavailable in the wrong
environment. The layer itself is backend-agnostic; only the gradients (the
tape or transformation of each framework) and the device/precision settings
are backend-specific here.
"""

from __future__ import annotations

import abc
import contextlib
import json
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import keras
import numpy as np

from mha_multi.keras import MultiHeadAttention
from mha_multi.keras._ops import to_numpy
from mha_multi.parity.runners import Runner, as_float64, is_numeric

__all__ = ["KerasJaxRunner", "KerasRunner", "KerasTensorFlowRunner", "KerasTorchRunner"]

INPUT_NAMES = ("queries", "keys", "values")


def to_float64(x: Any) -> np.ndarray:
    """A backend tensor as float64 numpy (bfloat16 goes through ml_dtypes)."""
    return as_float64(to_numpy(x).astype(np.float64))


class KerasRunner(Runner):
    """What the three Keras backends share: layer creation, conversion, calls."""

    package = "mha_multi.keras"
    #: ``keras.backend.backend()`` this runner needs.
    keras_backend: ClassVar[str]

    def __init__(self) -> None:
        active = keras.backend.backend()
        if active != self.keras_backend:
            raise ImportError(
                f"{self.name} needs KERAS_BACKEND={self.keras_backend}; "
                f"this process runs Keras on {active!r}"
            )
        self.configure()

    @abc.abstractmethod
    def configure(self) -> None:
        """Framework settings for parity: IEEE float32 matmuls, float64 support."""

    @abc.abstractmethod
    def gpu_available(self) -> bool:
        """Whether the framework under Keras sees a GPU."""

    @abc.abstractmethod
    def gradients_of(
        self,
        layer: MultiHeadAttention,
        inputs: list[Any],
        valid_lens: Any,
        *,
        causal: bool,
        output_gradient: Any,
    ) -> dict[str, Any]:
        """The VJP of the layer's output with ``output_gradient``, as backend tensors.

        Keyed ``queries``, ``keys``, ``values`` and the canonical weight names.
        """

    def device_available(self, device: str) -> bool:
        return device == "cpu" or (device == "gpu" and self.gpu_available())

    @contextlib.contextmanager
    def on(self, device: str) -> Iterator[None]:
        # No device index: Keras on PyTorch turns variables created under
        # "cpu:0" into plain tensors (its Parameter is moved with .to()).
        with keras.device(device):
            yield

    def to_native(self, x: np.ndarray, device: str = "cpu", dtype: str = "float32") -> Any:
        return keras.ops.cast(keras.ops.convert_to_tensor(np.array(x, copy=True)), dtype)

    def _lens(self, valid_lens: Any) -> Any:
        if not is_numeric(valid_lens):
            return valid_lens
        try:
            return keras.ops.convert_to_tensor(np.array(valid_lens, copy=True))
        except (TypeError, ValueError):
            # A dtype the backend has no tensors of (uint64 on PyTorch): the
            # layer takes numpy lengths as they are.
            return np.array(valid_lens, copy=True)

    def make_layer(
        self,
        num_hiddens: int,
        num_heads: int,
        *,
        device: str = "cpu",
        dtype: str = "float32",
        **kwargs: Any,
    ) -> MultiHeadAttention:
        # Every caller loads weights right away; Keras' random initializers
        # would cost a compilation per new shape on the JAX backend (about
        # half a second per layer there).
        kwargs.setdefault("kernel_initializer", "zeros")
        with self.on(device):
            return MultiHeadAttention(num_hiddens, num_heads, dtype=dtype, **kwargs)

    def call(
        self,
        layer: MultiHeadAttention,
        queries: np.ndarray,
        keys: np.ndarray,
        values: np.ndarray,
        valid_lens: Any = None,
        *,
        training: bool = False,
        device: str = "cpu",
        dtype: str = "float32",
        **kwargs: Any,
    ) -> Any:
        with self.on(device):
            tensors = [self.to_native(x, dtype=dtype) for x in (queries, keys, values)]
            result = layer(*tensors, self._lens(valid_lens), training=training, **kwargs)
        if isinstance(result, tuple):
            return tuple(to_float64(r) for r in result)
        return to_float64(result)

    def gradients(
        self,
        layer: MultiHeadAttention,
        queries: np.ndarray,
        keys: np.ndarray,
        values: np.ndarray,
        valid_lens: Any,
        *,
        causal: bool,
        output_gradient: np.ndarray,
        device: str,
        dtype: str,
    ) -> dict[str, np.ndarray]:
        with self.on(device):
            inputs = [self.to_native(x, dtype=dtype) for x in (queries, keys, values)]
            grads = self.gradients_of(
                layer,
                inputs,
                self._lens(valid_lens),
                causal=causal,
                output_gradient=self.to_native(output_gradient, dtype=dtype),
            )
        return {name: to_float64(grad) for name, grad in grads.items()}


class KerasTensorFlowRunner(KerasRunner):
    """Keras on TensorFlow; gradients with ``tf.GradientTape``."""

    name = "keras-tensorflow"
    keras_backend = "tensorflow"
    distributions = ("keras", "tensorflow")

    def configure(self) -> None:
        import tensorflow as tf

        tf.config.experimental.enable_tensor_float_32_execution(False)

    def gpu_available(self) -> bool:
        import tensorflow as tf

        return bool(tf.config.list_physical_devices("GPU"))

    def device_description(self, device: str) -> str:
        if device != "gpu":
            return "cpu"
        import tensorflow as tf

        details = tf.config.experimental.get_device_details(
            tf.config.list_physical_devices("GPU")[0]
        )
        return str(details.get("device_name", "gpu"))

    def gradients_of(
        self,
        layer: MultiHeadAttention,
        inputs: list[Any],
        valid_lens: Any,
        *,
        causal: bool,
        output_gradient: Any,
    ) -> dict[str, Any]:
        import tensorflow as tf

        variables = layer.canonical_variables()
        with tf.GradientTape() as tape:
            tape.watch(inputs)
            output = layer(*inputs, valid_lens, causal=causal, training=False)
        grads = tape.gradient(
            output, [*inputs, *variables.values()], output_gradients=output_gradient
        )
        return dict(zip([*INPUT_NAMES, *variables], grads, strict=True))


class KerasJaxRunner(KerasRunner):
    """Keras on JAX; calls and gradients ``jax.jit``-compiled over ``Layer.stateless_call``.

    Keras' JAX users run compiled steps (``jit_compile`` defaults to on
    there); op by op, JAX compiles every operation again for every new
    shape, which made this backend's test session the slowest. One compiled
    program per layer configuration, call flags and input shapes is cached
    and shared by every layer of that configuration: it is evaluated on a
    template layer of the configuration (``get_config`` without the name)
    with the variable values of the layer under test, which is what
    ``stateless_call`` is for. Calls with values that cannot be traced
    (a ``causal`` that is not a bool, non-numeric lengths) or in training
    go through the layer eagerly, as a user's call does.
    """

    name = "keras-jax"
    keras_backend = "jax"
    distributions = ("keras", "jax", "jaxlib")

    def __init__(self) -> None:
        super().__init__()
        self._compiled: dict[tuple[Any, ...], Callable[..., Any]] = {}
        self._templates: dict[str, MultiHeadAttention] = {}

    def configure(self) -> None:
        import jax

        # float64 parity needs 64-bit arrays; float32 parity needs IEEE matmuls.
        jax.config.update("jax_enable_x64", True)
        jax.config.update("jax_default_matmul_precision", "highest")

    def _template(self, layer: MultiHeadAttention) -> tuple[str, MultiHeadAttention]:
        config = layer.get_config()
        config.pop("name", None)
        key = json.dumps(config, sort_keys=True, default=str)
        if key not in self._templates:
            self._templates[key] = MultiHeadAttention.from_config(config)
        return key, self._templates[key]

    def _state(
        self, template: MultiHeadAttention, layer: MultiHeadAttention
    ) -> tuple[list[Any], list[Any]]:
        """``layer``'s variable values in the order of ``template``'s variables."""
        by_path = {v.path.split("/", 1)[-1]: v.value for v in layer.variables}

        def values(variables: list[Any]) -> list[Any]:
            return [by_path[v.path.split("/", 1)[-1]] for v in variables]

        return values(template.trainable_variables), values(template.non_trainable_variables)

    def _forward(
        self, layer: MultiHeadAttention, causal: bool, return_attention_weights: bool
    ) -> tuple[MultiHeadAttention, Callable[..., Any]]:
        """The template of ``layer`` and its forward ``(trainable, non_trainable, *inputs)``."""
        template = self._template(layer)[1]

        def forward(trainable: list[Any], non_trainable: list[Any], *inputs: Any) -> Any:
            output, _ = template.stateless_call(
                trainable,
                non_trainable,
                *inputs,
                causal=causal,
                return_attention_weights=return_attention_weights,
                training=False,
            )
            return output

        return template, forward

    def _cached(self, kind: str, layer: MultiHeadAttention, *flags: bool) -> Any:
        key = (kind, self._template(layer)[0], *flags)
        if key not in self._compiled:
            import jax

            template, forward = self._forward(layer, *flags)
            if kind == "call":
                self._compiled[key] = (template, jax.jit(forward))
            else:

                def vjp(
                    trainable: list[Any],
                    non_trainable: list[Any],
                    inputs: list[Any],
                    lens: Any,
                    cotangent: Any,
                ) -> Any:
                    def of_differentiable(trainable: list[Any], *inputs: Any) -> Any:
                        return forward(trainable, non_trainable, *inputs, lens)

                    _, pullback = jax.vjp(of_differentiable, trainable, *inputs)
                    return pullback(cotangent)

                self._compiled[key] = (template, jax.jit(vjp))
        return self._compiled[key]

    def call(
        self,
        layer: MultiHeadAttention,
        queries: np.ndarray,
        keys: np.ndarray,
        values: np.ndarray,
        valid_lens: Any = None,
        *,
        training: bool = False,
        device: str = "cpu",
        dtype: str = "float32",
        **kwargs: Any,
    ) -> Any:
        causal = kwargs.get("causal", False)
        return_attention_weights = kwargs.get("return_attention_weights", False)
        traceable = (
            not training
            and set(kwargs) <= {"causal", "return_attention_weights"}
            and type(causal) is bool
            and type(return_attention_weights) is bool
            and (valid_lens is None or is_numeric(valid_lens))
        )
        if not traceable:
            return super().call(
                layer,
                queries,
                keys,
                values,
                valid_lens,
                training=training,
                device=device,
                dtype=dtype,
                **kwargs,
            )
        template, compiled = self._cached("call", layer, causal, return_attention_weights)
        with self.on(device):
            tensors = [self.to_native(x, dtype=dtype) for x in (queries, keys, values)]
            result = compiled(*self._state(template, layer), *tensors, self._lens(valid_lens))
        if isinstance(result, tuple):
            return tuple(to_float64(r) for r in result)
        return to_float64(result)

    def gpu_available(self) -> bool:
        import jax

        try:
            return bool(jax.devices("gpu"))
        except RuntimeError:
            return False

    def device_description(self, device: str) -> str:
        if device != "gpu":
            return "cpu"
        import jax

        return str(jax.devices("gpu")[0].device_kind)

    def gradients_of(
        self,
        layer: MultiHeadAttention,
        inputs: list[Any],
        valid_lens: Any,
        *,
        causal: bool,
        output_gradient: Any,
    ) -> dict[str, Any]:
        template, vjp = self._cached("vjp", layer, causal, False)
        trainable, non_trainable = self._state(template, layer)
        weight_grads, *input_grads = vjp(
            trainable, non_trainable, list(inputs), valid_lens, output_gradient
        )
        grads = dict(zip(INPUT_NAMES, input_grads, strict=True))
        for name, variable in template.canonical_variables().items():
            index = next(i for i, v in enumerate(template.trainable_variables) if v is variable)
            grads[name] = weight_grads[index]
        return grads


class KerasTorchRunner(KerasRunner):
    """Keras on PyTorch; gradients with ``torch.autograd.grad``."""

    name = "keras-torch"
    keras_backend = "torch"
    distributions = ("keras", "torch")

    def configure(self) -> None:
        import torch

        torch.set_float32_matmul_precision("highest")
        torch.backends.cudnn.allow_tf32 = False

    def gpu_available(self) -> bool:
        import torch

        return torch.cuda.is_available()

    def device_description(self, device: str) -> str:
        if device != "gpu":
            return "cpu"
        import torch

        return torch.cuda.get_device_name()

    def gradients_of(
        self,
        layer: MultiHeadAttention,
        inputs: list[Any],
        valid_lens: Any,
        *,
        causal: bool,
        output_gradient: Any,
    ) -> dict[str, Any]:
        import torch

        inputs = [x.detach().requires_grad_(True) for x in inputs]
        variables = layer.canonical_variables()
        output = layer(*inputs, valid_lens, causal=causal, training=False)
        grads = torch.autograd.grad(
            output,
            [*inputs, *(v.value for v in variables.values())],
            grad_outputs=output_gradient,
        )
        return dict(zip([*INPUT_NAMES, *variables], grads, strict=True))

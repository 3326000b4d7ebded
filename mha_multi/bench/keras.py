"""Keras 3 benchmark: ours (fused and generic) vs ``keras.layers.MultiHeadAttention``.

Runs on the Keras backend of the process (``KERAS_BACKEND``: TensorFlow,
JAX or PyTorch), in two execution modes, each reported as a table of its own:

* eager: the layers called as they are;
* compiled: what is natural on the backend, ``tf.function(jit_compile=True)``
  (TensorFlow), ``jax.jit`` of ``Layer.stateless_call`` (JAX),
  ``torch.compile`` (PyTorch); forward+backward is compiled as one program
  (the gradient inside the compiled function) where the framework allows.

Both layers see the same key padding: ours as ``valid_lens``, Keras' as an
``attention_mask`` with ``True`` where a key is *visible* (Keras' polarity).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import keras
import numpy as np

from mha_multi.bench.common import Shape
from mha_multi.bench.driver import Framework, score_bytes
from mha_multi.keras import MultiHeadAttention

BACKEND = keras.backend.backend()
COMPILERS = {
    "tensorflow": "tf.function(jit_compile=True)",
    "jax": "jax.jit of stateless_call",
    "torch": "torch.compile",
}


@dataclass
class Implementation:
    """A layer and how to call it on ``(x, lens, mask)``."""

    layer: keras.layers.Layer
    arguments: Callable[[Any, Any, Any], tuple[tuple, dict]]
    takes_first: bool  # the call returns a tuple whose first item is the output

    def __call__(self, x: Any, lens: Any, mask: Any) -> Any:
        args, kwargs = self.arguments(x, lens, mask)
        result = self.layer(*args, training=False, **kwargs)
        return result[0] if self.takes_first else result

    def stateless(self, trainable: list, non_trainable: list, x: Any, lens: Any, mask: Any) -> Any:
        args, kwargs = self.arguments(x, lens, mask)
        result, _ = self.layer.stateless_call(
            trainable, non_trainable, *args, training=False, **kwargs
        )
        return result[0] if self.takes_first else result


def _forward(impl: Implementation, args: tuple, compiled: bool) -> Callable[[], Any]:
    """One forward pass, eager or compiled."""
    if BACKEND == "tensorflow":
        import tensorflow as tf

        function = tf.function(lambda *a: impl(*a), jit_compile=True) if compiled else impl
        return lambda: function(*args)
    if BACKEND == "jax":
        import jax

        if not compiled:
            return lambda: impl(*args)
        trainable = [v.value for v in impl.layer.trainable_variables]
        non_trainable = [v.value for v in impl.layer.non_trainable_variables]
        function = jax.jit(impl.stateless)
        return lambda: function(trainable, non_trainable, *args)
    import torch

    function = torch.compile(lambda *a: impl(*a)) if compiled else impl

    def step() -> Any:
        with torch.no_grad():
            return function(*args)

    return step


def _forward_backward(impl: Implementation, args: tuple, compiled: bool) -> Callable[[], Any]:
    """The gradients of ``sum(output)`` with respect to input and weights, eager or compiled."""
    x, lens, mask = args
    variables = impl.layer.trainable_variables
    if BACKEND == "tensorflow":
        import tensorflow as tf

        def gradients(x: Any, lens: Any, mask: Any) -> Any:
            with tf.GradientTape() as tape:
                tape.watch(x)
                loss = tf.reduce_sum(impl(x, lens, mask))
            return tape.gradient(loss, [x, *variables])

        function = tf.function(gradients, jit_compile=True) if compiled else gradients
        return lambda: function(x, lens, mask)
    if BACKEND == "jax":
        import jax
        import jax.numpy as jnp

        trainable = [v.value for v in variables]
        non_trainable = [v.value for v in impl.layer.non_trainable_variables]

        def loss(trainable: list, x: Any) -> Any:
            return jnp.sum(impl.stateless(trainable, non_trainable, x, lens, mask))

        grad = jax.grad(loss, argnums=(0, 1))
        function = jax.jit(grad) if compiled else grad
        return lambda: function(trainable, x)
    import torch

    def summed(x: Any, lens: Any, mask: Any) -> Any:
        return impl(x, lens, mask).sum()

    function = torch.compile(summed) if compiled else summed

    def step() -> Any:
        inputs = x.detach().requires_grad_(True)
        return torch.autograd.grad(
            function(inputs, lens, mask), [inputs, *(v.value for v in variables)]
        )

    return step


class Keras(Framework):
    """The active Keras backend on the CPU, eager and compiled."""

    name = f"keras-{BACKEND}"
    executions = ("eager", "compiled")
    gemm_op = "keras.ops.matmul"

    def describe(self, device: str, execution: str | None) -> str:
        how = "layers called eagerly" if execution == "eager" else COMPILERS[BACKEND]
        return f"{device}; {how}"

    def versions(self) -> dict[str, str]:
        return {"keras": keras.__version__, BACKEND: __import__(BACKEND).__version__}

    def array(self, value: np.ndarray, device: str, dtype: str) -> Any:
        return keras.ops.convert_to_tensor(value, dtype=dtype)

    def matmul(self, a: Any, b: Any) -> Any:
        return keras.ops.matmul(a, b)

    def convert(
        self, x: np.ndarray, lens: np.ndarray, visible: np.ndarray, device: str, dtype: str
    ) -> tuple[Any, ...]:
        mask = visible[:, None, :]  # (B, 1, N): the same keys for every query
        lens = lens.astype(np.int32)
        return self.array(x, device, dtype), *map(keras.ops.convert_to_tensor, (lens, mask))

    def build(self, shape: Shape, device: str, dtype: str) -> dict[str, Implementation]:
        d, h = shape.num_hiddens, shape.num_heads
        ours = MultiHeadAttention(d, h, query_size=d, key_size=d, value_size=d)
        native = keras.layers.MultiHeadAttention(num_heads=h, key_dim=d // h, use_bias=False)
        x = keras.ops.zeros((1, 2, d))
        native(x, x)  # builds the projections
        return {
            "ours": Implementation(ours, lambda x, lens, mask: ((x, x, x, lens), {}), False),
            "ours (generic)": Implementation(
                ours,
                lambda x, lens, mask: ((x, x, x, lens), {"return_attention_weights": True}),
                True,
            ),
            "native": Implementation(
                native, lambda x, lens, mask: ((x, x), {"attention_mask": mask}), False
            ),
        }

    def step(self, impl: Any, args: Any, mode: str, execution: str | None) -> Callable[[], Any]:
        make = _forward if mode == "forward" else _forward_backward
        return make(impl, args, compiled=execution == "compiled")

    def sync(self, value: Any) -> None:
        if BACKEND == "jax":
            import jax

            jax.block_until_ready(value)
            return
        leaves = value if isinstance(value, (list, tuple)) else [value]
        for leaf in leaves:
            # Reading one element waits for the op that produced the array.
            keras.ops.convert_to_numpy(keras.ops.reshape(leaf, (-1,))[:1])

    def scratch_bytes(
        self, implementation: str, shape: Shape, dtype: str, device: str, *, training: bool
    ) -> int:
        if implementation == "ours" and BACKEND == "torch":
            return 0  # SDPA's CPU kernel works in blocks
        # Scores, masked scores and weights, each (B*H, N, N).
        return score_bytes(shape, 3)


FRAMEWORK = Keras()

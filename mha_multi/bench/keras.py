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

import argparse
import gc
import json
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import keras
import numpy as np

from mha_multi.bench.common import (
    Measurement,
    Shape,
    attention_flops,
    median_seconds,
    peak_rss_mib,
    reset_peak_rss,
)
from mha_multi.keras import MultiHeadAttention

BACKEND = keras.backend.backend()
NAME = f"keras-{BACKEND}"
IMPLEMENTATIONS = ("ours", "ours (generic)", "native")
EXECUTIONS = ("eager", "compiled")
COMPILERS = {
    "tensorflow": "tf.function(jit_compile=True)",
    "jax": "jax.jit of stateless_call",
    "torch": "torch.compile",
}
#: Paths that materialise (B*H, N, N) scores are not run past this estimate.
LIMIT_BYTES = 4 << 30


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


def implementations(shape: Shape) -> dict[str, Implementation]:
    """name -> implementation, built for ``shape`` in float32."""
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


def inputs(shape: Shape) -> tuple[Any, Any, Any]:
    """``x`` ``(B, N, D)``, ``lens`` ``(B,)`` and Keras' ``attention_mask`` ``(B, 1, N)``."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((shape.batch, shape.length, shape.num_hiddens), dtype=np.float32)
    # Key padding: example b keeps N - b*N/(2B) tokens (as in the torch benchmark).
    lens = np.array(
        [shape.length - b * shape.length // (2 * shape.batch) for b in range(shape.batch)],
        dtype=np.int32,
    )
    mask = np.arange(shape.length)[None, None, :] < lens[:, None, None]  # True = attend
    return tuple(keras.ops.convert_to_tensor(a) for a in (x, lens, mask))


def sync(tree: Any) -> None:
    """Blocks until every array in ``tree`` is computed."""
    if BACKEND == "jax":
        import jax

        jax.block_until_ready(tree)
        return
    leaves = tree if isinstance(tree, (list, tuple)) else [tree]
    for leaf in leaves:
        # Reading one element waits for the op that produced the array.
        keras.ops.convert_to_numpy(keras.ops.reshape(leaf, (-1,))[:1])


def scores_bytes(implementation: str, shape: Shape) -> int:
    """Rough peak of the (B*H, N, N) arrays a forward pass holds (float32)."""
    one = shape.batch * shape.num_heads * shape.length**2 * 4
    if implementation == "ours" and BACKEND == "torch":
        return 0  # SDPA's CPU kernel works in blocks
    return 3 * one


def _forward_steps(impl: Implementation, x: Any, lens: Any, mask: Any) -> dict[str, Callable]:
    """execution -> a step running one forward pass (or ``None`` if it cannot compile)."""
    if BACKEND == "tensorflow":
        import tensorflow as tf

        compiled = tf.function(lambda x, lens, mask: impl(x, lens, mask), jit_compile=True)
        return {"eager": lambda: impl(x, lens, mask), "compiled": lambda: compiled(x, lens, mask)}
    if BACKEND == "jax":
        import jax

        trainable = [v.value for v in impl.layer.trainable_variables]
        non_trainable = [v.value for v in impl.layer.non_trainable_variables]
        compiled = jax.jit(impl.stateless)
        return {
            "eager": lambda: impl(x, lens, mask),
            "compiled": lambda: compiled(trainable, non_trainable, x, lens, mask),
        }
    import torch

    compiled = torch.compile(lambda x, lens, mask: impl(x, lens, mask))

    def run(function: Callable) -> Callable:
        def step() -> Any:
            with torch.no_grad():
                return function(x, lens, mask)

        return step

    return {"eager": run(impl), "compiled": run(compiled)}


def _backward_steps(impl: Implementation, x: Any, lens: Any, mask: Any) -> dict[str, Callable]:
    """execution -> a step computing the gradients of ``sum(output)`` w.r.t. input and weights."""
    variables = impl.layer.trainable_variables
    if BACKEND == "tensorflow":
        import tensorflow as tf

        def gradients(x: Any, lens: Any, mask: Any) -> Any:
            with tf.GradientTape() as tape:
                tape.watch(x)
                loss = tf.reduce_sum(impl(x, lens, mask))
            return tape.gradient(loss, [x, *variables])

        compiled = tf.function(gradients, jit_compile=True)
        return {
            "eager": lambda: gradients(x, lens, mask),
            "compiled": lambda: compiled(x, lens, mask),
        }
    if BACKEND == "jax":
        import jax
        import jax.numpy as jnp

        trainable = [v.value for v in variables]
        non_trainable = [v.value for v in impl.layer.non_trainable_variables]

        def loss(trainable: list, x: Any) -> Any:
            return jnp.sum(impl.stateless(trainable, non_trainable, x, lens, mask))

        gradients = jax.grad(loss, argnums=(0, 1))
        compiled = jax.jit(gradients)
        return {
            "eager": lambda: gradients(trainable, x),
            "compiled": lambda: compiled(trainable, x),
        }
    import torch

    def forward(x: Any, lens: Any, mask: Any) -> Any:
        return impl(x, lens, mask).sum()

    compiled = torch.compile(forward)

    def run(function: Callable) -> Callable:
        def step() -> Any:
            inputs = x.detach().requires_grad_(True)
            return torch.autograd.grad(
                function(inputs, lens, mask), [inputs, *(v.value for v in variables)]
            )

        return step

    return {"eager": run(forward), "compiled": run(compiled)}


def gemm_rate(size: int = 2048) -> float:
    """Measured GFLOP/s of a ``size`` x ``size`` float32 matrix product on this backend."""
    rng = np.random.default_rng(0)
    a, b = (
        keras.ops.convert_to_tensor(rng.standard_normal((size, size), np.float32)) for _ in "ab"
    )
    return 2 * size**3 / median_seconds(lambda: sync(keras.ops.matmul(a, b))) / 1e9


def time_layers(lengths: Sequence[int], base: Shape) -> dict[str, list[Measurement]]:
    """execution -> timings of every implementation, forward and forward+backward."""
    measurements: dict[str, list[Measurement]] = {e: [] for e in EXECUTIONS}
    for length in lengths:
        shape = Shape(base.batch, length, base.num_hiddens, base.num_heads)
        x, lens, mask = inputs(shape)
        flops = attention_flops(shape)
        for name, impl in implementations(shape).items():
            too_large = scores_bytes(name, shape) > LIMIT_BYTES
            steps = (
                {}
                if too_large
                else {
                    "forward": _forward_steps(impl, x, lens, mask),
                    "forward+backward": _backward_steps(impl, x, lens, mask),
                }
            )
            for execution in EXECUTIONS:
                for mode, factor in (("forward", 1), ("forward+backward", 3)):
                    kwargs = {
                        "backend": f"{NAME} ({execution})",
                        "implementation": name,
                        "mode": mode,
                        "device": "cpu",
                        "dtype": "float32",
                        "length": length,
                        "shape": vars(shape),
                    }
                    if too_large:
                        measurements[execution].append(Measurement(note="too large", **kwargs))
                        continue
                    step = steps[mode][execution]
                    try:
                        seconds = median_seconds(lambda step=step: sync(step()))
                    except Exception as error:  # a compiler that cannot take the layer
                        note = f"failed: {type(error).__name__}"
                        print(f"[bench] {kwargs['backend']} {name} {mode}: {error}", flush=True)
                        measurements[execution].append(Measurement(note=note, **kwargs))
                        continue
                    measurements[execution].append(
                        Measurement(
                            seconds=seconds, gflops=factor * flops / seconds / 1e9, **kwargs
                        )
                    )
            gc.collect()
    return measurements


def peak_memory_mib(implementation: str, length: int, base: Shape) -> float:
    """Peak resident memory of one eager forward pass above its inputs and weights."""
    shape = Shape(base.batch, length, base.num_hiddens, base.num_heads)
    x, lens, mask = inputs(shape)
    impl = implementations(shape)[implementation]
    step = _forward_steps(impl, x, lens, mask)["eager"]
    small = Shape(base.batch, 16, base.num_hiddens, base.num_heads)
    sync(_forward_steps(impl, *inputs(small))["eager"]())  # load kernels, thread pools
    gc.collect()
    reset_peak_rss()
    before = peak_rss_mib()
    sync(step())
    return peak_rss_mib() - before


def measure_memory(lengths: Sequence[int], base: Shape) -> list[Measurement]:
    """Each figure in a fresh process, since a process's peak RSS never falls."""
    measurements = []
    for length in lengths:
        shape = Shape(base.batch, length, base.num_hiddens, base.num_heads)
        for implementation in IMPLEMENTATIONS:
            kwargs = {
                "backend": f"{NAME} (eager)",
                "implementation": implementation,
                "mode": "peak memory",
                "device": "cpu",
                "dtype": "float32",
                "length": length,
                "shape": vars(shape),
            }
            estimate = scores_bytes(implementation, shape)
            if estimate > LIMIT_BYTES:
                gib = estimate / 2**30
                measurements.append(Measurement(note=f"skipped (~{gib:.0f} GiB)", **kwargs))
                continue
            command = [
                sys.executable,
                "-m",
                "mha_multi.bench.keras",
                "memory",
                implementation,
                str(length),
            ]
            output = subprocess.run(command, capture_output=True, text=True, check=True).stdout
            measurements.append(Measurement(peak_mib=float(output.split()[-1]), **kwargs))
    return measurements


def _versions() -> dict[str, str]:
    versions = {"keras": keras.__version__}
    module = {"tensorflow": "tensorflow", "jax": "jax", "torch": "torch"}[BACKEND]
    versions[module] = __import__(module).__version__
    return versions


def run(
    *,
    lengths: Sequence[int] = (128, 512, 2048),
    memory_lengths: Sequence[int] = (1024, 2048, 4096, 8192),
    base: Shape | None = None,
) -> list[dict[str, object]]:
    """The whole Keras benchmark on the active backend: eager and compiled results (CPU)."""
    base = base or Shape()
    rate = gemm_rate()
    timings = time_layers(lengths, base)
    memory = measure_memory(memory_lengths, base)
    results = []
    for execution in EXECUTIONS:
        gemm = Measurement(
            f"{NAME} ({execution})",
            "gemm",
            "gemm",
            "cpu",
            "float32",
            2048,
            gflops=rate,
            note="2048x2048 float32, keras.ops.matmul",
        )
        measurements = [gemm, *timings[execution], *(memory if execution == "eager" else [])]
        how = "layers called eagerly" if execution == "eager" else COMPILERS[BACKEND]
        results.append(
            {
                "backend": f"{NAME} ({execution})",
                "device": f"cpu; {how}",
                "versions": _versions(),
                "measurements": [m.as_dict() for m in measurements],
            }
        )
    return results


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    commands = parser.add_subparsers(dest="command", required=True)
    memory = commands.add_parser("memory")
    memory.add_argument("implementation", choices=IMPLEMENTATIONS)
    memory.add_argument("length", type=int)
    args = parser.parse_args(argv)
    print(json.dumps(peak_memory_mib(args.implementation, args.length, Shape())))


if __name__ == "__main__":
    main()

"""JAX benchmark: ours (Flax NNX) vs ``flax.nnx.MultiHeadAttention``.

``ours`` is the layer's default call; ``ours (generic)`` asks for the
attention weights, which forces the generic path; ``ours (fused, xla)``
runs the fused path through XLA's kernel (``implementation="xla"``), the
figures behind the default's choice of kernel. Every implementation runs
under ``nnx.jit``; forward+backward is ``nnx.grad`` of the summed output with
respect to the parameters and the input, under ``nnx.jit``. The native
layer gets the boolean mask equivalent to the key lengths (Flax's ``True`` =
attend, shape ``(B, 1, 1, N)``).
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
from collections.abc import Callable, Sequence
from importlib.metadata import version
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mha_multi.bench.common import (
    Measurement,
    Shape,
    attention_flops,
    median_seconds,
    peak_rss_mib,
    reset_peak_rss,
)
from mha_multi.jax import MultiHeadAttention

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
#: Past this estimate of what one pass holds at once, a configuration is not
#: run. XLA's kernel on a CPU materialises the (B, H, N, N) scores on every
#: path, ours included; cuDNN's flash kernel does not.
LIMIT_BYTES = 4 << 30
IMPLEMENTATIONS = ("ours", "native", "ours (generic)", "ours (fused, xla)")

Call = Callable[[nnx.Module, jax.Array, jax.Array, jax.Array], jax.Array]


def _inputs(shape: Shape, device: jax.Device, dtype: Any) -> tuple[jax.Array, ...]:
    x = np.random.default_rng(0).standard_normal((shape.batch, shape.length, shape.num_hiddens))
    # Key padding: example b keeps N - b*N/(2B) tokens.
    lens = np.array(
        [shape.length - b * shape.length // (2 * shape.batch) for b in range(shape.batch)],
        dtype=np.int32,
    )
    # Flax's mask: True where a key takes part, broadcast over heads and queries.
    mask = (np.arange(shape.length)[None, :] < lens[:, None])[:, None, None, :]
    x = x.astype(np.dtype(dtype))
    return tuple(jax.device_put(a, device) for a in (x, lens, mask))


def _implementations(
    shape: Shape, device: jax.Device, dtype: Any
) -> dict[str, tuple[nnx.Module, Call]]:
    """name -> (module, call(module, x, lens, mask)), each call a pure function."""
    d, h = shape.num_hiddens, shape.num_heads
    sizes = {"query_size": d, "key_size": d, "value_size": d, "param_dtype": dtype}
    with jax.default_device(device):
        ours = MultiHeadAttention(d, h, rngs=nnx.Rngs(0), **sizes)
        fused = MultiHeadAttention(d, h, implementation="xla", rngs=nnx.Rngs(0), **sizes)
        native = nnx.MultiHeadAttention(
            num_heads=h,
            in_features=d,
            qkv_features=d,
            decode=False,
            use_bias=False,
            param_dtype=dtype,
            rngs=nnx.Rngs(0),
        )
    for module in (ours, fused, native):
        module.eval()

    def ours_call(layer: MultiHeadAttention, x: jax.Array, lens: jax.Array, mask: jax.Array):
        return layer(x, x, x, lens)

    def generic_call(layer: MultiHeadAttention, x: jax.Array, lens: jax.Array, mask: jax.Array):
        return layer(x, x, x, lens, return_attention_weights=True)[0]

    def native_call(layer: nnx.MultiHeadAttention, x: jax.Array, lens: jax.Array, mask: jax.Array):
        return layer(x, mask=mask, deterministic=True)

    return {
        "ours": (ours, ours_call),
        "ours (generic)": (ours, generic_call),
        "native": (native, native_call),
        "ours (fused, xla)": (fused, ours_call),
    }


def _attention_bytes(shape: Shape, dtype: Any, implementation: str, platform: str) -> int:
    """What one forward pass holds at once: three ``(B, H, N, N)`` arrays (scores,
    masked scores, weights), float32 for 16-bit inputs; none for ours on cuDNN
    (the default for 16-bit inputs on a GPU)."""
    if implementation == "ours" and platform == "gpu" and dtype != jnp.float32:
        return 0
    return 3 * shape.batch * shape.num_heads * shape.length**2 * 4


def gemm_rate(device: jax.Device, dtype: Any, size: int = 2048) -> float:
    """Measured GFLOP/s of a jitted ``size`` x ``size`` matrix product."""
    rng = np.random.default_rng(1)
    a, b = (
        jax.device_put(rng.standard_normal((size, size)).astype(np.dtype(dtype)), device)
        for _ in range(2)
    )
    matmul = jax.jit(jnp.matmul)

    def step() -> None:
        matmul(a, b).block_until_ready()

    return 2 * size**3 / median_seconds(step) / 1e9


def _steps(call: Call) -> tuple[Callable, Callable]:
    """Jitted forward and forward+backward of ``call``."""

    @nnx.jit
    def forward(module: nnx.Module, x: jax.Array, lens: jax.Array, mask: jax.Array) -> jax.Array:
        return call(module, x, lens, mask)

    @nnx.jit
    def forward_backward(
        module: nnx.Module, x: jax.Array, lens: jax.Array, mask: jax.Array
    ) -> tuple[Any, jax.Array]:
        def loss(module: nnx.Module, x: jax.Array) -> jax.Array:
            return call(module, x, lens, mask).astype(jnp.float32).sum()

        return nnx.grad(loss, argnums=(0, 1))(module, x)

    return forward, forward_backward


def time_layers(
    lengths: Sequence[int], device: jax.Device, dtype_name: str, base: Shape
) -> list[Measurement]:
    dtype = DTYPES[dtype_name]
    measurements = []
    for length in lengths:
        shape = Shape(base.batch, length, base.num_hiddens, base.num_heads)
        args = _inputs(shape, device, dtype)
        flops = attention_flops(shape)
        for name, (module, call) in _implementations(shape, device, dtype).items():
            kwargs = {
                "backend": "jax",
                "implementation": name,
                "device": device.platform,
                "dtype": dtype_name,
                "length": length,
                "shape": vars(shape),
            }
            if _attention_bytes(shape, dtype, name, device.platform) > LIMIT_BYTES:
                for mode in ("forward", "forward+backward"):
                    measurements.append(Measurement(mode=mode, note="too large", **kwargs))
                continue
            forward, forward_backward = _steps(call)
            for mode, jitted, factor in (
                ("forward", forward, 1),
                ("forward+backward", forward_backward, 3),
            ):

                def step(
                    jitted: Callable = jitted, module: nnx.Module = module, args: tuple = args
                ) -> None:
                    jax.block_until_ready(jitted(module, *args))

                seconds = median_seconds(step)
                measurements.append(
                    Measurement(
                        mode=mode, seconds=seconds, gflops=factor * flops / seconds / 1e9, **kwargs
                    )
                )
            del forward, forward_backward
            gc.collect()
    return measurements


def _device(platform: str) -> jax.Device:
    return jax.devices(platform)[0]


def peak_memory_mib(implementation: str, length: int, platform: str, base: Shape) -> float:
    """Peak memory of one jitted forward pass above what its inputs and weights hold.

    The pass is compiled for its shapes first, so compilation is not counted.
    """
    shape = Shape(base.batch, length, base.num_hiddens, base.num_heads)
    device = _device(platform)
    args = _inputs(shape, device, jnp.float32)
    module, call = _implementations(shape, device, jnp.float32)[implementation]
    graphdef, state = nnx.split(module)

    def forward(state: nnx.State, x: jax.Array, lens: jax.Array, mask: jax.Array) -> jax.Array:
        return call(nnx.merge(graphdef, state), x, lens, mask)

    compiled = jax.jit(forward).lower(state, *args).compile()
    gc.collect()
    if platform == "gpu":
        stats = device.memory_stats() or {}
        before = stats.get("bytes_in_use", 0)
        jax.block_until_ready(compiled(state, *args))
        stats = device.memory_stats() or {}
        return (stats.get("peak_bytes_in_use", 0) - before) / 2**20
    reset_peak_rss()
    before = peak_rss_mib()
    jax.block_until_ready(compiled(state, *args))
    return peak_rss_mib() - before


def measure_memory(lengths: Sequence[int], platform: str, base: Shape) -> list[Measurement]:
    """Each figure in a fresh process, since a process's peak RSS never falls."""
    measurements = []
    for length in lengths:
        shape = Shape(base.batch, length, base.num_hiddens, base.num_heads)
        for implementation in IMPLEMENTATIONS:
            kwargs = {
                "backend": "jax",
                "implementation": implementation,
                "mode": "peak memory",
                "device": platform,
                "dtype": "float32",
                "length": length,
                "shape": vars(shape),
            }
            estimate = _attention_bytes(shape, jnp.float32, implementation, platform)
            if estimate > LIMIT_BYTES:
                note = f"skipped (~{estimate / 2**30:.0f} GiB)"
                measurements.append(Measurement(note=note, **kwargs))
                continue
            command = [
                sys.executable,
                "-m",
                "mha_multi.bench.jax",
                "memory",
                implementation,
                str(length),
                platform,
            ]
            output = subprocess.run(command, capture_output=True, text=True, check=True).stdout
            measurements.append(Measurement(peak_mib=float(output.split()[-1]), **kwargs))
    return measurements


def _gpu_available() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


def run(
    *,
    lengths: Sequence[int] = (128, 512, 2048),
    memory_lengths: Sequence[int] = (1024, 2048, 4096, 8192),
    base: Shape | None = None,
) -> list[dict[str, object]]:
    """The whole JAX benchmark, one result per platform here."""
    base = base or Shape()
    # IEEE float32 products on GPUs (no TF32), for ours and the native layer alike.
    jax.config.update("jax_default_matmul_precision", "highest")
    platforms = ["cpu"] + (["gpu"] if _gpu_available() else [])
    results = []
    for platform in platforms:
        device = _device(platform)
        # On CPU only float32 is meaningful; on a GPU, bfloat16 is what runs fast.
        dtypes = ["float32"] if platform == "cpu" else ["float32", "bfloat16"]
        measurements = []
        for dtype_name in dtypes:
            rate = gemm_rate(device, DTYPES[dtype_name])
            measurements.append(
                Measurement(
                    "jax",
                    "gemm",
                    "gemm",
                    platform,
                    dtype_name,
                    2048,
                    gflops=rate,
                    note=f"2048x2048 {dtype_name}",
                )
            )
            measurements += time_layers(lengths, device, dtype_name, base)
        measurements += measure_memory(memory_lengths, platform, base)
        results.append(
            {
                "backend": "jax",
                "device": device.device_kind if platform == "gpu" else "cpu",
                "versions": {name: version(name) for name in ("jax", "jaxlib", "flax")},
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
    memory.add_argument("platform")
    args = parser.parse_args(argv)
    jax.config.update("jax_default_matmul_precision", "highest")
    print(json.dumps(peak_memory_mib(args.implementation, args.length, args.platform, Shape())))


if __name__ == "__main__":
    main()

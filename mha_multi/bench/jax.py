"""JAX benchmark: ours (Flax NNX) vs ``flax.nnx.MultiHeadAttention``.

``ours`` is the layer's default call; ``ours (generic)`` asks for the
attention weights, which forces the generic path; ``ours (fused, xla)``
runs the fused path through XLA's kernel (``implementation="xla"``), the
figures behind the default's choice of kernel. Every implementation runs
under ``nnx.jit``; forward+backward is ``nnx.grad`` of the summed output with
respect to the parameters and the input, under ``nnx.jit``. The native
layer holds our layer's weights and gets the boolean mask equivalent to the
key lengths (Flax's ``True`` = attend, shape ``(B, 1, 1, N)``). Generation
compiles every way as Flax's guide writes a fast loop (:func:`staged`: the
module split once, ``jax.jit`` of a function that merges it), as the
hand-written step is compiled, and, as ``jax (eager)``, calls ours as it is
(its call plan), against the same jitted hand-written step.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from collections.abc import Callable
from importlib.metadata import version
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mha_multi.bench.common import Shape, median_seconds, score_bytes
from mha_multi.bench.framework import Framework
from mha_multi.bench.generate import GenerationShape, Generator, rotary_angles
from mha_multi.jax import MultiHeadAttention, get_weights
from mha_multi.jax._facts import batch_pieces
from mha_multi.parity.harness import jax as backend

Call = Callable[[nnx.Module, jax.Array, jax.Array, jax.Array], jax.Array]


def _ours(layer: MultiHeadAttention, x: jax.Array, lens: jax.Array, mask: jax.Array) -> jax.Array:
    return layer(x, x, x, lens)


def _generic(
    layer: MultiHeadAttention, x: jax.Array, lens: jax.Array, mask: jax.Array
) -> jax.Array:
    return layer(x, x, x, lens, return_attention_weights=True)[0]


def _native(
    layer: nnx.MultiHeadAttention, x: jax.Array, lens: jax.Array, mask: jax.Array
) -> jax.Array:
    return layer(x, mask=mask, deterministic=True)


def hand_written_decoder(
    weights: dict[str, np.ndarray],
    shape: GenerationShape,
    device: str,
    dtype: str,
    execution: str | None = None,
) -> Generator:
    """What a careful user writes by hand: a static cache of ``(B, max_length, H_kv,
    head_dim)`` updated with ``dynamic_update_slice`` and
    ``jax.nn.dot_product_attention`` over it with a mask, one jitted step
    (:func:`_hand_written_step`); with rotary positions, cosine and sine tables
    made once for every position and the queries and keys rotated
    (``rotate_half``) before the keys enter the cache. The same jitted step in
    every ``execution``: a JAX loop is compiled by whoever writes it."""
    heads, kv_heads, length = shape.num_heads, shape.kv_heads, shape.max_length
    head_dim = shape.num_hiddens // heads
    w = {name: backend.to_native(weights[name], device, dtype) for name in weights}
    angles = rotary_angles(shape)
    tables = None
    if angles is not None:  # once, in float32, then in the inputs' dtype
        angles = jax.device_put(angles, backend.device(device))
        tables = tuple(f(angles).astype(backend.DTYPES[dtype]) for f in (jnp.cos, jnp.sin))

    def prefill(prompt: jax.Array) -> tuple[Any, jax.Array]:
        empty = jnp.zeros((shape.batch, length, kv_heads, head_dim), prompt.dtype)
        cache, output = _hand_written_step(w, tables, (empty, empty), prompt, 0, heads=heads)
        return (cache, shape.prompt), output[:, -1:]

    def step(state: Any, token: jax.Array) -> tuple[Any, jax.Array]:
        cache, position = state
        cache, output = _hand_written_step(w, tables, cache, token, position, heads=heads)
        return (cache, position + 1), output

    return Generator(prefill, step, backend.sync, backend.to_numpy)


@functools.partial(jax.jit, static_argnames="heads")
def _hand_written_step(
    w: dict[str, jax.Array],
    tables: tuple[jax.Array, jax.Array] | None,
    cache: tuple[jax.Array, jax.Array],
    x: jax.Array,
    position: jax.Array,
    *,
    heads: int,
) -> tuple[Any, jax.Array]:
    """The hand-written decoder's step: one program per shape, whatever decoder calls it
    (the weights and tables are arguments, so that each generation compiles nothing)."""
    batch, steps, _ = x.shape
    _, length, kv_heads, head_dim = cache[0].shape

    def rotate(t: jax.Array) -> jax.Array:
        if tables is None:
            return t
        cos, sin = (jax.lax.dynamic_slice_in_dim(a, position, steps)[:, None] for a in tables)
        half = head_dim // 2
        return t * cos + jnp.concatenate([-t[..., half:], t[..., :half]], axis=-1) * sin

    q = rotate((x @ w["W_q"]).reshape(batch, steps, heads, head_dim))
    k = rotate((x @ w["W_k"]).reshape(batch, steps, kv_heads, head_dim))
    v = (x @ w["W_v"]).reshape(batch, steps, kv_heads, head_dim)
    cache = tuple(
        jax.lax.dynamic_update_slice_in_dim(held, new, position, axis=1)
        for held, new in zip(cache, (k, v), strict=True)
    )
    # Query i (at position + i) sees the keys up to itself: causal, and filled.
    visible = jnp.arange(length)[None, :] <= position + jnp.arange(steps)[:, None]
    context = jax.nn.dot_product_attention(q, *cache, mask=visible[None, None])
    return cache, context.reshape(batch, steps, -1) @ w["W_o"]


def staged(
    module: nnx.Module, function: Callable[..., Any], *, changes: Any = None
) -> Callable[..., Any]:
    """``call(*args)``: ``function(module, *args)`` compiled as Flax's guide writes a fast
    loop ("Performance considerations", its functional loop): the module split once
    into its graph definition and state, and ``jax.jit`` of a function that merges
    them, so that a call passes arrays alone, as a hand-written step's does.
    ``nnx.jit`` would walk the module's graph of modules and variables in Python at
    every call, which for a decoding step costs about as much as its kernels.

    ``changes``: a filter of the variables ``function`` changes (Flax's own
    decoder's cache), returned by the program and kept for the next call; ``None``:
    it changes none. The module's state is taken once: a change of the module since
    (new weights, a new cache) needs a new ``staged``.
    """
    if changes is None:
        graphdef, state = nnx.split(module)

        @jax.jit
        def run(state: Any, *args: Any) -> Any:
            return function(nnx.merge(graphdef, state), *args)

        return lambda *args: run(state, *args)
    graphdef, changed, rest = nnx.split(module, changes, ...)

    @jax.jit
    def run_changing(changed: Any, rest: Any, *args: Any) -> tuple[Any, Any]:
        merged = nnx.merge(graphdef, changed, rest)
        return function(merged, *args), nnx.state(merged, changes)

    held = [changed]

    def call(*args: Any) -> Any:
        output, held[0] = run_changing(held[0], rest, *args)
        return output

    return call


class Jax(Framework):
    """Flax NNX layers on the first device of each platform, ``"cpu"`` and ``"gpu"``."""

    hand_written = staticmethod(hand_written_decoder)

    name = "jax"
    package = "mha_multi.jax"
    backend = backend
    implementations = ("ours", "ours (generic)", "native", "ours (fused, xla)")

    def __init__(self) -> None:
        self._matmul = jax.jit(jnp.matmul)

    shard_counts = (1, 2, 4)

    def sharded_seconds(self, shape: Shape, num_shards: int) -> float:
        return sharded_seconds(shape, num_shards)

    def versions(self) -> dict[str, str]:
        return {name: version(name) for name in ("jax", "jaxlib", "flax")}

    def matmul(self, a: jax.Array, b: jax.Array) -> jax.Array:
        return self._matmul(a, b)

    def append(self, sequence: jax.Array, token: jax.Array) -> jax.Array:
        return jnp.concatenate([sequence, token], axis=1)

    #: Ours compiled as Flax's guide writes a fast loop (:func:`staged`), and called as
    #: it is (``"eager"``): its call plan compiles its whole flow once per signature
    #: (docs: "Fast paths").
    generation_executions = (None, "eager")

    def cached_call(
        self, layer: MultiHeadAttention, execution: str | None = None
    ) -> Callable[..., Any]:
        if execution == "eager":
            return lambda x, cache: layer(x, x, x, causal=True, cache=cache)
        # One compilation per length of the call: the prefill's, and 1.
        return staged(layer, lambda layer, x, cache: layer(x, x, x, causal=True, cache=cache))

    def forward_call(self, layer: MultiHeadAttention) -> Callable[[Any, Any], Any]:
        call = nnx.jit(lambda layer, x, lens: layer(x, x, x, lens))
        return lambda x, lens: call(layer, x, lens)

    def generators(
        self, shape: GenerationShape, device: str, dtype: str, execution: str | None = None
    ) -> dict[str, Callable[[], Generator]]:
        """Ours cached; ours recomputing over a buffer of ``max_length`` tokens, so that
        one compiled program serves every step (a growing sequence would compile
        each length); and Flax NNX's own ``decode=True``, one token per call."""
        generators = super().generators(shape, device, dtype, execution)
        ours = self.ours(shape.attention_shape(), device, dtype, **shape.layer_options)
        batch, length = shape.batch, shape.max_length

        def recomputed(
            layer: MultiHeadAttention, buffer: jax.Array, token: jax.Array, position: jax.Array
        ) -> tuple[jax.Array, jax.Array]:
            buffer = jax.lax.dynamic_update_slice_in_dim(buffer, token, position, axis=1)
            # Causal: the zeros past ``position`` are never seen.
            output = layer(buffer, buffer, buffer, causal=True)
            return buffer, jax.lax.dynamic_slice_in_dim(output, position, 1, axis=1)

        recompute_step = staged(ours, recomputed)

        def recompute() -> Generator:
            def prefill(prompt: jax.Array) -> tuple[Any, jax.Array]:
                buffer = jnp.zeros((batch, length, shape.num_hiddens), prompt.dtype)
                buffer = buffer.at[:, : shape.prompt].set(prompt)
                output = layer_call(buffer)
                return (buffer, shape.prompt), output[:, shape.prompt - 1 : shape.prompt]

            def step(state: Any, token: jax.Array) -> tuple[Any, jax.Array]:
                buffer, position = state
                buffer, output = recompute_step(buffer, token, jnp.int32(position))
                return (buffer, position + 1), output

            return Generator(prefill, step, self.sync, backend.to_numpy)

        layer_call = staged(ours, lambda layer, x: layer(x, x, x, causal=True))
        heads = {} if shape.num_kv_heads is None else {"num_kv_heads": shape.num_kv_heads}
        native = backend.native_layer(
            get_weights(ours), shape.num_heads, device=device, dtype=dtype, **heads
        )

        def decoded(layer: nnx.MultiHeadAttention, x: jax.Array) -> jax.Array:
            return layer(x, decode=True, deterministic=True)

        def flax_decode() -> Generator:
            def prefill(prompt: jax.Array) -> tuple[Any, jax.Array]:
                native.init_cache((batch, length, shape.num_hiddens), prompt.dtype)
                # (Staged after the cache is made: its variables are the state it changes.)
                decode = staged(native, decoded, changes=nnx.Cache)
                for position in range(shape.prompt):  # one token per call
                    output = decode(prompt[:, position : position + 1])
                return decode, output

            def step(decode: Any, token: jax.Array) -> tuple[Any, jax.Array]:
                return decode, decode(token)

            return Generator(prefill, step, self.sync, backend.to_numpy)

        if "recompute" in generators:  # (the first execution's: its rows are the same)
            generators["recompute"] = recompute
        if shape.rotary is None and execution is None:  # Flax's has no rotary positions
            generators["native"] = flax_decode
        return generators

    def convert(
        self, x: np.ndarray, lens: np.ndarray, visible: np.ndarray, device: str, dtype: str
    ) -> tuple[jax.Array, ...]:
        # Flax's mask broadcasts over heads and queries.
        lens, mask = lens.astype(np.int32), visible[:, None, None, :]
        put = (backend.lens_to_native(lens, device), jax.device_put(mask, backend.device(device)))
        return self.array(x, device, dtype), *put

    def build(self, shape: Shape, device: str, dtype: str) -> dict[str, tuple[nnx.Module, Call]]:
        d, h = shape.num_hiddens, shape.num_heads
        place = {"device": device, "dtype": dtype}
        ours, fused = (
            backend.make_layer(
                d, h, num_kv_heads=shape.num_kv_heads, implementation=implementation, **place
            )
            for implementation in (None, "xla")
        )
        native = backend.native_layer(get_weights(ours), h, **place)
        for module in (ours, fused):
            module.eval()
        return {
            "ours": (ours, _ours),
            "ours (generic)": (ours, _generic),
            "native": (native, _native),
            "ours (fused, xla)": (fused, _ours),
        }

    def step(self, impl: Any, args: Any, mode: str, execution: str | None) -> Callable[[], Any]:
        module, call = impl
        if mode == "forward":
            forward = nnx.jit(call)
            return lambda: forward(module, *args)

        @nnx.jit
        def forward_backward(
            module: nnx.Module, x: jax.Array, lens: jax.Array, mask: jax.Array
        ) -> tuple[Any, jax.Array]:
            def loss(module: nnx.Module, x: jax.Array) -> jax.Array:
                return call(module, x, lens, mask).astype(jnp.float32).sum()

            return nnx.grad(loss, argnums=(0, 1))(module, x)

        return lambda: forward_backward(module, *args)

    def scratch_bytes(
        self, implementation: str, shape: Shape, dtype: str, device: str, *, training: bool
    ) -> int:
        # XLA materialises the (B, H, N, N) scores as three float32 arrays
        # (scores, masked scores, weights) even for 16-bit inputs; ours' generic
        # path on a CPU holds them for one piece of the batch at a time (and
        # the generic implementation returns the whole weights besides).
        # cuDNN's flash kernel (ours' default for 16-bit inputs on a GPU)
        # holds none.
        if implementation == "ours" and device == "gpu" and dtype != "float32":
            return 0
        if device == "cpu" and implementation in ("ours", "ours (generic)"):
            example_bytes = score_bytes(shape, 1) // shape.batch
            held = score_bytes(shape, 3) // batch_pieces(shape.batch, example_bytes)
            return held + (score_bytes(shape, 1) if implementation == "ours (generic)" else 0)
        return score_bytes(shape, 3)

    def memory_step(self, impl: Any, args: Any, warmup: Any) -> Callable[[], Any]:
        # Compiled ahead for the full shapes, so that compilation is not counted.
        module, call = impl
        graphdef, state = nnx.split(module)

        def forward(state: nnx.State, x: jax.Array, lens: jax.Array, mask: jax.Array) -> jax.Array:
            return call(nnx.merge(graphdef, state), x, lens, mask)

        compiled = jax.jit(forward).lower(state, *args).compile()
        return lambda: compiled(state, *args)

    def peak_mib(self, device: str, run: Callable[[], None]) -> float:
        if device != "gpu":
            return super().peak_mib(device, run)
        stats = backend.device(device).memory_stats
        before = (stats() or {}).get("bytes_in_use", 0)
        run()
        return ((stats() or {}).get("peak_bytes_in_use", 0) - before) / 2**20


FRAMEWORK = Jax()


def sharded_seconds(
    shape: Shape, num_shards: int, *, repeats: int = 5, implementation: str | None = None
) -> float:
    """Median seconds of one jitted float32 forward of the layer, heads on ``num_shards`` CPUs.

    Self-attention of ``shape`` (``(batch, length, num_hiddens)`` inputs,
    no key lengths) through ``nnx.jit``, with the layer's heads split by
    :func:`mha_multi.jax.shard_heads` over ``num_shards`` host CPU devices
    (``1``: the unsharded layer on one device). JAX fixes its CPU devices
    when it starts, so each measurement runs in a fresh interpreter started
    with ``--xla_force_host_platform_device_count`` (docs: "Sharding heads").
    The devices share the machine's cores: this measures what partitioning
    costs, not what more hardware gains.

    Args:
        shape: the self-attention's sizes.
        num_shards: devices on the heads' mesh axis; must divide ``num_heads``
            and ``shape.kv_heads``.
        repeats: timed calls (after two warm-up calls).
        implementation: the layer's attention kernel (``None``: its default).

    Returns:
        The median wall-clock seconds of one call.
    """
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={int(num_shards)}"
    )
    config = {
        "shape": vars(shape),
        "num_shards": int(num_shards),
        "repeats": int(repeats),
        "implementation": implementation,
    }
    code = f"from mha_multi.bench.jax import _sharded_run; _sharded_run({json.dumps(config)!r})"
    run = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    # The last word: libraries may print to stdout while loading.
    return float(run.stdout.split()[-1])


def _sharded_run(config_json: str) -> None:
    """The measurement of :func:`sharded_seconds`, in its own interpreter; prints the seconds."""
    from mha_multi.jax import shard_heads

    config = json.loads(config_json)
    shape, num_shards = Shape(**config["shape"]), config["num_shards"]
    if jax.device_count() < num_shards:
        raise RuntimeError(f"{num_shards} shards need as many devices; JAX sees {jax.devices()}")
    layer = MultiHeadAttention(
        shape.num_hiddens,
        shape.num_heads,
        num_kv_heads=shape.num_kv_heads,
        implementation=config["implementation"],
        rngs=nnx.Rngs(0),
    )
    layer.eval()
    x = np.random.default_rng(0).standard_normal(
        (shape.batch, shape.length, shape.num_hiddens), dtype=np.float32
    )
    sharding = jax.devices()[0]
    if num_shards > 1:
        auto = (jax.sharding.AxisType.Auto,)
        mesh = jax.make_mesh((num_shards,), ("model",), axis_types=auto)
        shard_heads(layer, mesh)
        sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    x = jax.device_put(x, sharding)  # every device holds the whole input
    forward = nnx.jit(lambda layer, x: layer(x, x, x))
    seconds = median_seconds(
        lambda: forward(layer, x).block_until_ready(), repeats=config["repeats"]
    )
    print(seconds)

"""Keras 3 benchmark: ours (fused and generic) vs ``keras.layers.MultiHeadAttention``,
and, for grouped key/value heads, vs ``keras.layers.GroupQueryAttention``.

Runs on the Keras backend of the process (``KERAS_BACKEND``: TensorFlow,
JAX or PyTorch), in two execution modes, each reported as a table of its own:

* eager: the layers called as they are;
* compiled: what is natural on the backend, ``tf.function(jit_compile=True)``
  (TensorFlow), ``jax.jit`` of ``Layer.stateless_call`` (JAX),
  ``torch.compile`` (PyTorch); forward+backward is compiled as one program
  (the gradient inside the compiled function) where the framework allows.

Both layers hold the same weights and see the same key padding: ours as
``valid_lens``, Keras' as an ``attention_mask`` with ``True`` where a key is
*visible* (Keras' polarity). Grouped rows build ours with ``num_kv_heads``
and, as the native layer, Keras' own grouped-query layer. How each backend runs, differentiates and
waits is in :mod:`mha_multi.parity.harness.keras`.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import keras
import numpy as np

from mha_multi import spec
from mha_multi.bench.common import Shape, median_seconds, score_bytes
from mha_multi.bench.framework import Framework
from mha_multi.bench.generate import GenerationShape, Generator, rotary_angles
from mha_multi.keras import MultiHeadAttention, layout_map, set_weights
from mha_multi.parity.harness import keras as backend
from mha_multi.parity.harness.keras import LayerCall
from mha_multi.weights import init_weights

COMPILERS = {
    "tensorflow": "tf.function(jit_compile=True)",
    "jax": "jax.jit of stateless_call",
    "torch": "torch.compile",
}


def hand_written_decoder(
    weights: dict[str, np.ndarray],
    shape: GenerationShape,
    device: str,
    dtype: str,
    execution: str | None = None,
) -> Generator:
    """What a careful user writes by hand in ``keras.ops``: a static cache of ``(B,
    max_length, H_kv, head_dim)`` updated with ``slice_update`` and
    ``dot_product_attention``.

    Eagerly it attends over the filled positions. Compiled (``execution ==
    "compiled"``, the backend's compiler as for the layers) it keeps static
    shapes: the position is an argument, and attention covers all
    ``max_length`` positions with a mask, so the prompt and the steps are
    two programs. So does the eager loop on JAX, whose operations compile
    for each new shape (over the filled positions, at every step). With
    rotary positions, cosine and sine tables are made once for every position
    (held beside the weights) and the queries and keys rotated
    (``rotate_half``) before the keys enter the cache.
    """
    ops = keras.ops
    heads, kv_heads, length = shape.num_heads, shape.kv_heads, shape.max_length
    head_dim = shape.num_hiddens // heads
    w = {name: backend.to_native(weights[name], device, dtype) for name in weights}
    angles = rotary_angles(shape)
    if angles is not None:  # once, in float32, then in the inputs' dtype
        angles = backend.to_native(angles, device, "float32")
        w["cos"], w["sin"] = (ops.cast(f(angles), dtype) for f in (ops.cos, ops.sin))
    compiled = execution == "compiled"
    static = compiled or backend.BACKEND == "jax"
    if compiled:
        run = _compiled_attend(heads, kv_heads, length)
    elif static:
        run = _static_attend(heads, kv_heads, length)
    else:
        run = functools.partial(_attend_filled, heads=heads, kv_heads=kv_heads)

    def call(state: Any, x: Any, position: int) -> tuple[Any, Any]:
        keys, values = state
        # (The default integer type, as the start's other indices: int64 under JAX's x64.)
        at = ops.convert_to_tensor(position) if static else position
        output, keys, values = run(w, x, keys, values, at)
        return (keys, values), output

    def prefill(prompt: Any) -> tuple[Any, Any]:
        size = (shape.batch, length, kv_heads, head_dim)
        state = (ops.zeros(size, dtype=prompt.dtype), ops.zeros(size, dtype=prompt.dtype))
        state, output = call(state, prompt, 0)
        return (state, shape.prompt), output[:, -1:]

    def step(carried: Any, token: Any) -> tuple[Any, Any]:
        state, position = carried
        state, output = call(state, token, position)
        return (state, position + 1), output

    return Generator(prefill, step, backend.sync, backend.to_numpy)


def _updated(
    w: dict[str, Any], x: Any, keys: Any, values: Any, position: Any, heads: int, kv_heads: int
) -> tuple[Any, Any, Any]:
    """The queries' heads, and the static cache with ``x``'s keys and values at ``position``."""
    ops = keras.ops
    batch, steps, width = x.shape
    head_dim = width // heads

    def project(name: str, num: int) -> Any:
        projected = ops.reshape(ops.matmul(x, w[f"W_{name}"]), (batch, steps, num, head_dim))
        if "cos" not in w or name == "v":
            return projected
        if isinstance(position, int):
            cos, sin = (
                ops.slice(w[t], (position, 0), (steps, head_dim))[:, None] for t in ("cos", "sin")
            )
        else:  # compiled: the rows gathered (Keras' slice at a tensor start reads it on PyTorch)
            rows = position + ops.arange(steps, dtype="int32")
            cos, sin = (ops.take(w[t], rows, axis=0)[:, None] for t in ("cos", "sin"))
        half = head_dim // 2
        turned = ops.concatenate([-projected[..., half:], projected[..., :half]], axis=-1)
        return projected * cos + turned * sin

    keys = ops.slice_update(keys, (0, position, 0, 0), project("k", kv_heads))
    values = ops.slice_update(values, (0, position, 0, 0), project("v", kv_heads))
    return project("q", heads), keys, values


def _attend_filled(
    w: dict[str, Any], x: Any, keys: Any, values: Any, position: int, *, heads: int, kv_heads: int
) -> tuple[Any, Any, Any]:
    """Eager: attention over the filled positions only."""
    ops = keras.ops
    q, keys, values = _updated(w, x, keys, values, position, heads, kv_heads)
    batch, steps = x.shape[0], x.shape[1]
    end = position + steps
    context = ops.dot_product_attention(q, keys[:, :end], values[:, :end], is_causal=steps > 1)
    return ops.matmul(ops.reshape(context, (batch, steps, -1)), w["W_o"]), keys, values


def _masked_attention(q: Any, keys: Any, values: Any, seen: Any, group: int) -> Any:
    """Attention of ``q`` ``(B, T, H, dh)`` over ``(B, L, H_kv, dh)`` keys and values,
    ``seen`` ``(T, L)``, written out: Keras' ``dot_product_attention`` on PyTorch asks
    SDPA's flash check at every call, which ``torch.compile`` cannot trace (a graph
    break, and a recompilation at every step)."""
    ops = keras.ops
    if group > 1:
        keys, values = (ops.repeat(x, group, axis=2) for x in (keys, values))
    scale = 1.0 / float(q.shape[-1]) ** 0.5
    scores = ops.einsum("bqhd,bkhd->bhqk", q, keys) * scale
    scores = ops.where(seen[None, None], scores, float("-inf"))
    return ops.einsum("bhqk,bkhd->bqhd", ops.softmax(scores, axis=-1), values)


@functools.cache
def _compiled_attend(heads: int, kv_heads: int, length: int) -> Callable[..., Any]:
    """:func:`_static_attend` compiled.

    One compiled function per configuration, so that every generator of it
    (the warm-up's, the timed one's) shares its programs.
    """
    return backend.compile_function(_static_attend(heads, kv_heads, length))


def _static_attend(heads: int, kv_heads: int, length: int) -> Callable[..., Any]:
    """Static shapes: all ``length`` positions, the unfilled ones masked; the position a
    tensor. Compiled, and the eager loop on JAX, where an operation on a new shape
    compiles anew (attention over the filled positions would compile at every step)."""
    ops = keras.ops

    def attend(
        w: dict[str, Any], x: Any, keys: Any, values: Any, position: Any
    ) -> tuple[Any, Any, Any]:
        q, keys, values = _updated(w, x, keys, values, position, heads, kv_heads)
        batch, steps = x.shape[0], x.shape[1]
        # Query i (at position + i) sees the keys up to itself.
        seen = ops.arange(length)[None, :] <= position + ops.arange(steps)[:, None]
        if backend.BACKEND == "torch":
            context = _masked_attention(q, keys, values, seen, heads // kv_heads)
        else:
            context = ops.dot_product_attention(q, keys, values, mask=seen[None, None])
        return ops.matmul(ops.reshape(context, (batch, steps, -1)), w["W_o"]), keys, values

    return attend


class Keras(Framework):
    """The active Keras backend on the CPU, eager and compiled."""

    name = f"keras-{backend.BACKEND}"
    package = "mha_multi.keras"
    backend = backend
    executions = ("eager", "compiled")
    gemm_op = "keras.ops.matmul"

    def describe(self, device: str, execution: str | None) -> str:
        how = "layers called eagerly" if execution == "eager" else COMPILERS[backend.BACKEND]
        return f"{device}; {how}"

    sharded_execution = "compiled"  # one jax.jit of stateless_call

    @property
    def shard_counts(self) -> tuple[int, ...]:  # type: ignore[override]
        # Keras lays variables out by a distribution on JAX only (docs: "Sharding heads").
        return (1, 2, 4) if backend.BACKEND == "jax" else ()

    def sharded_seconds(self, shape: Shape, num_shards: int) -> float:
        return sharded_seconds(shape, num_shards)

    def versions(self) -> dict[str, str]:
        return {
            "keras": keras.__version__,
            backend.BACKEND: __import__(backend.BACKEND).__version__,
        }

    def matmul(self, a: Any, b: Any) -> Any:
        return keras.ops.matmul(a, b)

    hand_written = staticmethod(hand_written_decoder)
    generation_executions = ("eager", "compiled")

    def generators(
        self, shape: GenerationShape, device: str, dtype: str, execution: str | None = None
    ) -> dict[str, Callable[[], Generator]]:
        if execution == "compiled" and backend.BACKEND == "torch":
            # Each configuration's graphs afresh, as PyTorch's rows: Dynamo counts the
            # graphs of one function (ours, the loop's step) against one limit, and
            # makes their shapes dynamic once a size has changed.
            import torch

            torch._dynamo.reset()
            _compiled_attend.cache_clear()
        return super().generators(shape, device, dtype, execution)

    def cached_call(self, layer: Any, execution: str | None = None) -> Callable[..., Any]:
        """Eager, or the backend's compiler over the layer's variables and the cache
        (one program for the prompt's length and one for a token)."""
        if execution != "compiled":
            return super().cached_call(layer)
        call = LayerCall(
            layer,
            lambda x, keys, values, lengths: (
                (x, x, x),
                {"causal": True, "cache": spec.KVCache(keys, values, lengths)},
            ),
        )
        forward = backend.forward_function(call, compiled=True)
        values = backend.state(layer)

        def cached(x: Any, cache: Any) -> tuple[Any, Any]:
            output, updated = forward(values, x, *cache)
            return output, spec.KVCache(*updated)

        return cached

    def append(self, sequence: Any, token: Any) -> Any:
        return keras.ops.concatenate([sequence, token], axis=1)

    def convert(
        self, x: np.ndarray, lens: np.ndarray, visible: np.ndarray, device: str, dtype: str
    ) -> tuple[Any, ...]:
        mask = visible[:, None, :]  # (B, 1, N): the same keys for every query
        return (
            backend.to_native(x, device, dtype),
            backend.lens_to_native(lens.astype(np.int32), device),
            backend.to_native(mask, device, "bool"),
        )

    def build(self, shape: Shape, device: str, dtype: str) -> dict[str, LayerCall]:
        d, h, kv_heads = shape.num_hiddens, shape.num_heads, shape.kv_heads
        weights = init_weights(d, num_heads=h, num_kv_heads=kv_heads, seed=0)
        sizes = {"query_size": d, "key_size": d, "value_size": d}
        ours = backend.make_layer(d, h, num_kv_heads=kv_heads, device=device, dtype=dtype, **sizes)
        ours = set_weights(ours, weights)
        if kv_heads == h:
            native = backend.native_layer(weights, h, device=device, dtype=dtype)
        else:
            native = backend.native_gqa_layer(
                weights, h, num_kv_heads=kv_heads, device=device, dtype=dtype
            )
        return {
            "ours": LayerCall(ours, lambda x, lens, mask: ((x, x, x, lens), {})),
            "ours (generic)": LayerCall(
                ours,
                lambda x, lens, mask: ((x, x, x, lens), {"return_attention_weights": True}),
                first=True,
            ),
            "native": LayerCall(native, lambda x, lens, mask: ((x, x), {"attention_mask": mask})),
        }

    def step(
        self, impl: LayerCall, args: Any, mode: str, execution: str | None
    ) -> Callable[[], Any]:
        compiled = execution == "compiled"
        values = backend.state(impl.layer)
        if mode == "forward":
            forward = backend.forward_function(impl, compiled=compiled)
            return lambda: forward(values, *args)
        # The gradients of the summed output, with respect to the input and the weights.
        gradients = backend.gradient_function(impl, wrt=1, compiled=compiled)
        cotangent = keras.ops.ones_like(args[0])  # the output has the input's shape
        return lambda: gradients(values, list(args), cotangent)

    def scratch_bytes(
        self, implementation: str, shape: Shape, dtype: str, device: str, *, training: bool
    ) -> int:
        if implementation == "ours" and backend.BACKEND == "torch":
            return 0  # SDPA's CPU kernel works in blocks
        # Scores, masked scores and weights, each (B*H, N, N).
        return score_bytes(shape, 3)


FRAMEWORK = Keras()


def sharded_seconds(shape: Shape, num_shards: int, *, repeats: int = 5) -> float:
    """Median seconds of one compiled forward of ``shape`` with heads split ``num_shards`` ways.

    Keras' JAX backend, float32, CPU: self-attention of ``shape.batch``
    sequences of ``shape.length`` tokens (no padding) through ``jax.jit`` of
    ``Layer.stateless_call``, the layer made under a
    ``keras.distribution.ModelParallel`` of :func:`mha_multi.keras.layout_map`
    over a 1-D ``("model",)`` mesh of ``num_shards`` host devices (``1``: no
    distribution, the unsharded layer). It runs in a fresh process, whose
    ``XLA_FLAGS`` make ``num_shards`` CPU devices (docs: "Sharding heads"):
    they share the machine's cores, so this measures what splitting costs
    (the reduction after ``W_o``, the partitioned program), not a speed-up.
    The calling process may run any Keras backend; the measuring one runs
    JAX (which its environment must have).

    Args:
        shape: the self-attention measured (``num_shards`` must divide its
            ``num_heads`` and key/value heads).
        num_shards: the number of devices the heads are split over.
        repeats: timed calls after two untimed ones (the first compiles).

    Returns:
        The median wall time of one call, in seconds.

    Raises:
        ValueError: ``num_shards`` does not divide the head counts.
        RuntimeError: the measuring process failed (its error output attached).
    """
    spec_heads = spec.Heads(shape.num_heads, shape.kv_heads, shape.num_hiddens // shape.num_heads)
    spec.shard_heads(spec_heads, num_shards)
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={num_shards}"
    env = {**os.environ, "KERAS_BACKEND": "jax", "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags.strip()}
    code = (
        "import sys; from mha_multi.bench.keras import _sharded_main; _sharded_main(sys.argv[1:])"
    )
    command = [sys.executable, "-c", code, json.dumps(vars(shape)), str(num_shards), str(repeats)]
    process = subprocess.run(command, env=env, capture_output=True, text=True)
    if process.returncode:
        raise RuntimeError(f"the sharded benchmark failed:\n{process.stderr[-4000:]}")
    return float(process.stdout.split()[-1])  # the last word: libraries may print first


def _sharded_main(argv: list[str]) -> None:
    """:func:`sharded_seconds`' measuring process: prints the median seconds."""
    import jax

    shape, num_shards, repeats = Shape(**json.loads(argv[0])), int(argv[1]), int(argv[2])
    d, h, kv_heads = shape.num_hiddens, shape.num_heads, shape.kv_heads
    scope: Any = contextlib.nullcontext()
    if num_shards > 1:
        devices = keras.distribution.list_devices("cpu")[:num_shards]
        mesh = keras.distribution.DeviceMesh((num_shards,), ["model"], devices=devices)
        scope = keras.distribution.ModelParallel(layout_map=layout_map(mesh)).scope()
    with scope:
        layer = MultiHeadAttention(
            d,
            h,
            num_kv_heads=kv_heads,
            query_size=d,
            key_size=d,
            value_size=d,
            kernel_initializer="zeros",  # set_weights writes them
        )
        set_weights(layer, init_weights(d, num_heads=h, num_kv_heads=kv_heads, seed=0))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((shape.batch, shape.length, d), dtype=np.float32)
    trainable = [variable.value for variable in layer.trainable_variables]

    @jax.jit
    def forward(trainable: list[Any], x: Any) -> Any:
        output, _ = layer.stateless_call(trainable, [], x, x, x)
        return output

    seconds = median_seconds(lambda: forward(trainable, x).block_until_ready(), repeats=repeats)
    print(seconds)

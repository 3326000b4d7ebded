"""MXNet benchmark: ours (fused and generic) vs d2l's MXNet ``MultiHeadAttention``.

MXNet has no multi-head attention layer of its own in Gluon's core; the
baseline is d2l's formulation of the layer for MXNet's numpy interface,
written here as a ``HybridBlock`` so that both sides run hybridized. Neither
has grouped key/value heads, so grouped rows time ours alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

# First: MXNet's exact-float32 environment is in place before MXNet loads
# (docs: "Architecture").
from mha_multi.parity.harness import mxnet as backend  # isort: split

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon, npx
from mxnet.gluon import nn

from mha_multi.bench.common import Shape, score_bytes
from mha_multi.bench.framework import Framework
from mha_multi.bench.generate import GenerationShape, Generator, rotary_angles
from mha_multi.mxnet import set_weights
from mha_multi.weights import init_weights

npx.set_np()

#: Full-size (B*H, N, N) float arrays alive at the peak of a forward pass:
#: scores and weights for ours; scores, masked scores and weights for d2l's
#: and for the generic path.
_SCORE_ARRAYS = {"ours": 2, "native": 3, "ours (generic)": 3}
#: The same for forward+backward, from measured peak memory (N = 1024: about
#: 1 GiB for ours and d2l's, 2 GiB for the generic path).
_TRAINING_SCORE_ARRAYS = {"ours": 4, "native": 4, "ours (generic)": 8}


def masked_softmax(F: Any, X: Any, valid_lens: Any) -> Any:
    """d2l's ``masked_softmax``: replace hidden scores by -1e6, then softmax.

    Args:
        F: ``mxnet.ndarray`` or ``mxnet.symbol``.
        X: scores ``(B*H, Q, K)``.
        valid_lens: ``None`` or ``(B*H,)`` (float32, as d2l passes them).
    """
    if valid_lens is None:
        return F.npx.softmax(X)
    # d2l's valid_lens.repeat(shape[1]), without the shape: one length per query row.
    rows = F.np.zeros_like(X[:, :, 0]) + F.np.expand_dims(valid_lens, -1)  # (B*H, Q)
    masked = F.npx.sequence_mask(
        F.npx.reshape(X, (-5, -2)),
        F.npx.reshape(rows, (-1,)),
        use_sequence_length=True,
        value=-1e6,
        axis=1,
    )
    return F.npx.reshape_like(F.npx.softmax(masked), X)


class DotProductAttention(gluon.HybridBlock):
    """d2l's ``DotProductAttention`` (d2l.ai, "Attention Scoring Functions", MXNet)."""

    def __init__(self, dropout: float, head_dim: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.head_dim = head_dim  # d2l reads queries.shape[-1]; symbols have no shape
        self.dropout = nn.Dropout(dropout)

    def hybrid_forward(self, F: Any, queries: Any, keys: Any, values: Any, valid_lens: Any) -> Any:
        scores = F.npx.batch_dot(queries, keys, transpose_b=True) / math.sqrt(self.head_dim)
        attention_weights = masked_softmax(F, scores, valid_lens)
        return F.npx.batch_dot(self.dropout(attention_weights), values)


class D2LMultiHeadAttention(gluon.HybridBlock):
    """d2l's ``MultiHeadAttention`` (d2l.ai, "Multi-Head Attention", MXNet numpy interface)."""

    def __init__(
        self, num_hiddens: int, num_heads: int, dropout: float = 0.0, use_bias: bool = False
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        with self.name_scope():
            self.attention = DotProductAttention(dropout, num_hiddens // num_heads)
            self.W_q = nn.Dense(num_hiddens, use_bias=use_bias, flatten=False)
            self.W_k = nn.Dense(num_hiddens, use_bias=use_bias, flatten=False)
            self.W_v = nn.Dense(num_hiddens, use_bias=use_bias, flatten=False)
            self.W_o = nn.Dense(num_hiddens, use_bias=use_bias, flatten=False)

    def hybrid_forward(
        self, F: Any, queries: Any, keys: Any, values: Any, valid_lens: Any = None
    ) -> Any:
        queries = self.transpose_qkv(F, self.W_q(queries))
        keys = self.transpose_qkv(F, self.W_k(keys))
        values = self.transpose_qkv(F, self.W_v(values))
        if valid_lens is not None:
            valid_lens = F.np.repeat(valid_lens, self.num_heads, axis=0)
        output = self.attention(queries, keys, values, valid_lens)
        return self.W_o(self.transpose_output(F, output))

    def transpose_qkv(self, F: Any, X: Any) -> Any:
        X = F.npx.reshape(X, (-2, -2, self.num_heads, -1))
        X = F.np.transpose(X, (0, 2, 1, 3))
        return F.npx.reshape(X, (-5, -2, -2))

    def transpose_output(self, F: Any, X: Any) -> Any:
        X = F.npx.reshape(X, (-6, -1, self.num_heads, -2, -2))
        X = F.np.transpose(X, (0, 2, 1, 3))
        return F.npx.reshape(X, (-2, -2, -5))


def hand_written_decoder(
    weights: dict[str, np.ndarray],
    shape: GenerationShape,
    device: str,
    dtype: str,
    execution: str | None = None,
) -> Generator:
    """What a careful user writes by hand in MXNet's ``np``/``npx``: a static cache
    of ``(B, H_kv, max_length, head_dim)`` written in place by slice assignment,
    and d2l's scaled dot product over its filled positions, each key/value
    head's query heads scored as its queries in one ``batch_dot`` (no key or
    value repeated for grouped heads).

    Imperative in every ``execution``: slice assignment has no place in a
    hybridized graph, whose static shapes would attend over all ``max_length``.
    With rotary positions, cosine and sine tables are made once for every
    position and the queries and keys rotated (``rotate_half``) before the
    keys enter the cache.
    """
    heads, kv_heads = shape.num_heads, shape.kv_heads
    head_dim, group = shape.num_hiddens // heads, heads // kv_heads
    w = {name: backend.to_native(weights[name], device, dtype) for name in weights}
    angles = rotary_angles(shape)
    tables = None
    if angles is not None:  # once, in float32, then in the inputs' dtype
        angles = backend.to_native(angles, device, "float32")
        tables = (mx.np.cos(angles).astype(dtype), mx.np.sin(angles).astype(dtype))
    cache: dict[str, mx.np.ndarray] = {}

    def split(x: mx.np.ndarray, count: int) -> mx.np.ndarray:
        batch, steps = x.shape[:2]
        return x.reshape(batch, steps, count, head_dim).transpose(0, 2, 1, 3)

    def rotate(x: mx.np.ndarray, at: slice) -> mx.np.ndarray:
        if tables is None:
            return x
        cos, sin = (table[at] for table in tables)
        half = head_dim // 2
        return x * cos + mx.np.concatenate([-x[..., half:], x[..., :half]], axis=-1) * sin

    def attend(x: mx.np.ndarray, position: int) -> mx.np.ndarray:
        batch, steps = x.shape[:2]
        end = position + steps
        at = slice(position, end)
        # Each key/value head's query heads are its queries: (B*H_kv, G*T, dh).
        q = rotate(split(mx.np.dot(x, w["W_q"]), heads), at)
        q = q.reshape(batch * kv_heads, group * steps, head_dim)
        cache["k"][:, :, at] = rotate(split(mx.np.dot(x, w["W_k"]), kv_heads), at)
        cache["v"][:, :, at] = split(mx.np.dot(x, w["W_v"]), kv_heads)
        k, v = (cache[name][:, :, :end].reshape(batch * kv_heads, end, head_dim) for name in "kv")
        scores = npx.batch_dot(q, k, transpose_b=True) / math.sqrt(head_dim)
        if steps > 1:  # query i sees the keys up to position + i
            seen = mx.np.arange(end)[None, :] <= position + mx.np.arange(steps)[:, None]
            scores = mx.np.where(mx.np.tile(seen, (group, 1))[None], scores, -1e6)
        context = npx.batch_dot(npx.softmax(scores, axis=-1), v)
        context = context.reshape(batch, heads, steps, head_dim).transpose(0, 2, 1, 3)
        return mx.np.dot(context.reshape(batch, steps, -1), w["W_o"])

    def prefill(prompt: mx.np.ndarray) -> tuple[Any, mx.np.ndarray]:
        size = (shape.batch, kv_heads, shape.max_length, head_dim)
        for name in ("k", "v"):
            cache[name] = mx.np.zeros(size, dtype=prompt.dtype, ctx=prompt.ctx)
        return shape.prompt, attend(prompt, 0)[:, -1:]

    def step(position: int, token: mx.np.ndarray) -> tuple[Any, mx.np.ndarray]:
        return position + 1, attend(token, position)

    return Generator(prefill, step, backend.sync, backend.to_numpy)


class MXNet(Framework):
    """Both layers hybridized, on the CPU and the first GPU."""

    name = "mxnet"
    package = "mha_multi.mxnet"
    backend = backend
    # MXNet 1.9's numpy interface has no bfloat16; its CPU float16 products
    # are emulated, so float16 is timed on GPUs only.
    fast_dtype = "float16"

    def versions(self) -> dict[str, str]:
        return {"mxnet": mx.__version__}

    def matmul(self, a: mx.np.ndarray, b: mx.np.ndarray) -> mx.np.ndarray:
        return mx.np.dot(a, b)

    def append(self, sequence: mx.np.ndarray, token: mx.np.ndarray) -> mx.np.ndarray:
        return mx.np.concatenate([sequence, token], axis=1)

    hand_written = staticmethod(hand_written_decoder)
    # The layer hybridized (the timing rows' mode) and imperative: a call
    # that records nothing writes its cache in place and attends over the
    # filled positions, hybridized in a graph that serves the prompt's
    # lengths and one that serves every step (docs: "Generating with a cache").
    generation_executions = (None, "imperative")

    def cached_call(self, layer: Any, execution: str | None = None) -> Callable[..., Any]:
        layer.hybridize(active=execution != "imperative")
        return super().cached_call(layer, execution)

    def eager_layer_call(self, layer: Any, *, training: bool = False) -> Callable[..., Any]:
        """Imperative, MXNet's eager mode; ``training``: recorded by ``autograd.record()``
        (which sets training mode)."""
        layer.hybridize(active=False)
        call = super().eager_layer_call(layer)
        if not training:
            return call

        def recording(x: Any, cache: Any = None) -> Any:
            with autograd.record():
                return call(x, cache)

        return recording

    def convert(
        self, x: np.ndarray, lens: np.ndarray, visible: np.ndarray, device: str, dtype: str
    ) -> tuple[mx.np.ndarray, mx.np.ndarray]:
        # Lengths in float32, as d2l passes them.
        return self.array(x, device, dtype), self.array(lens, device, "float32")

    def build(self, shape: Shape, device: str, dtype: str) -> dict[str, Any]:
        # Hybridized without ``static_alloc``: each cached graph would then keep
        # its own full-size buffers, several GiB per graph at N = 2048.
        d, h, kv_heads = shape.num_hiddens, shape.num_heads, shape.kv_heads
        sizes = {"query_size": d, "key_size": d, "value_size": d}
        ours = backend.make_layer(
            d, h, num_kv_heads=kv_heads, device=device, dtype=dtype, hybridize=True, **sizes
        )
        set_weights(ours, init_weights(d, num_heads=h, num_kv_heads=kv_heads))
        implementations = {
            "ours": (ours, lambda x, lens: ours(x, x, x, lens)),
            "ours (generic)": (
                ours,
                lambda x, lens: ours(x, x, x, lens, return_attention_weights=True)[0],
            ),
        }
        if kv_heads != h:
            return implementations  # d2l's layer has no grouped heads, nor has MXNet
        native = D2LMultiHeadAttention(d, h)
        native.initialize(mx.init.Xavier(), ctx=backend.device(device))
        native.cast(dtype)
        native.hybridize()
        implementations["native"] = (native, lambda x, lens: native(x, x, x, lens))
        return implementations

    def step(self, impl: Any, args: Any, mode: str, execution: str | None) -> Callable[[], Any]:
        block, call = impl
        x, lens = args
        if mode == "forward":
            return lambda: call(x, lens)

        def forward_backward() -> None:
            inputs = x.copy()
            inputs.attach_grad()
            with autograd.record():
                output = call(inputs, lens)
            output.backward()  # head gradient of ones: the gradient of output.sum()
            block.collect_params().zero_grad()

        return forward_backward

    def scratch_bytes(
        self, implementation: str, shape: Shape, dtype: str, device: str, *, training: bool
    ) -> int:
        arrays = (_TRAINING_SCORE_ARRAYS if training else _SCORE_ARRAYS)[implementation]
        return score_bytes(shape, arrays, dtype)

    def measures_memory(self, device: str) -> bool:
        return device == "cpu"  # resident memory; MXNet's GPU pool keeps no peak statistics


FRAMEWORK = MXNet()

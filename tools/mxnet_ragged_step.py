"""A ragged batch's imperative MXNet decoding step against the hand-written loop, on the CPU.

The shape of ``tools/ragged_step.py`` (PyTorch's): 8 prompts of 256 down to
217 tokens, 512 hiddens, 8 query heads, a cache of 1024 positions; one token
per step, each example at its own position (docs: "Generating with a cache").
Three decoders take turns of 20 steps in one process: the layer with its
cache (the step of its signature's plan, docs: "Fast paths"), the same layer
through the generic flow alone (the plan turned off), and the loop a careful
user writes (the three products, a rotary layer's rows of its tables picked
by each example's position, the rows written at each example's position by
the one scatter ``keys[examples, :, lengths] = rows`` runs, without its index
expansion; each key/value head's query heads scored in one ``batch_dot``,
``sequence_mask`` hiding each example's keys past its own, the softmax, the
output product). The median turn's time per step is printed in microseconds,
with the ratio ours / hand-written in speed (above 1 when ours is faster), the
largest difference between ours and the loop's outputs, and the Python
function calls per step (cProfile) of the plan and of the generic flow.
``norms``: Qwen 3's RMSNorm of each head's query and key (weights drawn about
1; the loop's ``x / sqrt(mean(x ** 2) + eps) * w`` before the rotation).
``window``: a window of 4096 positions, which holds the whole cache
(Mistral's while a context is shorter: the loop is the same). ``softcap``:
the scores soft-capped at 50 (Gemma 2's), and ``sinks``: each head's sink
logit joins its softmax (gpt-oss'): ours takes the generic path's attention,
and the loop caps its scores (``50 * tanh(scores / 50)``) and gives its
softmax the sinks' column. ``alibi``: ALiBi's bias (BLOOM's), which the
loop adds to its scores, ``slope * (j - position)``.

    python tools/mxnet_ragged_step.py [num_kv_heads] [rounds] [rotary] [norms] [window]
        [softcap] [sinks] [alibi]
"""

from __future__ import annotations

import math
import sys
from unittest import mock

import mxnet as mx
import numpy as np
from mxnet import npx
from mxnet.ndarray.numpy import _internal as _npi
from turns import compare

from mha_multi.mxnet import MultiHeadAttention, _facts, set_weights
from mha_multi.spec import alibi_slopes
from mha_multi.weights import init_weights

BATCH, HIDDENS, HEADS, PROMPT, MAX_LENGTH, TURN = 8, 512, 8, 256, 1024, 20
HEAD_DIM = HIDDENS // HEADS
ROTARY = {"theta": 10000.0}
EPS = 1e-6  # (the norms' own)
SOFTCAP = 50.0
FLAGS = ("rotary", "norms", "window", "softcap", "sinks", "alibi")


def prompt_lengths() -> np.ndarray:
    return np.array([PROMPT - (7 * b) % 40 for b in range(BATCH)], dtype=np.int32)


def layer_steps(layer: MultiHeadAttention, prompt: mx.np.ndarray, token: mx.np.ndarray):
    """A step function of the layer after its prompt."""
    lengths = mx.np.array(prompt_lengths(), dtype=np.int32)
    _, cache = layer(
        prompt, prompt, prompt, lengths, causal=True, cache=layer.init_cache(BATCH, MAX_LENGTH)
    )
    held = [cache]

    def step() -> mx.np.ndarray:
        output, held[0] = layer(token, token, token, causal=True, cache=held[0])
        return output

    return step


def hand_steps(
    weights: dict, kv_heads: int, flags: set, prompt: mx.np.ndarray, token: mx.np.ndarray
):
    """The hand-written loop's step function after its prompt (the layer's weights)."""
    rotary, norms = "rotary" in flags, "norms" in flags
    w = {name: mx.np.array(array) for name, array in weights.items()}
    group = HEADS // kv_heads
    keys = mx.np.zeros((BATCH, kv_heads, MAX_LENGTH, HEAD_DIM))
    values = mx.np.zeros_like(keys)
    inverse = 1.0 / ROTARY["theta"] ** (np.arange(0, HEAD_DIM, 2, dtype=np.float64) / HEAD_DIM)
    angles = np.arange(MAX_LENGTH, dtype=np.float32)[:, None] * inverse.astype(np.float32)
    angles = mx.np.array(np.concatenate([angles, angles], -1))
    cos, sin = mx.np.cos(angles), mx.np.sin(angles)
    half = HEAD_DIM // 2
    slopes = None
    if "alibi" in flags:  # (the layer's, (1, H_kv, G, 1))
        slopes = mx.np.array(alibi_slopes(HEADS).reshape(1, kv_heads, group, 1), dtype=np.float32)

    def project(x: mx.np.ndarray) -> tuple[mx.np.ndarray, ...]:
        length = x.shape[1]
        heads = []
        for name, n, norm in (
            ("W_q", HEADS, "q_norm"),
            ("W_k", kv_heads, "k_norm"),
            ("W_v", kv_heads, None),
        ):
            projected = mx.np.dot(x, w[name]).reshape(BATCH, length, n, HEAD_DIM)
            if norms and norm is not None:
                scale = 1.0 / mx.np.sqrt((projected * projected).mean(-1, keepdims=True) + EPS)
                projected = projected * scale * w[norm]
            heads.append(projected.transpose(0, 2, 1, 3))
        return tuple(heads)

    def rotate(x: mx.np.ndarray, c: mx.np.ndarray, s: mx.np.ndarray) -> mx.np.ndarray:
        return x * c + mx.np.concatenate([-x[..., half:], x[..., :half]], axis=-1) * s

    lengths = prompt_lengths()
    _, k, v = project(prompt)
    if rotary:
        k = rotate(k, cos[:PROMPT], sin[:PROMPT])
    keys[:, :, :PROMPT], values[:, :, :PROMPT] = k, v
    examples, heads = np.indices((BATCH, kv_heads))

    def step() -> mx.np.ndarray:
        q, k, v = project(token)
        at = mx.np.array(lengths, dtype=np.int64)
        if rotary:
            c = mx.np.take(cos, at, axis=0).reshape(BATCH, 1, 1, HEAD_DIM)
            s = mx.np.take(sin, at, axis=0).reshape(BATCH, 1, 1, HEAD_DIM)
            q, k = rotate(q, c, s), rotate(k, c, s)
        where = np.stack([examples, heads, np.broadcast_to(lengths[:, None], examples.shape)])
        index = mx.np.array(where.reshape(3, -1), dtype=np.int64)
        for cache, rows in ((keys, k), (values, v)):
            rows = rows.reshape(-1, HEAD_DIM)
            _npi.scatter_set_nd(lhs=cache, rhs=rows, indices=index, shape=cache.shape, out=cache)
        end = int(lengths.max()) + 1
        scores = npx.batch_dot(
            q.reshape(BATCH * kv_heads, group, HEAD_DIM) / math.sqrt(HEAD_DIM),
            keys[:, :, :end].reshape(BATCH * kv_heads, end, HEAD_DIM),
            transpose_b=True,
        )
        seen = mx.np.array(np.repeat(lengths + 1, HEADS), dtype=np.int32)
        if "softcap" in flags:
            scores = mx.np.tanh(scores / SOFTCAP) * SOFTCAP
        if slopes is not None:  # slope * (j - position), each example's, each head's
            distance = mx.np.array(np.arange(end)[None, :] - lengths[:, None], dtype=np.float32)
            bias = slopes * distance.reshape(BATCH, 1, 1, end)
            scores = scores + bias.reshape(BATCH * kv_heads, group, end)
        masked = npx.sequence_mask(
            scores.reshape(-1, end), seen, use_sequence_length=True, value=-1e6, axis=1
        ).reshape(BATCH * kv_heads, group, end)
        if "sinks" in flags:  # (each head's logit a column of its own, dropped after)
            column = mx.np.broadcast_to(
                w["sinks"].reshape(1, kv_heads, group, 1), (BATCH, kv_heads, group, 1)
            )
            both = mx.np.concatenate([masked, column.reshape(BATCH * kv_heads, group, 1)], axis=-1)
            weights = npx.softmax(both, axis=-1)[:, :, :end]
        else:
            weights = npx.softmax(masked, axis=-1)
        context = npx.batch_dot(
            weights, values[:, :, :end].reshape(BATCH * kv_heads, end, HEAD_DIM)
        )
        np.add(lengths, 1, out=lengths)
        return mx.np.dot(context.reshape(BATCH, 1, HIDDENS), w["W_o"])

    return step


def main() -> None:
    arguments = [a for a in sys.argv[1:] if a not in FLAGS]
    kv_heads = int(arguments[0]) if arguments else 2
    rounds = int(arguments[1]) if len(arguments) > 1 else 8
    flags = {flag for flag in FLAGS if flag in sys.argv[1:]}
    weights = init_weights(HIDDENS, seed=0, num_heads=HEADS, num_kv_heads=kv_heads)
    rng = np.random.default_rng(0)
    if "norms" in flags:
        weights |= {name: rng.uniform(0.5, 1.5, HEAD_DIM) for name in ("q_norm", "k_norm")}
    if "sinks" in flags:
        weights["sinks"] = rng.standard_normal(HEADS)
    weights = {name: array.astype(np.float32) for name, array in weights.items()}
    options = {
        **({"rotary": ROTARY} if "rotary" in flags else {}),
        **({"qk_norm": {"eps": EPS}} if "norms" in flags else {}),
        **({"window": 4096} if "window" in flags else {}),
        **({"softcap": SOFTCAP} if "softcap" in flags else {}),
        **({"sinks": True} if "sinks" in flags else {}),
        **({"alibi": True} if "alibi" in flags else {}),
    }
    layer = set_weights(
        MultiHeadAttention(HIDDENS, HEADS, num_kv_heads=kv_heads, **options), weights
    )
    prompt = mx.np.array(rng.standard_normal((BATCH, PROMPT, HIDDENS)).astype(np.float32))
    token = mx.np.array(rng.standard_normal((BATCH, 1, HIDDENS)).astype(np.float32))

    def generic():  # (the plan answering no call)
        return mock.patch.object(_facts.MXNetFacts, "plain_attention", lambda *_, **__: None)

    ours, theirs = (
        layer_steps(layer, prompt, token),
        hand_steps(weights, kv_heads, flags, prompt, token),
    )
    difference = max(float(abs(ours() - theirs()).max()) for _ in range(TURN))
    compare(
        lambda: layer_steps(layer, prompt, token),
        lambda: hand_steps(weights, kv_heads, flags, prompt, token),
        generic=generic,
        difference=difference,
        rounds=rounds,
        turn=TURN,
        done=lambda output: output.wait_to_read(),
        counted_calls=10,
    )


if __name__ == "__main__":
    main()

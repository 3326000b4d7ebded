"""d2l's call on MXNet, attention with ``valid_lens``: ours against d2l's own layer.

A batch of 64 sequences of 10 positions (32 hiddens, 4 heads by default: the
shapes of d2l's Transformer chapter), float lengths from 1 to 10, called
imperatively. Three callers take turns of 20 calls in one process: the layer
(the plan of its signature, docs: "Fast paths"), the same layer through the
generic flow alone (the plan turned off), and d2l's ``MultiHeadAttention``
(the book's code, imperative, with the same weights), the "hand-written" row.
The median turn's time per call is printed in microseconds, with the ratio
ours / hand-written in speed (above 1 when ours is faster), the largest
difference between ours and d2l's outputs, and the Python function calls
per call (cProfile) of the plan and of the generic flow. ``train``: each call
recorded by ``autograd.record()`` and its backward run. ``cross``: the
queries attend to keys and values of their own, 12 positions (d2l's
``attention(X, Y, Y, valid_lens)``, a decoder attending to its encoder; the
lengths from 1 to 12), by the plan of cross-attention (docs: "Fast paths").
``dropout``: both layers drop their attention weights at 0.1 (d2l's training
of its Transformer; with ``train`` the dropout acts, and the largest
difference is that of a call in inference mode).

    python tools/mxnet_lengths_call.py [num_hiddens] [num_heads] [rounds] [train] [cross]
        [dropout]
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from unittest import mock

import mxnet as mx
import numpy as np
from mxnet import autograd
from turns import compare

from mha_multi.bench.mxnet import D2LMultiHeadAttention
from mha_multi.mxnet import MultiHeadAttention, _facts, set_weights
from mha_multi.weights import init_weights

BATCH, LENGTH, KEYS, TURN = 64, 10, 12, 20
#: The attention weights' dropout rate with ``dropout``.
DROPOUT = 0.1


def caller(layer: Callable, x: mx.np.ndarray, y: mx.np.ndarray, lens: mx.np.ndarray, train: bool):
    """A call of ``layer`` from ``x`` to ``y`` (keys and values) with ``lens``, recorded
    with its backward where ``train``."""

    def call() -> mx.np.ndarray:
        if not train:
            return layer(x, y, y, lens)
        x.attach_grad()
        with autograd.record():
            output = layer(x, y, y, lens)
        output.backward()
        return x.grad

    return call


def main() -> None:
    flags = ("train", "cross", "dropout")
    arguments = [a for a in sys.argv[1:] if a not in flags]
    hiddens = int(arguments[0]) if arguments else 32
    heads = int(arguments[1]) if len(arguments) > 1 else 4
    rounds = int(arguments[2]) if len(arguments) > 2 else 15
    train, cross = "train" in sys.argv[1:], "cross" in sys.argv[1:]
    dropout = DROPOUT if "dropout" in sys.argv[1:] else 0.0
    weights = init_weights(hiddens, seed=0, num_heads=heads)
    weights = {name: array.astype(np.float32) for name, array in weights.items()}
    ours = set_weights(MultiHeadAttention(hiddens, heads, dropout), weights)
    d2l = D2LMultiHeadAttention(hiddens, heads, dropout)
    d2l.initialize()
    for name in ("W_q", "W_k", "W_v", "W_o"):  # (Dense holds (out, in): the canonical's T)
        getattr(d2l, name).weight.set_data(mx.np.array(weights[name].T))
    rng = np.random.default_rng(0)
    x = mx.np.array(rng.standard_normal((BATCH, LENGTH, hiddens)).astype(np.float32))
    y = x
    if cross:
        y = mx.np.array(rng.standard_normal((BATCH, KEYS, hiddens)).astype(np.float32))
    lens = mx.np.array(rng.integers(1, y.shape[1] + 1, BATCH).astype(np.float32))
    plan = "cross_attention" if cross else "plain_attention"

    def generic():  # (the plan answering no call)
        return mock.patch.object(_facts.MXNetFacts, plan, lambda *_, **__: None)

    difference = float(abs(ours(x, y, y, lens) - d2l(x, y, y, lens)).max())

    def calls(layer: Callable) -> Callable[[], Callable[[], mx.np.ndarray]]:
        return lambda: caller(layer, x, y, lens, train)

    compare(
        calls(ours),
        calls(d2l),
        generic=generic,
        difference=difference,
        rounds=rounds,
        turn=TURN,
        done=lambda output: output.wait_to_read(),
        per="call",
    )


if __name__ == "__main__":
    main()

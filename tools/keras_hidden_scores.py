"""Keras on PyTorch's generic path: PyTorch's softmax or Keras' written-out one.

Keras' layer softmaxes by ``exp(x - max) / sum`` written out on every backend
(TensorFlow's softmax kernel misses the spec's non-finite pattern); on PyTorch
it takes PyTorch's generic path's softmax instead (docs: "Fast paths"):
``torch.softmax``, one kernel, and on a CPU short rows of many scores by the
formula floored before ``exp`` (PyTorch's CPU ``exp`` is six times slower
where its result is below the dtype's smallest normal number, as every
hidden key's score is). This times Keras' layer on its PyTorch backend
(``KERAS_BACKEND=torch``, one thread) in turns of ``TURN`` calls in one
process, PyTorch's softmax and the written-out one: calls of the generic
path at d2l's sizes (64 sequences of ``N`` positions, default 10, 32
hiddens, 4 heads, integer lengths: self-attention, the same recording its
backward, cross-attention over ``N + 2`` keys; ``masks_over_few_keys.py``'s
calls), one asking for the attention weights over 32 keys, and a decoding
step that hides no key (8 examples, 512 hiddens, 8 heads, a cache of 512
filled to 256). The median turn's time per call is printed in microseconds.

    python tools/keras_hidden_scores.py [N] [rounds]
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

os.environ["KERAS_BACKEND"] = "torch"

import masks_over_few_keys
import torch
from turns import median_calls

from mha_multi.keras import MultiHeadAttention
from mha_multi.keras._framework_ops import _KerasOps, framework_ops

TURN = 8


@contextlib.contextmanager
def written_out() -> Iterator[None]:
    """Keras' written-out softmax, as on its other backends."""
    native = framework_ops()
    with mock.patch.object(native, "softmax", lambda x: _KerasOps.softmax(native, x)):
        yield


def weights_over_32_keys() -> Callable[[], Any]:
    layer = MultiHeadAttention(32, 4)
    x, lengths = torch.randn(64, 32, 32), torch.randint(1, 33, (64,))
    return torch.no_grad()(lambda: layer(x, x, x, lengths, return_attention_weights=True))


def decoding_step() -> Callable[[], Any]:
    layer = MultiHeadAttention(512, 8)
    prompt, token = torch.randn(8, 256, 512), torch.randn(8, 1, 512)
    with torch.no_grad():
        _, cache = layer(prompt, prompt, prompt, causal=True, cache=layer.init_cache(8, 512))
    return torch.no_grad()(lambda: layer(token, token, token, causal=True, cache=cache))


def main() -> None:
    torch.set_num_threads(1)
    length = int(sys.argv[1]) if len(sys.argv) > 1 else 10
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 20
    torch.manual_seed(0)
    cases = masks_over_few_keys.calls(masks_over_few_keys.layer_maker(True), length)
    cases |= {"weights over 32 keys": weights_over_32_keys, "a step hiding none": decoding_step}
    for name, maker in cases.items():
        ways = {"PyTorch's": maker(), "written out": maker()}
        torch_way, written = median_calls(
            ways, rounds=rounds, turn=TURN, around={"written out": written_out}
        ).values()
        print(
            f"{name:>20}: {torch_way:6.0f} us a call ({written:6.0f} written out), "
            f"{written / torch_way:.2f}x"
        )


if __name__ == "__main__":
    main()

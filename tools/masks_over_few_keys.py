"""A mask over few keys on a CPU: the generic path the plan takes, or SDPA's kernel.

SDPA's CPU kernel applies an explicit mask over rows shorter than its vector
width on a slow path, so an eager call of more than one query over 8 to 15
keys that needs a mask takes the generic path (docs: "Fast paths"). This
times calls of d2l's sizes (64 sequences of ``N`` positions, default 10, 32
hiddens, 4 heads, integer lengths from 1 to ``N``): self-attention with
lengths (``self``), the same recording its backward (``train``), and
cross-attention of ``N`` queries over ``N + 2`` keys with lengths
(``cross``), in turns of ``TURN`` calls in one process: the plan's way, and
SDPA's with the rule turned off (every kernel plan made anew on entering and
leaving it). One thread. ``keras``: Keras' layer on its PyTorch backend
(``KERAS_BACKEND=torch``), which follows PyTorch's rule. The median turn's
time per call is printed in microseconds, with the speed-up.

    python tools/masks_over_few_keys.py [N] [rounds] [keras]
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import torch
from turns import median_calls

from mha_multi.call import decisions
from mha_multi.torch import _ops

HIDDENS, HEADS, BATCH, TURN = 32, 4, 64, 8


@contextlib.contextmanager
def kernel_taken() -> Iterator[None]:
    """The rule turned off: SDPA takes every mask, the kernel plans made anew."""
    decisions.forget()
    try:
        with mock.patch.object(_ops, "CPU_SLOW_MASK_KEYS", range(0)):
            yield
    finally:
        decisions.forget()


def layer_maker(keras: bool) -> Callable[[], Any]:
    """A fresh layer of the tool's sizes (each way its own: plans are kept per layer)."""
    if keras:
        os.environ.setdefault("KERAS_BACKEND", "torch")
        from mha_multi.keras import MultiHeadAttention as KerasLayer

        return lambda: KerasLayer(HIDDENS, HEADS)
    from mha_multi.torch import MultiHeadAttention

    return lambda: MultiHeadAttention(HIDDENS, HEADS).eval()


def calls(make: Callable[[], Any], length: int) -> dict[str, Callable[[], Callable[[], Any]]]:
    """Each case's maker of a call on a fresh layer, by name."""
    torch.manual_seed(0)
    x = torch.randn(BATCH, length, HIDDENS)
    memory = torch.randn(BATCH, length + 2, HIDDENS)
    lens = torch.randint(1, length + 1, (BATCH,))

    def self_attention() -> Callable[[], Any]:
        layer = make()
        return torch.no_grad()(lambda: layer(x, x, x, valid_lens=lens))

    def train() -> Callable[[], Any]:
        layer = make()

        def call() -> Any:
            queries = x.clone().requires_grad_()
            layer(queries, queries, queries, valid_lens=lens).sum().backward()
            return queries.grad

        return call

    def cross() -> Callable[[], Any]:
        layer = make()
        return torch.no_grad()(lambda: layer(x, memory, memory, valid_lens=lens))

    return {"self": self_attention, "train": train, "cross": cross}


def main() -> None:
    torch.set_num_threads(1)
    arguments = [a for a in sys.argv[1:] if a != "keras"]
    length = int(arguments[0]) if arguments else 10
    rounds = int(arguments[1]) if len(arguments) > 1 else 20
    make = layer_maker("keras" in sys.argv[1:])
    for name, maker in calls(make, length).items():
        ways = {"plan": maker(), "kernel": maker()}
        plan, kernel = median_calls(
            ways, rounds=rounds, turn=TURN, around={"kernel": kernel_taken}
        ).values()
        print(
            f"{name:>5} (N = {length}): {plan:6.0f} us a call (SDPA with the mask: "
            f"{kernel:6.0f} us), {kernel / plan:.2f}x"
        )


if __name__ == "__main__":
    main()

"""PyTorch's generic path over few keys on a CPU: the softmax by its formula, or ``torch.softmax``.

PyTorch's CPU softmax takes a scalar path for rows shorter than its vector
width; the generic path softmaxes rows shorter than ``SHORT_ROWS`` by the
formula's own operations instead (docs: "Fast paths"). This times calls of
d2l's sizes that run the generic path (64 sequences of 10 positions, 32
hiddens, 4 heads, float lengths from 1 to 10), the softmax the formula's,
and, in turns of ``TURN`` calls in one process, the formula without its
floor on the shifted scores and ``torch.softmax`` patched in: the attention
weights asked for (``weights``), a soft-capped layer (``softcap``), a
training call with dropout on the weights, forward and backward
(``dropout``), and a call on the route a GPU's takes, on the CPU
(``gpu-route``: the facts told the tensors are on a GPU). One thread. The
median turn's time per call is printed in microseconds, with the speed-ups.
``sizes`` times the softmax alone, the formula's against ``torch.softmax``,
over 1 to 512 rows of 3, 9 and 15 keys: below ``FEW_SCORES`` scores in all the
generic path takes ``torch.softmax``.

    python tools/torch_short_rows.py [rounds] [case ... | sizes]
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from unittest import mock

import torch
from turns import median_calls

from mha_multi.parity.harness import torch as backend
from mha_multi.torch import MultiHeadAttention, _ops, _steps

BATCH, LENGTH, HIDDENS, HEADS, TURN = 64, 10, 32, 4, 10


def calls() -> dict[str, Callable[[], torch.Tensor]]:
    """Each case's call, by name."""
    torch.manual_seed(0)
    x = torch.randn(BATCH, LENGTH, HIDDENS)
    lens = torch.randint(1, LENGTH + 1, (BATCH,)).float()
    plain = MultiHeadAttention(HIDDENS, HEADS).eval()
    capped = MultiHeadAttention(HIDDENS, HEADS, softcap=30.0).eval()
    dropping = MultiHeadAttention(HIDDENS, HEADS, dropout=0.1).train()

    @torch.no_grad()
    def weights() -> torch.Tensor:
        return plain(x, x, x, lens, return_attention_weights=True)[1]

    @torch.no_grad()
    def softcap() -> torch.Tensor:
        return capped(x, x, x, lens)

    def dropout() -> torch.Tensor:
        queries = x.clone().requires_grad_()
        dropping(queries, queries, queries, lens).sum().backward()
        return queries.grad

    @torch.no_grad()
    def gpu_route() -> torch.Tensor:
        with backend.as_if_on_a_gpu():
            return plain(x, x, x, lens)

    return {"weights": weights, "softcap": softcap, "dropout": dropout, "gpu-route": gpu_route}


def library_softmax() -> contextlib.AbstractContextManager:
    """The generic path's softmax replaced by ``torch.softmax`` at every row length."""

    def softmax(x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x, dim=-1)

    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch.object(_ops, "softmax", softmax))
    stack.enter_context(mock.patch.object(_steps, "softmax", softmax))
    return stack


def no_floor() -> contextlib.AbstractContextManager:
    """The formula without its floor on the shifted scores (every dtype as float16's)."""
    return mock.patch.dict(_ops._FLOORS, clear=True)


def sizes(rounds: int) -> None:
    """The softmax alone over scores of a few rows of few keys: the formula's
    (:data:`_ops.FEW_SCORES` patched to 0) against ``torch.softmax``."""
    for keys in (3, 9, 15):
        for rows in (1, 8, 32, 128, 512):
            x = torch.randn(rows, keys)
            formula, library = median_calls(
                {
                    "formula": lambda x=x: _ops.softmax(x),
                    "torch.softmax": lambda x=x: torch.softmax(x, -1),
                },
                rounds=rounds,
                turn=TURN * 10,
                around={"formula": lambda: mock.patch.object(_ops, "FEW_SCORES", 0)},
            ).values()
            print(
                f"{rows:4d} rows of {keys:2d} keys ({rows * keys:5d} scores): formula "
                f"{formula:5.1f} us, torch.softmax {library:5.1f} us ({library / formula:.2f}x)"
            )


def main() -> None:
    torch.set_num_threads(1)
    arguments = sys.argv[1:]
    rounds = int(arguments.pop(0)) if arguments and arguments[0].isdigit() else 30
    if arguments == ["sizes"]:
        sizes(rounds)
        return
    every = calls()
    for name in arguments or list(every):
        call = every[name]
        formula, unfloored, library = median_calls(
            dict.fromkeys(("formula", "no floor", "torch.softmax"), call),
            rounds=rounds,
            turn=TURN,
            around={"no floor": no_floor, "torch.softmax": library_softmax},
        ).values()
        print(
            f"{name:>9}: {formula:6.0f} us a call (no floor: {unfloored:6.0f} us, "
            f"{unfloored / formula:.2f}x; torch.softmax: {library:6.0f} us, "
            f"{library / formula:.2f}x)"
        )


if __name__ == "__main__":
    main()

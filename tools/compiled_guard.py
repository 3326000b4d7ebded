"""Where a compiled PyTorch call gains from SDPA behind its guard on the device.

Times ``torch.compile(layer, fullgraph=True)`` under ``torch.inference_mode()``
twice per shape: as the layer compiles (SDPA behind one ``torch.cond`` where
``Q * K >= GUARDED_KERNEL_SCORES``), and with the guard refused, so that the
graph runs the generic path. Both compile the same layer in one process, in
turns, fastest of several passes; ``guarded/generic`` below 1 means the guard
pays (docs: "Fast paths"). Self-attention, float32, 512 hiddens, 8 heads.

    python tools/compiled_guard.py [B,N[,lens] ...]     # e.g. 1,16 2,1024,lens
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from mha_multi.torch import MultiHeadAttention
from mha_multi.torch._facts import TorchFacts

SHAPES = ["1,1", "1,16", "8,128", "8,128,lens", "4,256", "4,256,lens", "2,1024,lens"]


def fastest(call: Callable[[], Any], *, passes: int = 5, repeats: int = 20) -> float:
    """The fastest of ``passes`` averages of ``repeats`` calls, in seconds."""
    for _ in range(3):
        call()
    best = float("inf")
    for _ in range(passes):
        start = time.perf_counter()
        for _ in range(repeats):
            call()
        best = min(best, (time.perf_counter() - start) / repeats)
    return best


def compare(batch: int, length: int, lens: bool, hiddens: int = 512, heads: int = 8) -> str:
    torch.manual_seed(0)
    sizes = {"query_size": hiddens, "key_size": hiddens, "value_size": hiddens}
    layer = MultiHeadAttention(hiddens, heads, **sizes).eval()
    x = torch.randn(batch, length, hiddens)
    args = (x, x, x) + ((torch.randint(1, length + 1, (batch,)),) if lens else ())
    guard = TorchFacts.values_guard
    times = {}
    try:
        for name in ("guarded", "generic"):
            if name == "generic":
                TorchFacts.values_guard = lambda self, q, sizes: False  # type: ignore[method-assign]
            torch._dynamo.reset()
            compiled = torch.compile(layer, fullgraph=True)
            with torch.inference_mode():
                times[name] = fastest(lambda compiled=compiled: compiled(*args))
    finally:
        TorchFacts.values_guard = guard  # type: ignore[method-assign]
    shape = f"B={batch} N={length}{' lens' if lens else ''}"
    return (
        f"{shape:<18} guarded {times['guarded'] * 1e6:9.0f} us  "
        f"generic {times['generic'] * 1e6:9.0f} us  "
        f"guarded/generic {times['guarded'] / times['generic']:.2f}"
    )


if __name__ == "__main__":
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for shape in sys.argv[1:] or SHAPES:
        batch, length, *rest = shape.split(",")
        print(compare(int(batch), int(length), lens=rest == ["lens"]), flush=True)

"""Where an eager PyTorch call on a GPU gains from reading its values for SDPA.

Times an eager forward under ``torch.no_grad()`` (self-attention, 512
hiddens, 8 heads, ``causal=True`` with lengths) per shape and dtype: as the
layer runs it (below ``spec.DEVICE_READ_SCORES`` scores per head the
generic path without any read, above it one read and SDPA), and with the
fused kernel refused, so that every call runs the generic path. Median of
many calls, each followed by ``torch.cuda.synchronize()``; ``default/generic``
below 1 means the read pays. The last column counts the synchronisations
of one default call (``torch.cuda.set_sync_debug_mode("warn")``) (docs:
"Fast paths", "Results").

    python tools/device_read.py [B,N ...]     # e.g. 1,16 4,256 2,2048
"""

from __future__ import annotations

import sys
import time
import warnings
from collections.abc import Callable
from typing import Any
from unittest import mock

import numpy as np
import torch

from mha_multi.torch import MultiHeadAttention
from mha_multi.torch._backend import FACTS

SHAPES = ["1,1", "1,16", "1,128", "4,256", "8,512", "2,2048", "1,8192"]


def synchronisations(call: Callable[[], Any]) -> int:
    """How many times ``call()`` waits for the GPU, as PyTorch counts it."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            call()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return sum("synchroniz" in str(w.message) for w in caught)


def median_ms(call: Callable[[], Any], repeats: int) -> float:
    """The median time of ``call()`` and the device's work, in milliseconds."""
    for _ in range(5):
        call()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e3


def main(shapes: list[str]) -> None:
    if not torch.cuda.is_available():
        sys.exit("no CUDA device: the read is made on every call on the CPU")
    device = torch.device("cuda")
    print("| dtype | B | N | default (ms) | generic (ms) | default/generic | synchronisations |")
    print("|---|---|---|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        layer = MultiHeadAttention(512, 8, device=device, dtype=dtype).eval()
        for shape in shapes:
            batch, length = (int(size) for size in shape.split(","))
            x = torch.randn(batch, length, 512, device=device, dtype=dtype)
            lens = torch.full((batch,), length - 1, device=device)
            repeats = 200 if length <= 256 else 30
            with torch.no_grad():

                def call(
                    layer: MultiHeadAttention = layer,
                    x: torch.Tensor = x,
                    lens: torch.Tensor = lens,
                ) -> Any:
                    return layer(x, x, x, lens, causal=True)

                syncs = synchronisations(call)
                default = median_ms(call, repeats)
                with (
                    mock.patch.object(FACTS, "kernel", None),
                    mock.patch.object(FACTS, "plain_attention", return_value=None),
                ):
                    generic = median_ms(call, repeats)
            name = str(dtype).removeprefix("torch.")
            print(
                f"| {name} | {batch} | {length} | {default:.3f} | {generic:.3f} "
                f"| {default / generic:.2f}x | {syncs} |",
                flush=True,
            )


if __name__ == "__main__":
    main(sys.argv[1:] or SHAPES)

"""Where an eager PyTorch call on a GPU gains from reading its values for SDPA.

Times an eager forward under ``torch.no_grad()`` (self-attention, 512
hiddens, 8 heads, ``causal=True`` with lengths) per shape and dtype, four
ways in turns (``ROUNDS`` rounds, the median of each way's calls, each call
followed by ``torch.cuda.synchronize()``):

- ``default``: as the layer runs it (below ``spec.DEVICE_READ_SCORES``
  scores per head or ``spec.DEVICE_READ_TOTAL_SCORES`` in all the generic
  path without any read, above both one read and SDPA);
- ``read``: the read and SDPA at every shape (both thresholds set to 0), so
  that the read's worth is measured below them too;
- ``sum only``: the same, with the largest query and key that the read
  carries where a key may be hidden replaced by zeros, which costs the read
  two reductions fewer (what the bound on the scores costs; its numbers are
  not the spec's where a visible score falls below -1e6);
- ``generic``: the fused kernel refused, so that every call runs the
  generic path.

``read/generic`` below 1 means the read pays. The last column counts the
synchronisations of one default call (``torch.cuda.set_sync_debug_mode
("warn")``) (docs: "Fast paths", "Results").

    python tools/device_read.py [B,N ...]     # e.g. 1,16 4,256 2,2048
"""

from __future__ import annotations

import contextlib
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import numpy as np
import torch

from mha_multi.parity.harness.torch import generic_flow_only
from mha_multi.torch import MultiHeadAttention, _facts
from mha_multi.torch._facts import FACTS

SHAPES = ["1,1", "1,16", "1,128", "4,256", "8,512", "2,2048", "1,8192"]
ROUNDS = 3


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


def times_ms(call: Callable[[], Any], repeats: int) -> list[float]:
    """``repeats`` times of ``call()`` and the device's work, in milliseconds."""
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def ways() -> dict[str, Callable[[], contextlib.AbstractContextManager]]:
    """Each way's patches, entered around its calls."""

    def sum_only(x: torch.Tensor) -> torch.Tensor:
        return torch.zeros((), dtype=torch.float32, device=x.device)

    def always() -> contextlib.AbstractContextManager:
        return _stacked(
            mock.patch("mha_multi.spec.plan.DEVICE_READ_SCORES", 0),
            mock.patch("mha_multi.spec.plan.DEVICE_READ_TOTAL_SCORES", 0),
        )

    return {
        "default": contextlib.nullcontext,
        "read": always,
        "sum only": lambda: _stacked(
            always(), mock.patch.object(_facts, "extremes", lambda x: [sum_only(x)] * 2)
        ),
        "generic": lambda: _stacked(
            mock.patch.object(FACTS, "kernel", None),
            generic_flow_only(),
        ),
    }


@contextlib.contextmanager
def _stacked(*managers: contextlib.AbstractContextManager) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for manager in managers:
            stack.enter_context(manager)
        yield


def main(shapes: list[str]) -> None:
    if not torch.cuda.is_available():
        sys.exit("no CUDA device: the read is made on every call on the CPU")
    device = torch.device("cuda")
    patches = ways()
    names = " | ".join(f"{name} (ms)" for name in patches)
    print(f"| dtype | B | N | {names} | read/generic | synchronisations |")
    print("|---|---|---|" + "---|" * len(patches) + "---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        layer = MultiHeadAttention(512, 8, device=device, dtype=dtype).eval()
        for shape in shapes:
            batch, length = (int(size) for size in shape.split(","))
            x = torch.randn(batch, length, 512, device=device, dtype=dtype)
            lens = torch.full((batch,), length - 1, device=device)
            repeats = (200 if length <= 256 else 30) // ROUNDS
            with torch.no_grad():

                def call(
                    layer: MultiHeadAttention = layer,
                    x: torch.Tensor = x,
                    lens: torch.Tensor = lens,
                ) -> Any:
                    return layer(x, x, x, lens, causal=True)

                syncs = synchronisations(call)
                times: dict[str, list[float]] = {name: [] for name in patches}
                for _ in range(ROUNDS):
                    for name, patch in patches.items():
                        with patch():
                            times[name] += times_ms(call, repeats)
            median = {name: float(np.median(each)) for name, each in times.items()}
            cells = " | ".join(f"{median[name]:.3f}" for name in patches)
            name = str(dtype).removeprefix("torch.")
            print(
                f"| {name} | {batch} | {length} | {cells} "
                f"| {median['read'] / median['generic']:.2f}x | {syncs} |",
                flush=True,
            )


if __name__ == "__main__":
    main(sys.argv[1:] or SHAPES)

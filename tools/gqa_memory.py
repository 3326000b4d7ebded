"""Peak GPU memory of PyTorch's SDPA with grouped heads, and of the layer's long calls.

For float32 and bfloat16, 8 query heads of 64 and 2 or 8 key/value heads:
the peak allocation of ``scaled_dot_product_attention`` alone on
``(8, 8, 256, 64)`` causal queries with ``enable_gqa`` and with the heads
repeated, which of SDPA's CUDA kernels take the grouped call, and the peak
of the layer's call (512 hiddens, 8 examples of 256 positions, under
``torch.inference_mode()``) with a cache (a prefill) and without, in MiB
(docs: "Fast paths", "Results").

    python tools/gqa_memory.py
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.nn import functional
from torch.nn.attention import SDPBackend, sdpa_kernel

from mha_multi.torch import MultiHeadAttention

DEVICE = torch.device("cuda")
KERNELS = {
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
}


def peak(run: Callable[[], Any]) -> float:
    """The most memory ``run()`` allocated beyond what was allocated before, in MiB."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    run()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def takes(kernel: SDPBackend, *arrays: torch.Tensor) -> bool:
    """Whether ``kernel`` runs SDPA's grouped call of ``arrays``."""
    try:
        with warnings.catch_warnings(), sdpa_kernel(kernel):
            warnings.simplefilter("ignore")
            functional.scaled_dot_product_attention(*arrays, is_causal=True, enable_gqa=True)
    except RuntimeError:
        return False
    return True


def row(dtype: torch.dtype, kv_heads: int) -> str:
    """The table's row of ``dtype`` and ``kv_heads`` key/value heads (of 8 query heads)."""
    q = torch.randn(8, 8, 256, 64, device=DEVICE, dtype=dtype)
    k, v = (torch.randn(8, kv_heads, 256, 64, device=DEVICE, dtype=dtype) for _ in "kv")
    repeats = 8 // kv_heads
    grouped = peak(
        lambda: functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=repeats > 1
        )
    )
    k_repeated, v_repeated = (x.repeat_interleave(repeats, 1) for x in (k, v))
    repeated = peak(
        lambda: functional.scaled_dot_product_attention(q, k_repeated, v_repeated, is_causal=True)
    )
    kernels = ", ".join(name for name, kernel in KERNELS.items() if takes(kernel, q, k, v))
    layer = MultiHeadAttention(512, 8, num_kv_heads=kv_heads, device=DEVICE, dtype=dtype).eval()
    x = torch.randn(8, 256, 512, device=DEVICE, dtype=dtype)
    with torch.inference_mode():
        cache = layer.init_cache(8, 512)
        prefill = peak(lambda: layer(x, x, x, causal=True, cache=cache))
        plain = peak(lambda: layer(x, x, x, causal=True))
    return (
        f"| {str(dtype)[6:]} | 8/{kv_heads} | {grouped:.1f} | {repeated:.1f} | "
        f"{kernels or 'none'} | {prefill:.1f} | {plain:.1f} |"
    )


def main() -> None:
    print(
        "| dtype | heads (q/kv) | SDPA, enable_gqa | SDPA, repeated |"
        " kernels taking the grouped call | layer's prefill | layer's call |"
    )
    print("|---|---|---|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        for kv_heads in (2, 8):
            print(row(dtype, kv_heads), flush=True)


if __name__ == "__main__":
    main()

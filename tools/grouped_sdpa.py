"""SDPA's time for one query of grouped heads: ``enable_gqa`` against the heads folded.

A decoding step's queries ``(B, H, 1, dh)`` against a cache's ``(B, H_kv, K,
dh)`` keys and values, as ``scaled_dot_product_attention(..., enable_gqa=True)``
takes them and as the layer gives them, ``(B, H_kv, G, dh)``: each key/value
head's ``G`` query heads as its queries (docs: "Fast paths"). The two calls
take turns; the medians of their blocks are printed, in microseconds, with
the largest difference between their outputs (the dtype's rounding). On a
GPU (``--device cuda``) each block ends with a synchronisation.

    python tools/grouped_sdpa.py [--batch 8] [--heads 8] [--kv-heads 2] [--head-dim 64]
        [--keys 400] [--blocks 7] [--calls 300] [--device cpu|cuda]
        [--dtype float32|bfloat16|float16]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.nn.functional import scaled_dot_product_attention


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--keys", type=int, default=400)
    parser.add_argument("--blocks", type=int, default=7)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    batch, heads, kv_heads, head_dim = args.batch, args.heads, args.kv_heads, args.head_dim
    group = heads // kv_heads
    generator = torch.Generator().manual_seed(0)
    # A cache of twice the keys, attended over its filled positions (a view, as a step's).
    keys, values = (
        torch.randn(batch, kv_heads, 2 * args.keys, head_dim, generator=generator)
        .to(device, dtype)
        .narrow(2, 0, args.keys)
        for _ in "kv"
    )
    queries = torch.randn(batch, heads, 1, head_dim, generator=generator).to(device, dtype)

    def grouped() -> torch.Tensor:
        return scaled_dot_product_attention(queries, keys, values, enable_gqa=True)

    def folded() -> torch.Tensor:
        folded_queries = queries.view(batch, kv_heads, group, head_dim)
        output = scaled_dot_product_attention(folded_queries, keys, values)
        return output.reshape(batch, heads, 1, head_dim)

    ways = {"enable_gqa": grouped, "folded": folded}
    times: dict[str, list[float]] = {name: [] for name in ways}
    with torch.inference_mode():
        difference = (grouped() - folded()).abs().max().item()
        for _ in range(args.blocks):
            for name, way in ways.items():
                for _ in range(10):
                    way()
                sync()
                start = time.perf_counter()
                for _ in range(args.calls):
                    way()
                sync()
                times[name].append((time.perf_counter() - start) / args.calls * 1e6)
    for name, measured in times.items():
        print(f"{name}: {statistics.median(measured):.1f} us")
    print(f"largest difference: {difference:.1e}")


if __name__ == "__main__":
    main()

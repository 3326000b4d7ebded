"""Whether FlexAttention gives the spec's attention with nothing read.

An eager call on a GPU reads its projections once where its scores are many
(docs: "Fast paths", "Why the read stays"): SDPA adds its mask, and only the
values tell whether that agrees with the spec, which *replaces* a hidden
score by -1e6. ``torch.nn.attention.flex_attention`` with a ``score_mod``
that replaces the hidden scores itself applies the spec's rule inside a
fused kernel, so no value decides anything. One difference is left: a row
whose every score is ``-inf`` (no key hidden, infinite inputs) has the
spec's NaN, and FlexAttention's guard for rows its mask hides entirely gives
0 there. Its log-sum-exp is ``-inf`` exactly on such rows (a hidden key's
-1e6 keeps it finite anywhere else), so ``where(lse == -inf, NaN, out)``
mends them from the kernel's own outputs.

Each case edits random projections (a NaN, an infinity, magnitudes whose
visible scores fall below -1e6, lengths of 0) and compares the compiled
kernel's context, with and without the mend (on a GPU: PyTorch's CPU kernel
returns no log-sum-exp), against
:func:`mha_multi.spec.attention` in float64: the NaN and infinity patterns,
and the largest difference where both are finite. Then times the kernel
against SDPA with the causal flag (the read's kernel) where a GPU is there.

    python tools/flex_semantics.py [cpu|cuda]
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.nn.attention.flex_attention import flex_attention

from mha_multi import spec

B, H, H_KV, Q, K, D = 2, 4, 2, 8, 8, 16  # (16: the least head size the GPU kernel takes)
#: The timed shapes (each a compile of its own).
SHAPES = {torch.float32: ((2, 2048),), torch.bfloat16: ((2, 2048), (1, 8192))}
Edit = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]


def spec_context(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: torch.Tensor, causal: bool
) -> np.ndarray:
    """The spec's context ``(B, H, Q, D)`` in float64 numpy."""
    merged = [x.double().transpose(1, 2).flatten(2).cpu().numpy() for x in (q, k, v)]
    with np.errstate(all="ignore"):  # (the non-finite cases' own arithmetic)
        context, _ = spec.attention(
            spec.NumpyOps(),
            *merged,
            lens.cpu().numpy(),
            num_heads=H,
            head_dim=D,
            num_kv_heads=H_KV,
            causal=causal,
        )
    return context.reshape(B, Q, H, D).transpose(0, 2, 1, 3)


def flex_context(
    kernel: Callable[..., Any],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lens: torch.Tensor,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlexAttention's context, the spec's rule in its ``score_mod``, and the mended one."""
    offset = k.shape[2] - q.shape[2]

    def score_mod(
        score: torch.Tensor,
        b: torch.Tensor,
        h: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
    ) -> torch.Tensor:
        visible = key < lens[b]
        if causal:
            visible = visible & (key <= query + offset)
        return torch.where(visible, score, -1e6)

    if not q.is_cuda:
        # (PyTorch's CPU kernel returns no log-sum-exp: nothing to mend with.)
        return (kernel(q, k, v, score_mod=score_mod, enable_gqa=True),) * 2
    out, lse = kernel(q, k, v, score_mod=score_mod, enable_gqa=True, return_lse=True)
    return out, torch.where((lse == -math.inf)[..., None], math.nan, out)


def same_pattern(got: np.ndarray, expected: np.ndarray) -> tuple[bool, float]:
    """Whether NaN and infinities sit where the reference has them, and the
    largest difference where both are finite."""
    same = np.array_equal(np.isnan(got), np.isnan(expected))
    infinite = np.isinf(expected)
    same = same and np.array_equal(np.isinf(got), infinite)
    same = same and np.array_equal(got[infinite], expected[infinite])
    finite = np.isfinite(got) & np.isfinite(expected)
    return same, float(np.abs(got[finite] - expected[finite]).max(initial=0.0))


def cases() -> dict[str, tuple[Edit, tuple[int, int], bool]]:
    def put(name: str, index: tuple[int, ...], value: float) -> Edit:
        def edit(q, k, v):
            {"q": q, "k": k, "v": v}[name][index] = value

        return edit

    def every_score_minus_inf(q, k, v):
        q[1] = 1.0
        k[1] = -math.inf

    def below_the_mask_value(q, k, v):
        q.abs_().mul_(3e3)
        k.abs_().mul_(-3e3)

    return {
        "plain": (lambda q, k, v: None, (5, 8), True),
        "fully hidden row (length 0)": (lambda q, k, v: None, (0, 8), True),
        "NaN query": (put("q", (1, 0, 3, 1), math.nan), (5, 8), True),
        "NaN query, fully hidden row": (put("q", (0, 0, 3, 1), math.nan), (0, 8), True),
        "NaN key past the length": (put("k", (0, 1, 6, 2), math.nan), (5, 8), True),
        "NaN key the causal rule hides": (put("k", (1, 1, 7, 2), math.nan), (5, 8), True),
        "inf key past the length": (put("k", (0, 1, 6, 2), math.inf), (5, 8), True),
        "inf key visible": (put("k", (1, 0, 2, 2), math.inf), (5, 8), True),
        "-inf key visible": (put("k", (1, 0, 2, 2), -math.inf), (5, 8), True),
        "inf value past the length": (put("v", (0, 1, 6, 2), math.inf), (5, 8), True),
        "NaN value past the length": (put("v", (0, 1, 6, 2), math.nan), (5, 8), True),
        "inf value visible": (put("v", (1, 1, 2, 2), math.inf), (5, 8), True),
        "every score -inf, no key hidden": (every_score_minus_inf, (8, 8), False),
        "visible scores below -1e6": (below_the_mask_value, (5, 8), True),
    }


def check(device: str) -> bool:
    kernel = torch.compile(flex_attention, dynamic=False)
    print("| case | kernel: same pattern, error | mended: same pattern, error |")
    print("|---|---|---|")
    passed = True
    generator = torch.Generator().manual_seed(0)
    for name, (edit, lens, causal) in cases().items():
        q = torch.randn(B, H, Q, D, generator=generator)
        k, v = (torch.randn(B, H_KV, K, D, generator=generator) for _ in range(2))
        edit(q, k, v)
        expected = spec_context(q, k, v, torch.tensor(lens), causal)
        on = [x.to(device) for x in (q, k, v, torch.tensor(lens))]
        with torch.no_grad():
            out, mended = flex_context(kernel, *on, causal)
        cells = []
        for got in (out, mended):
            same, error = same_pattern(got.double().cpu().numpy(), expected)
            cells.append(f"{same}, {error:.1e}")
        passed = passed and cells[1].startswith("True") and float(cells[1].split()[-1]) < 1e-5
        print(f"| {name} | {cells[0]} | {cells[1]} |", flush=True)
    return passed


def timings() -> None:
    """FlexAttention with the spec's rule against SDPA's causal flag, (B, 8, N, 64)."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    kernel = torch.compile(flex_attention, dynamic=False)
    print("\n| dtype | (B, N) | FlexAttention (ms) | SDPA, causal (ms) | flex / SDPA |")
    print("|---|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        for batch, length in SHAPES[dtype]:
            q, k, v = (
                torch.randn(batch, 8, length, 64, device="cuda", dtype=dtype) for _ in range(3)
            )
            lens = torch.full((batch,), length - 1, device="cuda")

            def score_mod(score, b, h, query, key, lens=lens):
                return torch.where((key < lens[b]) & (key <= query), score, -1e6)

            runs = {
                "flex": lambda q=q, k=k, v=v, mod=score_mod: kernel(q, k, v, score_mod=mod),
                "sdpa": lambda q=q, k=k, v=v: sdpa(q, k, v, is_causal=True),
            }
            median = {}
            for name, run in runs.items():
                for _ in range(3):
                    run()
                torch.cuda.synchronize()
                times = []
                for _ in range(20):
                    start = time.perf_counter()
                    run()
                    torch.cuda.synchronize()
                    times.append((time.perf_counter() - start) * 1e3)
                median[name] = float(np.median(times))
            name = str(dtype).removeprefix("torch.")
            print(
                f"| {name} | ({batch}, {length}) | {median['flex']:.3f} | {median['sdpa']:.3f} "
                f"| {median['flex'] / median['sdpa']:.2f}x |",
                flush=True,
            )


def main(device: str = "cpu") -> None:
    # Every case and shape compiles: more than Dynamo's default number of graphs.
    torch._dynamo.config.recompile_limit = 64
    start = time.perf_counter()
    passed = check(device)
    print(
        f"\n{'every case' if passed else 'NOT every case'} mended to the spec's pattern "
        f"({time.perf_counter() - start:.0f} s, compiles included)"
    )
    if device == "cuda":
        timings()


if __name__ == "__main__":
    main(*sys.argv[1:2])

"""How often PyTorch's SDPA gives another non-finite pattern than the spec's softmax.

One query per example and head attends over every key (a decoding step: no
mask), with one or two entries of the queries, keys or values set to NaN (or
to +-inf). The spec's pattern is that of its masked softmax, computed here as
the generic path computes it (``softmax(q @ k^T / sqrt(d)) @ v``, float32);
a trial counts when SDPA's output differs in where it is NaN, where it is
infinite, or in an infinity's sign. The counts, by which inputs held the
values, are why the fused path reads one finiteness sum per call instead of
fixing SDPA's rows up from the inputs (docs: "Fast paths").

    python tools/sdpa_nonfinite.py [TRIALS]
"""

from __future__ import annotations

import sys

import torch


def pattern_differs(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` differ in where they are NaN or infinite (with its sign)."""
    if not torch.equal(torch.isnan(a), torch.isnan(b)):
        return True
    infinite = torch.isinf(a)
    return not torch.equal(infinite, torch.isinf(b)) or not torch.equal(a[infinite], b[infinite])


def count(trials: int, specials: list[float], seed: int = 0) -> dict[str, int]:
    """Trials whose patterns differ, by the inputs that held ``specials``."""
    generator = torch.Generator().manual_seed(seed)
    differing: dict[str, int] = {}
    for _ in range(trials):
        num_keys = int(torch.randint(1, 70, (), generator=generator))
        q, k, v = (torch.randn(2, 2, n, 8, generator=generator) for n in (1, num_keys, num_keys))
        held = ""
        for name, x in zip("qkv", (q, k, v), strict=True):
            for _ in range(int(torch.randint(0, 3, (), generator=generator))):
                where = tuple(int(torch.randint(0, s, (), generator=generator)) for s in x.shape)
                x[where] = specials[int(torch.randint(0, len(specials), (), generator=generator))]
            held += name if not torch.isfinite(x).all() else ""
        generic = torch.softmax((q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5, -1) @ v
        fused = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        if pattern_differs(fused, generic):
            differing[held] = differing.get(held, 0) + 1
    return differing


if __name__ == "__main__":
    trials = int(sys.argv[1]) if len(sys.argv) > 1 else 3000
    print(f"torch {torch.__version__}, {trials} trials each")
    for label, specials in (("NaN", [float("nan")]), ("+-inf", [float("inf"), -float("inf")])):
        counts = count(trials, specials)
        print(f"{label}: patterns differ in", dict(sorted(counts.items())) or "no trial")

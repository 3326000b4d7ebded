"""A Llama-shaped layer's eager PyTorch decoding step against a hand-written one, on the CPU.

Ours (rotary positions, grouped heads, the layer's cache) and the rotary
static-cache step a careful user writes (cosine and sine tables computed
once for every position, the cache written in place, SDPA over the filled
positions) take turns of :data:`BLOCK` steps in one process, so a shared
machine's drift falls on both; each block's time per step is kept, and the
ratio of the medians printed, with the largest difference of their outputs.

``one-thread``: one thread for PyTorch's kernels (on a machine whose cores
are busy, a second thread's wait can cost more than the kernel).
``tiny``: 16 hiddens, 2 query heads and 1 key/value head, one example, one
thread: a step's time is its Python (docs: "Results"). ``plain``: no rotary,
8 key/value heads (the plain layer). ``window=W``, ``softcap=C``: the layer's
sliding window and soft cap (Mistral's, Gemma 2's); the hand-written step
then attends over the window's positions only, and with a cap writes its
attention out (SDPA has none). ``norms``: Qwen 3's RMSNorm of each query and
key head (``qk_norm={}``), which the hand-written step computes in float32
as ``x * rsqrt(mean(x * x) + eps) * w``. ``sinks``: gpt-oss's learned sink
logit of each head, a column of the softmax that no value follows, which the
hand-written step writes out (SDPA has none).

    python tools/rotary_step.py [tiny] [plain] [one-thread] [norms] [sinks] [window=W]
        [softcap=C] [blocks]
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from collections.abc import Callable, Iterator

import numpy as np
import torch
from torch.nn import functional

from mha_multi.torch import MultiHeadAttention, set_weights
from mha_multi.weights import init_weights

ARGS = sys.argv[1:]
TINY, PLAIN, NORMS, SINKS = (name in ARGS for name in ("tiny", "plain", "norms", "sinks"))
if "one-thread" in ARGS:  # (a loaded machine's second thread waits on the other's work)
    torch.set_num_threads(1)
BLOCKS = next((int(a) for a in ARGS if a.isdigit()), 40)
OPTIONS = dict(a.split("=") for a in ARGS if "=" in a)
WINDOW = int(OPTIONS["window"]) if "window" in OPTIONS else None
SOFTCAP = float(OPTIONS["softcap"]) if "softcap" in OPTIONS else None
if TINY:
    BATCH, HIDDENS, HEADS, KV_HEADS, PROMPT = 1, 16, 2, 1, 4
    torch.set_num_threads(1)
else:
    BATCH, HIDDENS, HEADS, KV_HEADS, PROMPT = 8, 512, 8, 2, 256
if PLAIN:
    KV_HEADS = HEADS
HEAD_DIM = HIDDENS // HEADS
BLOCK = 20
MAX_LENGTH = PROMPT + BLOCK * (2 * BLOCKS + 4) + 1
THETA = 10000.0
ROTARY = None if PLAIN else {"theta": THETA}
EPS = 1e-6  # (the layer's default qk_norm eps)

Step = Callable[[torch.Tensor], torch.Tensor]


def ours(weights: dict, prompt: torch.Tensor) -> tuple[Step, torch.Tensor]:
    layer = MultiHeadAttention(
        HIDDENS,
        HEADS,
        num_kv_heads=KV_HEADS,
        rotary=ROTARY,
        window=WINDOW,
        softcap=SOFTCAP,
        qk_norm={} if NORMS else None,
        sinks=SINKS,
    ).eval()
    set_weights(layer, weights)
    state = {"cache": layer.init_cache(BATCH, MAX_LENGTH)}
    out, state["cache"] = layer(prompt, prompt, prompt, causal=True, cache=state["cache"])

    def step(token: torch.Tensor) -> torch.Tensor:
        out, state["cache"] = layer(token, token, token, causal=True, cache=state["cache"])
        return out

    return step, out[:, -1:]


def hand_written(weights: dict, prompt: torch.Tensor) -> tuple[Step, torch.Tensor]:
    w = {n: torch.tensor(weights[f"W_{n}"].T.copy()) for n in "qkvo"}
    half = HEAD_DIM // 2
    inv = 1.0 / THETA ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM)
    angles = torch.arange(MAX_LENGTH, dtype=torch.float32)[:, None] * inv.float()
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]  # (L, 1, half)
    shape = (BATCH, KV_HEADS, MAX_LENGTH, HEAD_DIM)
    cache = {"k": torch.zeros(shape), "v": torch.zeros(shape)}
    gqa = {"enable_gqa": True} if KV_HEADS != HEADS else {}
    norms = {n: torch.tensor(weights[f"{n}_norm"]) for n in "qk"} if NORMS else None
    # (Each key/value head's group of query heads' sink logits, as the grouped scores lie.)
    sinks = torch.tensor(weights["sinks"]).view(KV_HEADS, -1, 1, 1) if SINKS else None

    def normed(x: torch.Tensor, name: str) -> torch.Tensor:
        if norms is None:
            return x
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * norms[name]

    def rotate(x: torch.Tensor, at: slice) -> torch.Tensor:
        if PLAIN:
            return x
        c, s = cos[at], sin[at]
        first, second = x[..., :half], x[..., half:]
        return torch.cat([first * c - second * s, second * c + first * s], -1)

    def written_out(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, first: int):
        # Each key/value head's group of query heads as rows of one product,
        # (B, H_kv, G*n, dh); the causal rule and the window as one mask of positions.
        n, end = q.shape[2], first + keys.shape[2]
        grouped = q.reshape(BATCH, KV_HEADS, HEADS // KV_HEADS * n, HEAD_DIM)
        scores = grouped @ keys.transpose(-1, -2) / math.sqrt(HEAD_DIM)
        if SOFTCAP is not None:
            scores = torch.tanh(scores / SOFTCAP) * SOFTCAP
        scores = scores.view(*scores.shape[:2], -1, n, scores.shape[-1])  # (B, H_kv, G, n, K)
        if n > 1:
            i = torch.arange(end - n, end)[:, None]
            j = torch.arange(first, end)[None, :]
            seen = (j <= i) & ((i - j < WINDOW) if WINDOW is not None else True)
            scores = scores.masked_fill(~seen, float("-inf"))
        if sinks is None:
            weights = scores.softmax(-1)
        else:
            column = sinks.expand(*scores.shape[:-1], 1)
            weights = torch.cat((scores, column), -1).softmax(-1)[..., :-1]
        context = weights.flatten(2, 3) @ values
        return context.view(BATCH, HEADS, n, HEAD_DIM)

    def attend(x: torch.Tensor, start: int, causal: bool) -> torch.Tensor:
        n = x.shape[1]
        at = slice(start, start + n)
        q = functional.linear(x, w["q"]).view(BATCH, n, HEADS, HEAD_DIM)
        k = functional.linear(x, w["k"]).view(BATCH, n, KV_HEADS, HEAD_DIM)
        q, k = rotate(normed(q, "q"), at), rotate(normed(k, "k"), at)
        v = functional.linear(x, w["v"]).view(BATCH, n, KV_HEADS, HEAD_DIM)
        cache["k"][:, :, at] = k.transpose(1, 2)
        cache["v"][:, :, at] = v.transpose(1, 2)
        # A step sees the window's positions only.
        first = 0 if WINDOW is None or n > 1 else max(0, start + 1 - WINDOW)
        end = start + n
        keys, values = cache["k"][:, :, first:end], cache["v"][:, :, first:end]
        if SOFTCAP is not None or SINKS or (n > 1 and WINDOW is not None and n > WINDOW):
            context = written_out(q.transpose(1, 2), keys, values, first)
        else:
            context = functional.scaled_dot_product_attention(
                q.transpose(1, 2), keys, values, is_causal=causal, **gqa
            )
        return functional.linear(context.transpose(1, 2).flatten(2), w["o"])

    out = attend(prompt, 0, True)
    position = [PROMPT]

    def step(token: torch.Tensor) -> torch.Tensor:
        out = attend(token, position[0], False)
        position[0] += 1
        return out

    return step, out[:, -1:]


def blocks(step: Step, token: torch.Tensor, outputs: list) -> Iterator[float]:
    while True:
        start = time.perf_counter_ns()
        for _ in range(BLOCK):
            token = step(token)
            outputs.append(token)
        yield (time.perf_counter_ns() - start) / BLOCK / 1e3


def main() -> None:
    weights = init_weights(HIDDENS, num_heads=HEADS, num_kv_heads=KV_HEADS, seed=0, sinks=SINKS)
    if NORMS:  # (norms' weights about 1, as trained ones are)
        rng = np.random.default_rng(1)
        for name in ("q_norm", "k_norm"):
            weights[name] = (1.0 + 0.1 * rng.standard_normal(HEAD_DIM)).astype(np.float32)
    prompt = torch.randn(BATCH, PROMPT, HIDDENS, generator=torch.Generator().manual_seed(0))
    outputs: dict[str, list] = {"ours": [], "hand-written": []}
    times: dict[str, list[float]] = {"ours": [], "hand-written": []}
    with torch.inference_mode():
        runs = {
            name: blocks(*make(weights, prompt), outputs[name])
            for name, make in (("ours", ours), ("hand-written", hand_written))
        }
        for run in runs.values():  # warm-up: kernels loaded
            next(run)
        for _ in range(BLOCKS):
            for name, run in runs.items():
                times[name].append(next(run))
    a, b = (torch.cat(outputs[n], 1) for n in ("ours", "hand-written"))
    kind = "plain" if PLAIN else f"rotary, {HEADS}/{KV_HEADS} heads"
    kind += ", norms" if NORMS else ""
    kind += ", sinks" if SINKS else ""
    kind += "".join(f", {name} {value}" for name, value in OPTIONS.items())
    medians = {n: statistics.median(t) for n, t in times.items()}
    print(
        f"{BATCH} x {HIDDENS} hiddens, {kind}: us/step ours {medians['ours']:.1f}, "
        f"hand-written {medians['hand-written']:.1f}; speed ours/hand-written "
        f"{medians['hand-written'] / medians['ours']:.2f}x; "
        f"largest difference {(a - b).abs().max().item():.2e}"
    )


if __name__ == "__main__":
    main()

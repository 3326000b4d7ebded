"""Where an eager PyTorch decoding step's time goes, on the CPU.

Three decoders of the bench's generation shape (a batch of 8, 512 hiddens,
8 query heads, a 256-token prompt, then one token per step) take turns of
32 steps in one process: the layer with a cache (its plain-step route,
docs: "Fast paths"), the same operations written inline (the stacked
product, the finiteness sum, the rows copied in place, SDPA over the filled
positions, the output product), and the bench's hand-written decoder (four
products, slice assignment). Each step is cut into sections, timed with
``time.perf_counter_ns`` (the layer's by wrapping the functions it calls,
which adds well under a microsecond each: its products and SDPA; its sum and
its write, inline in its step function, are not timed apart); the medians are
printed in microseconds (docs: "Results").

``tiny``: a layer of 16 hiddens and 2 heads on one example and one thread,
whose kernels cost next to nothing, so that a step's time is its Python.
``evict``: a copy of 32 MB before every step, which leaves the CPU's caches
holding what a large step's kernels leave them holding (little of the
step's own code and objects), so that the tiny layer's Python is timed as
it runs between the bench's kernels.

    python tools/torch_step.py [num_kv_heads] [rounds] [tiny] [evict]   # 8 40
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import torch
from torch.nn import functional

from mha_multi.torch import MultiHeadAttention, set_weights
from mha_multi.weights import init_weights

BATCH, HIDDENS, HEADS, PROMPT, MAX_LENGTH = 8, 512, 8, 256, 512
if "tiny" in sys.argv[1:]:
    BATCH, HIDDENS, HEADS, PROMPT, MAX_LENGTH = 1, 16, 2, 4, 1028
    torch.set_num_threads(1)
HEAD_DIM = HIDDENS // HEADS
TURN = 32
#: What ``evict`` copies before every step (docs above).
EVICTED = (torch.randn(4_000_000), torch.empty(4_000_000)) if "evict" in sys.argv[1:] else None


def evict() -> None:
    if EVICTED is not None:
        EVICTED[1].copy_(EVICTED[0])


#: SDPA and the product as the inline decoders call them: the layer's calls
#: go through the module attributes, which :func:`layer_steps` wraps to time
#: them.
ATTENTION = functional.scaled_dot_product_attention
LINEAR = functional.linear

Times = dict[str, list[int]]
#: The key of a layer's times while one of its steps runs.
STEPPING = "stepping"


def timed(times: Times, name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    """``function``, its time added to ``times[name]`` while ``times`` has a ``"step"``
    being timed (:func:`layer_steps`: the prompt's calls are not)."""

    def run(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter_ns()
        result = function(*args, **kwargs)
        if STEPPING in times:
            times.setdefault(name, []).append(time.perf_counter_ns() - start)
        return result

    return run


def layer_steps(weights: dict[str, Any], kv_heads: int, times: Times) -> Iterator[None]:
    layer = MultiHeadAttention(HIDDENS, HEADS, num_kv_heads=kv_heads).eval()
    set_weights(layer, weights)
    prompt = torch.randn(BATCH, PROMPT, HIDDENS, generator=torch.Generator().manual_seed(0))
    products = {name: timed(times, name, LINEAR) for name in ("project", "output")}

    def linear(x: torch.Tensor, weight: torch.Tensor, bias: Any = None) -> torch.Tensor:
        # The output projection's weight is square; the stacked input projections' is not.
        name = "output" if weight.shape[0] == HIDDENS else "project"
        return products[name](x, weight, bias)

    with (
        mock.patch.object(
            functional, "scaled_dot_product_attention", timed(times, "sdpa", ATTENTION)
        ),
        mock.patch.object(functional, "linear", linear),
    ):
        while True:
            with torch.inference_mode():
                cache = layer.init_cache(BATCH, MAX_LENGTH)
                output, cache = layer(prompt, prompt, prompt, causal=True, cache=cache)
            token = output[:, -1:]
            for _ in range(MAX_LENGTH - PROMPT):
                evict()
                with torch.inference_mode():
                    times[STEPPING] = []
                    start = time.perf_counter_ns()
                    token, cache = layer(token, token, token, causal=True, cache=cache)
                    times.setdefault("step", []).append(time.perf_counter_ns() - start)
                    del times[STEPPING]
                yield


def inline_steps(
    weights: dict[str, Any], kv_heads: int, times: Times, *, stacked: bool
) -> Iterator[None]:
    w = {n: torch.tensor(weights[f"W_{n}"].T.copy()) for n in "qkvo"}
    stack = torch.cat([w["q"], w["k"], w["v"]])
    prompt = torch.randn(BATCH, PROMPT, HIDDENS, generator=torch.Generator().manual_seed(0))
    widths = [HIDDENS, kv_heads * HEAD_DIM, kv_heads * HEAD_DIM]
    grouped = {"enable_gqa": True} if kv_heads != HEADS else {}

    def mark(name: str, start: int) -> int:
        now = time.perf_counter_ns()
        times.setdefault(name, []).append(now - start)
        return now

    while True:
        shape = (BATCH, kv_heads, MAX_LENGTH, HEAD_DIM)
        cache = {"k": torch.zeros(shape), "v": torch.zeros(shape)}
        with torch.inference_mode():
            q = LINEAR(prompt, w["q"]).unflatten(-1, (HEADS, HEAD_DIM)).transpose(1, 2)
            for n in "kv":
                new = LINEAR(prompt, w[n]).unflatten(-1, (kv_heads, HEAD_DIM))
                cache[n][:, :, :PROMPT] = new.transpose(1, 2)
            keys, values = cache["k"][:, :, :PROMPT], cache["v"][:, :, :PROMPT]
            context = ATTENTION(q, keys, values, is_causal=True, **grouped)
            token = LINEAR(context.transpose(1, 2).flatten(2), w["o"])[:, -1:]
        for position in range(PROMPT, MAX_LENGTH):
            evict()
            with torch.inference_mode():
                begin = t = time.perf_counter_ns()
                if stacked:
                    projected = LINEAR(token, stack)
                    t = mark("project", t)
                    if not math.isfinite(projected.sum(dtype=torch.float32).item()):
                        raise ValueError("a non-finite projection")
                    q, k, v = projected.split_with_sizes(widths, -1)
                    t = mark("sum", t)
                    for n, new in (("k", k), ("v", v)):
                        cache[n].select(2, position).copy_(new.view(-1, kv_heads, HEAD_DIM))
                    keys, values = (cache[n].narrow(2, 0, position + 1) for n in "kv")
                else:
                    q = LINEAR(token, w["q"])
                    new = {n: LINEAR(token, w[n]) for n in "kv"}
                    t = mark("project", t)
                    for n in "kv":
                        rows = new[n].view(BATCH, 1, kv_heads, HEAD_DIM).transpose(1, 2)
                        cache[n][:, :, position : position + 1] = rows
                    keys, values = (cache[n][:, :, : position + 1] for n in "kv")
                t = mark("write", t)
                heads = q.unflatten(-1, (HEADS, HEAD_DIM)).transpose(1, 2)
                context = ATTENTION(heads, keys, values, **grouped)
                t = mark("sdpa", t)
                token = LINEAR(context.transpose(1, 2).flatten(2), w["o"])
                mark("output", t)
                times.setdefault("step", []).append(time.perf_counter_ns() - begin)
            yield


def main(kv_heads: int = 8, rounds: int = 40) -> None:
    kv_heads = min(kv_heads, HEADS)
    weights = init_weights(HIDDENS, num_heads=HEADS, num_kv_heads=kv_heads, seed=0)
    times: dict[str, Times] = {"layer": {}, "inline": {}, "hand-written": {}}
    decoders = {
        "layer": layer_steps(weights, kv_heads, times["layer"]),
        "inline": inline_steps(weights, kv_heads, times["inline"], stacked=True),
        "hand-written": inline_steps(weights, kv_heads, times["hand-written"], stacked=False),
    }
    for steps in decoders.values():  # the first prompt and a few steps: kernels loaded
        for _ in range(TURN):
            next(steps)
    for held in times.values():
        held.clear()
    for _ in range(rounds):
        for steps in decoders.values():
            for _ in range(TURN):
                next(steps)
    sections = ["project", "sum", "write", "sdpa", "output", "step"]
    shape = f"{BATCH} x {HIDDENS} hiddens, {HEADS} heads, {kv_heads} key/value heads"
    evicted = ", 32 MB copied before each step" if EVICTED is not None else ""
    print(f"{shape}{evicted}: median us of {rounds * TURN} steps each")
    print("| decoder | " + " | ".join(sections) + " |")
    print("|---" * (len(sections) + 1) + "|")
    for name, held in times.items():
        cells = [f"{statistics.median(held[s]) / 1e3:.1f}" if s in held else "-" for s in sections]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(*(int(arg) for arg in sys.argv[1:] if arg.isdigit()))

"""Compiled PyTorch decoding, ours against the hand-written step compiled the same way, on the CPU.

The generation rows' compiled ways at their shape (8 x 512 hiddens, 8 heads,
a prompt of 256; ``llama``: rotary positions and 2 key/value heads): ours
(the layer's cached call) and the hand-written static-cache step, each under
``torch.compile(fullgraph=True, dynamic=False)`` with inductor, both writing
the cache in place (``functional``: the hand-written step updates it with
``index_copy``, a new cache each step, as it did before ours wrote in
place). They take turns of :data:`BLOCK` steps in one process, so a shared
machine's drift falls on both; the ratio of the median times per step is
printed, with the largest difference of their outputs.

``one-thread``: one thread for PyTorch's kernels (on a machine whose cores
are busy, a second thread's wait can cost more than the kernel).

    python tools/compiled_step.py [llama] [functional] [one-thread] [blocks]     # 12 blocks
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import replace

import numpy as np
import torch

from mha_multi.bench.driver import GENERATION, generation_shapes
from mha_multi.bench.torch import FRAMEWORK
from mha_multi.bench.torch_decoders import hand_written_decoder
from mha_multi.torch import get_weights

ARGS = sys.argv[1:]
LAYER = "llama" if "llama" in ARGS else "plain"
BLOCKS = next((int(a) for a in ARGS if a.isdigit()), 12)
if "one-thread" in ARGS:  # (a loaded machine's second thread waits on the other's work)
    torch.set_num_threads(1)
BLOCK = 8


def main() -> None:
    shape = generation_shapes(GENERATION, 2)[LAYER]
    shape = replace(shape, new_tokens=BLOCK * (2 * BLOCKS + 1))
    makers = FRAMEWORK.generators(shape, "cpu", "float32", "compiled")
    if "functional" in ARGS:
        layer = FRAMEWORK.ours(shape.attention_shape(), "cpu", "float32", **shape.layer_options)
        weights = get_weights(layer)
        makers["hand-written"] = lambda: hand_written_decoder(
            weights, shape, "cpu", "float32", "compiled", in_place=False
        )
    rng = np.random.default_rng(0)
    prompt = rng.standard_normal((shape.batch, shape.prompt, shape.num_hiddens), np.float32)
    prompt = FRAMEWORK.array(prompt, "cpu", "float32")
    runs, tokens, outputs = {}, {}, {}
    for name in ("cached", "hand-written"):
        runs[name] = makers[name]()
        tokens[name] = runs[name].prefill(prompt)  # (compiles the prompt's graph)
        outputs[name] = []
    times: dict[str, list[float]] = {name: [] for name in runs}
    for block in range(BLOCKS + 1):
        for name, run in runs.items():
            state, token = tokens[name]
            start = time.perf_counter()
            for _ in range(BLOCK):
                state, token = run.step(state, token)
                outputs[name].append(token)
            run.sync(token)
            if block:  # (the first block compiles the step's graph)
                times[name].append((time.perf_counter() - start) / BLOCK)
            tokens[name] = state, token
    medians = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    if "blocks" in ARGS:
        print({name: [round(t * 1e3, 2) for t in block] for name, block in times.items()})
    ours, anchor = (torch.cat(outputs[n], 1) for n in runs)
    anchor_kind = "functional" if "functional" in ARGS else "in place"
    print(
        f"{LAYER}, compiled, {BLOCKS} blocks of {BLOCK}: ms/step ours {medians['cached']:.2f}, "
        f"hand-written ({anchor_kind}) {medians['hand-written']:.2f}; speed ours/hand-written "
        f"{medians['hand-written'] / medians['cached']:.2f}x; "
        f"largest difference {(ours - anchor).abs().max().item():.2e}"
    )


if __name__ == "__main__":
    main()

"""The long training pass: ours against SDPA's layer, forward and backward, a Llama layer's size.

Causal self-attention of 4 sequences of 4096 tokens, 32 heads of 128 (4096
hiddens), in bfloat16, forward and backward: what a long-context training
step asks of a Llama-sized layer, where the attention kernel's speed is
nearly all of it (docs: "Results"). Ours against the same layer written with
PyTorch's ``scaled_dot_product_attention`` (``nn.Linear`` projections,
SDPA's causal flag), holding the same weights, the two timed in turns
(:func:`~mha_multi.bench.common.medians_in_turns`). The rate is given in
TFLOP/s (:func:`causal_flops`) and as a fraction of the device's dense
bfloat16 peak where its model is known (:data:`BFLOAT16_PEAKS`). A GPU's
row: on a CPU one pass takes minutes (tests time it on a small shape).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from mha_multi.bench.cells import Table, ms, ratio, table
from mha_multi.bench.common import Measurement, Shape, medians_in_turns

__all__ = [
    "BFLOAT16_PEAKS",
    "LONG",
    "MODE",
    "causal_flops",
    "long_table",
    "peak_tflops",
    "time_long",
]

#: The pass's self-attention: a Llama-sized layer on a long context.
LONG = Shape(batch=4, length=4096, num_hiddens=4096, num_heads=32)

#: The rows' mode, apart from the timed rows' (key padding, no causal rule).
MODE = "long forward+backward"

#: Dense bfloat16 TFLOP/s by GPU model, as the vendor gives it (no sparsity): the first
#: key a device's name holds is its figure.
BFLOAT16_PEAKS = {"H200": 989.4, "H100 PCIe": 756.0, "H100": 989.4, "A100": 312.0}


def causal_flops(shape: Shape) -> float:
    """FLOPs of one causal forward pass of ``shape``'s self-attention: the four
    projections, ``2*B*N*(2*d*d + 2*d*d_kv)``, and half of the scores' and weighted
    values' ``4*B*N*N*d`` (the causal rule keeps half the scores, as FlashAttention's
    benchmarks count them). A pass with its backward counts three times as many, as
    the timed rows count (:data:`mha_multi.bench.timing.MODES`)."""
    b, n, d = shape.batch, shape.length, shape.num_hiddens
    kv = d * shape.kv_heads // shape.num_heads
    return float(2 * b * n * (2 * d * d + 2 * d * kv) + 2 * b * n * n * d)


def peak_tflops(description: str) -> float | None:
    """The dense bfloat16 peak of the device ``description`` names
    (:data:`BFLOAT16_PEAKS`), or ``None`` where its model is not known."""
    for model, peak in BFLOAT16_PEAKS.items():
        if model in description:
            return peak
    return None


def time_long(
    framework: Any, device: str, dtype: str = "bfloat16", shape: Shape = LONG
) -> list[Measurement]:
    """The long pass of ours and of SDPA's layer (``framework.long_pair``), or no rows
    where the framework has no such pair.

    Each row's ``seconds`` is its median pass, forward and backward (the
    input's gradient included), ``gflops`` its rate (:func:`causal_flops`);
    its note gives the rate in TFLOP/s, its fraction of the device's peak and
    the largest difference between the two layers' outputs.
    """
    pair = framework.long_pair(shape, device, dtype)
    if pair is None:
        return []
    rng = np.random.default_rng(0)
    x = framework.array(
        rng.standard_normal((shape.batch, shape.length, shape.num_hiddens), dtype=np.float32),
        device,
        dtype,
    )
    outputs = {name: framework.backend.to_numpy(call(x)) for name, (_, call) in pair.items()}
    first, *others = outputs.values()
    difference = max(float(np.abs(first - other).max()) for other in others)
    passes = {}
    for name, implementation in pair.items():
        step = framework.step(implementation, (x,), "forward+backward", None)
        passes[name] = lambda step=step: framework.sync(step())
    medians = medians_in_turns(passes, warmup=1, repeats=5)
    label = framework.label(None)
    peak = peak_tflops(framework.describe(device, None))
    flops = 3 * causal_flops(shape)
    rows = []
    for name, seconds in medians.items():
        tflops = flops / seconds / 1e12
        share = "" if peak is None else f", {100 * tflops / peak:.0f}% of {peak:g} TFLOP/s"
        row = Measurement(label, name, MODE, device, dtype, shape.length, shape=vars(shape))
        rows.append(
            replace(
                row,
                seconds=seconds,
                gflops=flops / seconds / 1e9,
                note=f"{tflops:.3g} TFLOP/s{share}; max |ours - SDPA| {difference:.1e}",
            )
        )
    return rows


def long_table(measurements: Sequence[dict]) -> Table:
    """The long pass of ours against SDPA's layer, per backend, dtype and length
    (:func:`time_long`'s rows, of one device): milliseconds, ours / SDPA in speed
    (above 1 where ours is faster), and ours' rate and share of the peak."""
    passes = [m for m in measurements if m["mode"] == MODE]
    rows, shown = [], []
    for key in sorted({(m["backend"], m["dtype"], m["length"]) for m in passes}):
        pair = {
            m["implementation"]: m for m in passes if (m["backend"], m["dtype"], m["length"]) == key
        }
        ours, sdpa = pair.get("ours", {}), pair.get("SDPA", {})
        shape = ours.get("shape") or sdpa.get("shape") or {}
        heads = shape.get("num_heads", 0)
        head_dim = shape.get("num_hiddens", 0) // max(heads, 1)
        size = f"{shape.get('batch', '?')} x {key[2]}, {heads} heads of {head_dim}"
        rows.append(
            (
                key[0],
                key[1],
                size,
                ms(ours.get("seconds")),
                ms(sdpa.get("seconds")),
                ratio(sdpa.get("seconds"), ours.get("seconds")),
                ours.get("note", "-").split(";")[0] or "-",
            )
        )
        shown += pair.values()
    columns = ("backend", "dtype", "B x N, heads", "ours (ms)", "SDPA (ms)", "ours / SDPA", "ours")
    return table(columns, rows, shown)

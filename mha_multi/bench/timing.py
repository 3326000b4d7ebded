"""The timed rows: the GEMM rate, every implementation in every mode, pruned and sharded layers.

Implementations of one row are timed in turns
(:func:`~mha_multi.bench.common.medians_in_turns`); a configuration whose
attention arrays would not fit under
:data:`~mha_multi.bench.common.LIMIT_BYTES` is recorded with a note instead.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from mha_multi.bench.common import (
    ITEMSIZE,
    LIMIT_BYTES,
    Measurement,
    Shape,
    attention_flops,
    inputs,
    kv_bytes,
    median_seconds,
    medians_in_turns,
)
from mha_multi.bench.framework import Framework
from mha_multi.heads import prune_heads
from mha_multi.weights import init_weights

__all__ = ["GEMM_SIZE", "MODES", "gemm_rate", "time_layers", "time_pruned", "time_sharded"]

#: Mode -> its FLOPs as a multiple of one forward pass (the backward pass
#: costs about two forward passes).
MODES = {"forward": 1, "forward+backward": 3}
GEMM_SIZE = 2048


def gemm_rate(framework: Framework, device: str, dtype: str) -> float:
    """Measured GFLOP/s of a square matrix product."""
    rng = np.random.default_rng(1)
    a, b = (
        framework.array(rng.standard_normal((GEMM_SIZE,) * 2, dtype=np.float32), device, dtype)
        for _ in range(2)
    )
    seconds = median_seconds(lambda: framework.sync(framework.matmul(a, b)))
    return 2 * GEMM_SIZE**3 / seconds / 1e9


def time_layers(
    framework: Framework,
    device: str,
    dtype: str,
    lengths: Sequence[int],
    base: Shape,
    measurements: dict[str | None, list[Measurement]],
) -> None:
    """Appends the timings of every implementation to its execution's list."""
    for length in lengths:
        shape = replace(base, length=length)
        note = ""
        if shape.kv_heads != shape.num_heads:
            saved = kv_bytes(replace(shape, num_kv_heads=None), ITEMSIZE[dtype])
            note = (
                f"K/V of {shape.kv_heads} of {shape.num_heads} heads at N={length}, "
                f"{dtype}: {kv_bytes(shape, ITEMSIZE[dtype]) / 2**20:.1f} MiB instead of "
                f"{saved / 2**20:.1f} MiB"
            )
        args = framework.convert(*inputs(shape), device, dtype)
        implementations = framework.build(shape, device, dtype)
        for execution in framework.executions:
            for mode in MODES:
                label = framework.label(execution)
                rows = {
                    name: Measurement(
                        label, name, mode, device, dtype, length, shape=vars(shape), note=note
                    )
                    for name in implementations
                }
                measurements[execution] += _timings(
                    framework, implementations, args, execution, shape, rows
                )
        gc.collect()


def _timings(
    framework: Framework,
    implementations: dict[str, Any],
    args: Any,
    execution: str | None,
    shape: Shape,
    rows: dict[str, Measurement],
) -> list[Measurement]:
    """``rows`` with the median time of their pass, timed in turns, or a note on why
    there is none (:func:`~mha_multi.bench.common.medians_in_turns`)."""
    done: dict[str, Measurement] = {}
    steps: dict[str, Callable[[], object]] = {}
    for name, row in rows.items():
        needed = framework.scratch_bytes(
            name, shape, row.dtype, row.device, training=MODES[row.mode] > 1
        )
        if needed > LIMIT_BYTES:
            done[name] = replace(row, note=f"too large (~{needed / 2**30:.0f} GiB)")
            continue
        try:
            step = framework.step(implementations[name], args, row.mode, execution)
            framework.sync(step())  # loads kernels, compiles
        except Exception as error:  # e.g. a compiler that cannot take the layer
            print(f"[bench] {row.backend} {name} {row.mode}: {error}", flush=True)
            done[name] = replace(row, note=f"failed: {type(error).__name__}")
            continue
        steps[name] = lambda step=step: framework.sync(step())
    try:
        medians = medians_in_turns(steps, warmup=1)
    except Exception:  # one of them failed after its first call: each alone, then
        medians = {}
        for name, step in steps.items():
            try:
                medians[name] = median_seconds(step, warmup=1)
            except Exception as error:
                print(f"[bench] {rows[name].backend} {name} {rows[name].mode}: {error}", flush=True)
                done[name] = replace(rows[name], note=f"failed: {type(error).__name__}")
    for name, seconds in medians.items():
        gflops = MODES[rows[name].mode] * attention_flops(shape) / seconds / 1e9
        done[name] = replace(rows[name], seconds=seconds, gflops=gflops)
    return [done[name] for name in rows]


def time_pruned(
    framework: Framework, device: str, dtype: str, shape: Shape, kept_heads: Sequence[int]
) -> list[Measurement]:
    """Forward times of ``shape``'s layer pruned to each of ``kept_heads`` heads.

    Each pruned layer is what :func:`mha_multi.heads.prune_heads` makes of the
    full layer's weights (the first heads kept, the others removed), so the
    rows differ only in the heads computed (docs: "Heads").
    """
    h = shape.num_heads
    weights = init_weights(shape.num_hiddens, num_heads=h, num_kv_heads=shape.kv_heads)
    args = framework.convert(*inputs(shape), device, dtype)
    x, lens = args[0], args[1]
    label = framework.label(framework.executions[0])
    rows = []
    for kept in kept_heads:
        pruned = prune_heads(weights, range(kept, h), num_heads=h, num_kv_heads=shape.kv_heads)
        config = pruned.config
        layer = framework.layer(
            pruned.weights, device, dtype, num_heads=config.num_heads, head_dim=config.head_dim
        )
        call = framework.forward_call(layer)
        row = Measurement(
            label,
            f"ours, {kept} of {h} heads",
            "pruned forward",
            device,
            dtype,
            shape.length,
            note=f"pruned from {h} heads" if kept < h else "the full layer",
            shape={**vars(shape), "num_heads": kept, "num_kv_heads": config.num_kv_heads},
        )
        try:
            seconds = median_seconds(lambda: framework.sync(call(x, lens)))  # noqa: B023
        except Exception as error:  # e.g. a compiler that cannot take the layer
            print(f"[bench] {row.implementation}: {error}", flush=True)
            rows.append(replace(row, note=f"failed: {type(error).__name__}"))
            continue
        rows.append(replace(row, seconds=seconds))
        gc.collect()
    return rows


def time_sharded(framework: Framework, shape: Shape) -> list[Measurement]:
    """The sharded-heads rows: on a CPU only the overhead of sharding shows,
    the shards sharing the same cores (docs: "Sharding heads")."""
    label = framework.label(framework.sharded_execution)
    rows = []
    for count in framework.shard_counts:
        row = Measurement(
            label,
            f"ours, heads over {count}",
            "sharded forward",
            "cpu",
            "float32",
            shape.length,
            shape=vars(shape),
            note="unsharded" if count == 1 else f"{count} shards on the same cores",
        )
        try:
            rows.append(replace(row, seconds=framework.sharded_seconds(shape, count)))
        except Exception as error:  # e.g. a platform without the distributed engine
            print(f"[bench] {row.implementation}: {error}", flush=True)
            rows.append(replace(row, note=f"failed: {type(error).__name__}"))
    return rows

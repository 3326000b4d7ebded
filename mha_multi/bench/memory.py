"""Peak memory rows: one float32 forward pass, each figure in a process of its own.

A process's peak resident memory never falls, so each figure is the first
measurement of a fresh ``python -m mha_multi.bench memory`` process.
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import replace

from mha_multi.bench.common import LIMIT_BYTES, Measurement, Shape, inputs
from mha_multi.bench.framework import Framework

__all__ = ["WARMUP_LENGTH", "measure_memory", "peak_memory_mib"]

#: Tokens of the small pass that loads kernels before memory is measured.
WARMUP_LENGTH = 16


def peak_memory_mib(framework: Framework, implementation: str, device: str, shape: Shape) -> float:
    """Peak memory of one float32 forward pass above what its inputs and weights hold.

    Meaningful only as the first measurement of a process: a process's peak
    resident memory never falls.
    """
    framework.setup()
    impl = framework.build(shape, device, "float32")[implementation]
    args = framework.convert(*inputs(shape), device, "float32")
    warmup = framework.convert(*inputs(replace(shape, length=WARMUP_LENGTH)), device, "float32")
    step = framework.memory_step(impl, args, warmup)
    gc.collect()
    return framework.peak_mib(device, lambda: framework.sync(step()))


def measure_memory(
    framework: Framework, device: str, lengths: Sequence[int], base: Shape
) -> list[Measurement]:
    """Each figure from ``python -m mha_multi.bench memory`` in a fresh process."""
    label = framework.label(framework.executions[0])
    measurements = []
    for length in lengths:
        shape = replace(base, length=length)
        for name in framework.implementations:
            row = Measurement(
                label, name, "peak memory", device, "float32", length, shape=vars(shape)
            )
            estimate = framework.scratch_bytes(name, shape, "float32", device, training=False)
            if estimate > LIMIT_BYTES:
                measurements.append(replace(row, note=f"skipped (~{estimate / 2**30:.0f} GiB)"))
                continue
            command = [sys.executable, "-m", "mha_multi.bench", "memory", framework.name, name]
            command += [device, json.dumps(vars(shape))]
            output = subprocess.run(command, capture_output=True, text=True, check=True).stdout
            # The last word: frameworks may print to stdout while loading.
            measurements.append(replace(row, peak_mib=float(output.split()[-1])))
    return measurements

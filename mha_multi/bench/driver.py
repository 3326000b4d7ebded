"""The whole benchmark of one framework: every kind of row on every device and dtype.

For every device and dtype a framework offers, :func:`run` measures the GEMM
rate, then times each implementation (ours, its variants, the framework's own
layer) in every execution mode the framework has, forward in evaluation mode
and forward+backward, on self-attention with key padding
(:mod:`~mha_multi.bench.timing`); then generation
(:mod:`~mha_multi.bench.generate`) and the packed row
(:mod:`~mha_multi.bench.packed`); on a GPU the long training pass
(:mod:`~mha_multi.bench.long`); on the CPU the host rows and the Python
calls of a call (:mod:`~mha_multi.bench.host`); and peak memory of one float32 forward
pass last, each figure in a process of its own (:mod:`~mha_multi.bench.memory`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from mha_multi.bench.common import ITEMSIZE, Measurement, Shape
from mha_multi.bench.framework import Framework
from mha_multi.bench.generate import GenerationShape, run_generation
from mha_multi.bench.host import count_calls, time_host
from mha_multi.bench.long import LONG, time_long
from mha_multi.bench.memory import measure_memory
from mha_multi.bench.packed import time_packed
from mha_multi.bench.timing import GEMM_SIZE, gemm_rate, time_layers, time_pruned, time_sharded

__all__ = ["GENERATION", "LLAMA_ROTARY", "generation_shapes", "run"]

#: What the generation rows generate: 256 tokens after a 256-token prompt.
GENERATION = GenerationShape()
#: The rotary positions of the Llama-shaped generation rows: Llama's base,
#: half-split pairs, the layer's default positions.
LLAMA_ROTARY = {"theta": 10000.0}


def generation_shapes(generation: GenerationShape, num_kv_heads: int) -> dict[str, GenerationShape]:
    """The generation rows' layers: ``"plain"`` (``generation``'s heads), ``"grouped"``
    (``num_kv_heads`` key/value heads) and ``"llama"`` (grouped, with rotary positions:
    a Llama-shaped layer)."""
    grouped = replace(generation, num_kv_heads=num_kv_heads, rotary=None)
    return {
        "plain": replace(generation, num_kv_heads=None, rotary=None),
        "grouped": grouped,
        "llama": replace(grouped, rotary=LLAMA_ROTARY),
    }


def run(
    framework: Framework,
    *,
    lengths: Sequence[int] = (128, 512, 2048),
    memory_lengths: Sequence[int] = (1024, 2048, 4096, 8192),
    base: Shape | None = None,
    grouped_lengths: Sequence[int] = (512,),
    num_kv_heads: int = 2,
    generation: GenerationShape | None = GENERATION,
    pruned_lengths: Sequence[int] = (512,),
    kept_heads: Sequence[int] = (8, 4, 2, 1),
    sharded_lengths: Sequence[int] = (256,),
    small_lengths: Sequence[int] = (1, 16),
    devices: Sequence[str] | None = None,
    generation_ways: Sequence[str] | None = None,
    generation_layers: Sequence[str] | None = None,
    generation_executions: Sequence[str] | None = None,
    host_blocks: int = 40,
    calls: bool = True,
    packed_sequences: int = 32,
    packed_length: int = 512,
    long: Shape | None = LONG,
    long_on_cpu: bool = False,
) -> list[dict[str, object]]:
    """The whole benchmark of ``framework``.

    Args:
        framework: what to benchmark.
        lengths: sequence lengths ``N`` to time.
        memory_lengths: sequence lengths whose peak memory to measure.
        base: batch, width and heads (its length is replaced).
        grouped_lengths: sequence lengths timed again with ``num_kv_heads``
            key/value heads (grouped-query attention: ours and the
            framework's grouped kernel or layer).
        num_kv_heads: the key/value heads of those rows.
        generation: what :mod:`mha_multi.bench.generate` generates, with
            ``num_heads`` key/value heads, again with ``num_kv_heads``, and
            with ``num_kv_heads`` and rotary positions
            (:func:`generation_shapes`); ``None`` for no generation rows.
        pruned_lengths: sequence lengths at which ``base``'s layer is timed
            pruned to each of ``kept_heads`` heads (forward only).
        kept_heads: the heads each pruned layer keeps, ``base.num_heads``
            being the full layer.
        sharded_lengths: sequence lengths at which ``base``'s layer is timed
            with its heads sharded over each of the framework's
            ``shard_counts`` CPU devices or processes (CPU, float32, forward).
        small_lengths: sequence lengths of one example (``base`` with batch
            1), where a call's fixed cost shows: the one-token call of a
            decoder, a short sequence.
        devices: the devices to benchmark on, of those the framework has
            (``"cpu"``, ``"gpu"``); ``None`` for all of them.
        generation_ways: the ways of generating to time (``"cached"``,
            ``"recompute"``, ``"hand-written"``, ``"native"``); ``None`` for
            every one the framework has.
        generation_layers: the layers to generate with, of ``"plain"``,
            ``"grouped"`` and ``"llama"`` (:func:`generation_shapes`); ``None``
            for all three.
        generation_executions: the ways of executing the generation rows, named
            as the framework's ``generation_executions`` (``"compiled"``, ``"eager"``,
            ``"imperative"``; ``"default"`` for its first execution, where that is
            ``None``), ``None`` for every one: a compiled row alone, where the eager
            one takes long.
        host_blocks: the blocks of calls each host row's time is the median
            of (:func:`~mha_multi.bench.host.time_host`; CPU, frameworks with
            a hand-written one-token call); 0 for no host rows.
        calls: whether to count the Python calls of a call
            (:func:`~mha_multi.bench.host.count_calls`, CPU).
        packed_sequences: the sequences of the packed row
            (:func:`~mha_multi.bench.packed.time_packed`: long-tailed lengths up
            to ``packed_length``, packed against padded); 0 for no packed row.
        packed_length: the longest sequence of the packed row, and its rows' length.
        long: the shape of the long training pass (:mod:`~mha_multi.bench.long`:
            bfloat16, causal, forward and backward, ours against the framework's
            own kernel in a layer), on a GPU; ``None`` for no such row.
        long_on_cpu: that row on the CPU too (a small ``long`` shape: a smoke run).

    Returns:
        One result per device and execution mode: ``backend``, ``device``,
        ``versions`` and ``measurements`` (:class:`Measurement` as dicts), the
        form :func:`~mha_multi.bench.tables.format_markdown` reads.
    """
    base = base or Shape()
    framework.setup()
    results = []
    for device in framework.devices():
        if devices is not None and device not in devices:
            continue
        executions = (*framework.executions, *(framework.generation_executions or ()))
        measurements: dict[str | None, list[Measurement]] = {e: [] for e in executions}
        for dtype in framework.dtypes(device):
            rate = gemm_rate(framework, device, dtype)
            note = f"{GEMM_SIZE}x{GEMM_SIZE} {dtype}"
            note += f", {framework.gemm_op}" if framework.gemm_op else ""
            for execution, rows in measurements.items():
                label = framework.label(execution)
                rows.append(
                    Measurement(
                        label, "gemm", "gemm", device, dtype, GEMM_SIZE, gflops=rate, note=note
                    )
                )
            time_layers(framework, device, dtype, lengths, base, measurements)
            one = replace(base, batch=1)
            time_layers(framework, device, dtype, small_lengths, one, measurements)
            grouped = replace(base, num_kv_heads=num_kv_heads)
            time_layers(framework, device, dtype, grouped_lengths, grouped, measurements)
            for length in pruned_lengths:
                shape = replace(base, length=length)
                kept = [k for k in kept_heads if k <= base.num_heads]
                measurements[framework.executions[0]] += time_pruned(
                    framework, device, dtype, shape, kept
                )
            if packed_sequences:
                measurements[framework.executions[0]] += time_packed(
                    framework,
                    device,
                    dtype,
                    count=packed_sequences,
                    base=replace(base, length=packed_length),
                )
            if generation is not None:
                executions = framework.generation_executions or framework.executions[:1]
                if generation_executions is not None:
                    executions = _chosen(framework, executions, generation_executions)
                layers = generation_shapes(generation, num_kv_heads)
                for name, shape in layers.items():
                    if generation_layers is not None and name not in generation_layers:
                        continue
                    for execution in executions:
                        measurements[execution] += run_generation(
                            framework,
                            device,
                            dtype,
                            shape,
                            ITEMSIZE[dtype],
                            execution=execution,
                            ways=generation_ways,
                        )
        first = measurements[framework.executions[0]]
        if long is not None and (device == "gpu" or long_on_cpu):
            first += time_long(framework, device, "bfloat16", long)
        if device == "cpu" and host_blocks and framework.hand_written_call is not None:
            first += time_host(framework, device, blocks=host_blocks)
        if device == "cpu" and calls:
            first += count_calls(framework, device)
        if device == "cpu":
            for length in sharded_lengths:
                shape = replace(base, length=length)
                measurements[framework.sharded_execution] += time_sharded(framework, shape)
        if framework.measures_memory(device):
            memory = measure_memory(framework, device, memory_lengths, base)
            measurements[framework.executions[0]] += memory
        results += [
            {
                "backend": framework.label(execution),
                "device": framework.describe(device, execution),
                "versions": framework.versions(),
                "measurements": [m.as_dict() for m in rows],
            }
            for execution, rows in measurements.items()
            if rows or execution in framework.executions
        ]
    return results


def _chosen(
    framework: Framework, executions: Sequence[str | None], names: Sequence[str]
) -> list[str | None]:
    """Those of ``executions`` (the generation rows') that ``names`` name (``None`` as
    ``"default"``); raises ``ValueError`` for a name the framework has not."""
    named = {e or "default": e for e in executions}
    if not set(names) <= set(named):
        raise ValueError(
            f"generation_executions: {sorted(names)}, expected some of {sorted(named)}"
            f" ({framework.label(None)}'s)"
        )
    return [named[name] for name in named if name in names]

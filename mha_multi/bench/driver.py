"""The benchmark, written once: what each framework adds is a :class:`Framework`.

For every device and dtype a framework offers, the driver measures the GEMM
rate, then times each implementation (ours, its variants, the framework's own
layer) in every execution mode the framework has, forward in evaluation mode
and forward+backward, on self-attention with key padding. Peak memory of one
float32 forward pass is measured last, each figure in a process of its own.
Configurations whose attention scores would not fit under
:data:`LIMIT_BYTES` are recorded with a note instead of run.
"""

from __future__ import annotations

import functools
import gc
import importlib
import json
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from mha_multi.bench import BENCHMARKS
from mha_multi.bench.common import (
    Measurement,
    Shape,
    attention_flops,
    kv_bytes,
    median_seconds,
    medians_in_turns,
    peak_rss_mib,
    reset_peak_rss,
)
from mha_multi.bench.generate import GenerationShape, Generator, run_generation
from mha_multi.heads import prune_heads
from mha_multi.weights import init_weights

__all__ = [
    "LIMIT_BYTES",
    "MODES",
    "Framework",
    "inputs",
    "key_lengths",
    "load",
    "peak_memory_mib",
    "run",
    "score_bytes",
]

#: Past this estimate of what one pass holds at once, a configuration is not
#: run: the machines the benchmark runs on are shared.
LIMIT_BYTES = 4 << 30
#: Mode -> its FLOPs as a multiple of one forward pass (the backward pass
#: costs about two forward passes).
MODES = {"forward": 1, "forward+backward": 3}
GEMM_SIZE = 2048
#: Tokens of the small pass that loads kernels before memory is measured.
WARMUP_LENGTH = 16
#: What the generation rows generate: 256 tokens after a 256-token prompt.
GENERATION = GenerationShape()
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


def key_lengths(shape: Shape) -> np.ndarray:
    """Key padding: example ``b`` keeps ``N - b*N/(2B)`` tokens, from all to about half."""
    n, batch = shape.length, shape.batch
    return np.array([n - b * n // (2 * batch) for b in range(batch)], dtype=np.int64)


def inputs(shape: Shape) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The benchmark's input, in numpy.

    Returns:
        ``x`` ``(B, N, D)`` float32, the key lengths ``(B,)`` and the boolean
        ``(B, N)`` mask that is ``True`` where a key is visible.
    """
    x = np.random.default_rng(0).standard_normal(
        (shape.batch, shape.length, shape.num_hiddens), dtype=np.float32
    )
    lens = key_lengths(shape)
    visible = np.arange(shape.length)[None, :] < lens[:, None]
    return x, lens, visible


def score_bytes(shape: Shape, arrays: int, dtype: str = "float32") -> int:
    """Bytes of ``arrays`` arrays of ``(B*H, N, N)`` attention scores in ``dtype``."""
    return arrays * shape.batch * shape.num_heads * shape.length**2 * ITEMSIZE[dtype]


class Framework:
    """What one framework's benchmark supplies; the rest is :func:`run`.

    ``Impl`` and ``Args`` below are whatever the framework chooses: the driver
    only hands them back. Devices and dtypes are names (``"cpu"``,
    ``"float32"``); the framework maps them to its own objects.

    Attributes:
        name: the benchmark's name, as ``python -m mha_multi.bench run`` takes it.
        implementations: names of what :meth:`build` returns: ``"ours"``,
            ``"native"`` (the framework's own layer) and variants of ours.
        executions: execution modes, each reported as a table of its own;
            ``None`` alone for a framework with one.
        fast_dtype: the 16-bit dtype timed on accelerators besides float32.
        gemm_op: what the GEMM rate is measured with, when worth saying.
    """

    name: str
    #: The backend package, whose ``set_weights`` loads canonical weights.
    package: str = ""
    #: The framework's facts module (``mha_multi.<framework>._backend``):
    #: settings, devices, conversions and sync come from it by default.
    backend: Any = None
    implementations: tuple[str, ...] = ("ours", "ours (generic)", "native")
    executions: tuple[str | None, ...] = (None,)
    fast_dtype: str = "bfloat16"
    gemm_op: str = ""

    def setup(self) -> None:
        """Process-wide settings, before anything is built: exact float32 products."""
        self.backend.exact_float32()

    def devices(self) -> list[str]:
        """The devices to benchmark on, ``"cpu"`` first."""
        return ["cpu", "gpu"] if self.backend.gpu_available() else ["cpu"]

    def describe(self, device: str, execution: str | None) -> str:
        """The device (and execution mode) as the report names it."""
        return self.backend.device_description(device)

    def versions(self) -> dict[str, str]:
        """Package name -> version, for the report."""
        raise NotImplementedError

    def dtypes(self, device: str) -> list[str]:
        """The dtypes timed on ``device``.

        On a CPU only float32 is meaningful; on an accelerator, the 16-bit
        type is what runs fast.
        """
        return ["float32"] if device == "cpu" else ["float32", self.fast_dtype]

    def array(self, value: np.ndarray, device: str, dtype: str) -> Any:
        """``value`` as the framework's array on ``device`` in ``dtype``."""
        return self.backend.to_native(value, device, dtype)

    def matmul(self, a: Any, b: Any) -> Any:
        """The framework's matrix product (compiled where that is the norm)."""
        raise NotImplementedError

    def convert(
        self, x: np.ndarray, lens: np.ndarray, visible: np.ndarray, device: str, dtype: str
    ) -> Any:
        """The arguments :meth:`step` passes to the layers, from :func:`inputs`."""
        raise NotImplementedError

    def build(self, shape: Shape, device: str, dtype: str) -> dict[str, Any]:
        """Implementation name -> our layer or the native one, set up to call on
        :meth:`convert`'s arguments, in evaluation mode."""
        raise NotImplementedError

    def step(self, impl: Any, args: Any, mode: str, execution: str | None) -> Callable[[], Any]:
        """One pass of ``mode`` (a key of :data:`MODES`) as a function of nothing.

        forward+backward computes the gradients of the summed output with
        respect to the input and the weights. What the step returns is given
        to :meth:`sync`.
        """
        raise NotImplementedError

    def sync(self, value: Any) -> None:
        """Blocks until ``value`` (a step's result) is computed."""
        self.backend.sync(value)

    def scratch_bytes(
        self, implementation: str, shape: Shape, dtype: str, device: str, *, training: bool
    ) -> int:
        """Estimate of the attention arrays one pass holds at once (0: none of
        ``(B*H, N, N)`` size); past :data:`LIMIT_BYTES` the pass is not run."""
        raise NotImplementedError

    def measures_memory(self, device: str) -> bool:
        """Whether peak memory can be measured on ``device``."""
        return True

    def memory_step(self, impl: Any, args: Any, warmup: Any) -> Callable[[], Any]:
        """A forward step on ``args`` with what it loads on first use (kernels,
        thread pools, compiled programs) loaded, without running at full size.

        The default runs one forward pass on the small ``warmup`` arguments.
        """
        execution = self.executions[0]
        self.sync(self.step(impl, warmup, "forward", execution)())
        return self.step(impl, args, "forward", execution)

    def peak_mib(self, device: str, run: Callable[[], None]) -> float:
        """Peak memory that ``run`` adds, in MiB; the default reads resident memory."""
        reset_peak_rss()
        before = peak_rss_mib()
        run()
        return peak_rss_mib() - before

    def label(self, execution: str | None) -> str:
        """The result's backend name for ``execution``."""
        return self.name if execution is None else f"{self.name} ({execution})"

    # -- generation (mha_multi.bench.generate) ------------------------------

    #: The framework's twenty-line static-cache decoder,
    #: ``hand_written(weights, shape, device, dtype) -> Generator`` (a
    #: ``staticmethod``), timed as the ``hand-written`` generation row; in
    #: an execution mode other than the first it is also given
    #: ``execution=`` (the mode its decoder is to be written for).
    hand_written: Callable[..., Generator] | None = None
    #: The execution modes generation is timed in, each in its own table:
    #: the first of :attr:`executions` unless a framework compiles its decoding.
    generation_executions: tuple[str | None, ...] | None = None

    def append(self, sequence: Any, token: Any) -> Any:
        """``sequence`` ``(B, N, D)`` with ``token`` ``(B, 1, D)`` appended on axis 1."""
        raise NotImplementedError

    def ours(self, shape: Shape, device: str, dtype: str) -> Any:
        """Our layer of ``shape``'s self-attention, holding seeded canonical weights."""
        d = shape.num_hiddens
        weights = init_weights(d, num_heads=shape.num_heads, num_kv_heads=shape.kv_heads)
        return self.layer(weights, device, dtype, num_heads=shape.num_heads)

    def layer(
        self,
        weights: Mapping[str, np.ndarray],
        device: str,
        dtype: str,
        *,
        num_heads: int,
        head_dim: int | None = None,
    ) -> Any:
        """Our layer holding ``weights``, its configuration read from them."""
        num_kv_heads = weights["W_k"].shape[1] * num_heads // weights["W_q"].shape[1]
        layer = self.backend.make_layer(
            weights["W_o"].shape[1],
            num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            query_size=weights["W_q"].shape[0],
            key_size=weights["W_k"].shape[0],
            value_size=weights["W_v"].shape[0],
            bias="b_q" in weights,
            device=device,
            dtype=dtype,
        )
        return importlib.import_module(self.package).set_weights(layer, weights)

    #: Shard counts of the sharded-heads rows (docs: "Sharding heads"), 1
    #: being the unsharded layer; empty where the framework shards nothing.
    shard_counts: tuple[int, ...] = ()
    #: The execution mode :meth:`sharded_seconds` measures (its table).
    sharded_execution: str | None = None

    def sharded_seconds(self, shape: Shape, num_shards: int) -> float:
        """Median seconds of one float32 CPU forward of ``shape``'s self-attention,
        the heads sharded over ``num_shards`` CPU devices or processes, each
        measured in fresh processes."""
        raise NotImplementedError

    def forward_call(self, layer: Any) -> Callable[[Any, Any], Any]:
        """``call(x, valid_lens) -> output``: self-attention in evaluation mode,
        compiled where that is the framework's norm."""
        return lambda x, lens: self.backend.forward(layer, x, x, x, lens)

    def cached_call(self, layer: Any, execution: str | None = None) -> Callable[..., Any]:
        """``call(x, cache) -> (output, cache)``: one causal self-attention call
        with a cache, in ``execution`` (compiled where that is its norm)."""
        return lambda x, cache: self.backend.forward(layer, x, x, x, None, causal=True, cache=cache)

    def causal_call(self, layer: Any) -> Callable[[Any], Any]:
        """``call(x) -> output``: the causal forward over all of ``x``, no cache."""
        return lambda x: self.backend.forward(layer, x, x, x, None, causal=True)

    def generators(
        self, shape: GenerationShape, device: str, dtype: str, execution: str | None = None
    ) -> dict[str, Callable[[], Generator]]:
        """Name -> a function making a fresh :class:`Generator` (a new cache each time).

        The default drives ours through :meth:`cached_call` and
        :meth:`causal_call`, and adds :attr:`hand_written` where there is one;
        a framework with a cached decoder of its own adds it as ``"native"``.
        In a compiled ``execution`` other than the first, the recomputing
        decoder is left out: its input grows at every step, so every step
        would compile anew.
        """
        layer = self.ours(shape.attention_shape(), device, dtype)
        cached, causal = self.cached_call(layer, execution), self.causal_call(layer)

        def with_cache() -> Generator:
            def prefill(prompt: Any) -> tuple[Any, Any]:
                cache = self.backend.init_cache(layer, shape.batch, shape.max_length)
                output, cache = cached(prompt, cache)
                return cache, output[:, -1:]

            def step(cache: Any, token: Any) -> tuple[Any, Any]:
                output, cache = cached(token, cache)
                return cache, output

            return Generator(prefill, step, self.sync, self.backend.to_numpy)

        def recompute() -> Generator:
            def prefill(prompt: Any) -> tuple[Any, Any]:
                return prompt, causal(prompt)[:, -1:]

            def step(sequence: Any, token: Any) -> tuple[Any, Any]:
                sequence = self.append(sequence, token)
                return sequence, causal(sequence)[:, -1:]

            return Generator(prefill, step, self.sync, self.backend.to_numpy)

        generators = {"cached": with_cache}
        if execution == self.executions[0]:
            generators["recompute"] = recompute
        if self.hand_written is not None:
            weights = importlib.import_module(self.package).get_weights(layer)
            hand_written = self.hand_written
            if execution != self.executions[0]:
                hand_written = functools.partial(hand_written, execution=execution)
            generators["hand-written"] = lambda: hand_written(weights, shape, device, dtype)
        return generators


def load(name: str) -> Framework:
    """The framework benchmarked as ``name`` (a key of ``BENCHMARKS``).

    Raises:
        SystemExit: the module benchmarks another name, as a Keras module
            does in a process whose ``KERAS_BACKEND`` is another backend.
    """
    framework: Framework = importlib.import_module(BENCHMARKS[name]).FRAMEWORK
    if framework.name != name:
        raise SystemExit(f"[bench] {name} asked for, but this process benchmarks {framework.name}")
    return framework


def _gemm_rate(framework: Framework, device: str, dtype: str) -> float:
    """Measured GFLOP/s of a square matrix product."""
    rng = np.random.default_rng(1)
    a, b = (
        framework.array(rng.standard_normal((GEMM_SIZE,) * 2, dtype=np.float32), device, dtype)
        for _ in range(2)
    )
    seconds = median_seconds(lambda: framework.sync(framework.matmul(a, b)))
    return 2 * GEMM_SIZE**3 / seconds / 1e9


def _time_layers(
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


def _time_pruned(
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


def _time_sharded(framework: Framework, shape: Shape) -> list[Measurement]:
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


def _measure_memory(
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
            ``num_heads`` key/value heads and again with ``num_kv_heads``;
            ``None`` for no generation rows.
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

    Returns:
        One result per device and execution mode: ``backend``, ``device``,
        ``versions`` and ``measurements`` (:class:`Measurement` as dicts), the
        form :func:`~mha_multi.bench.common.format_markdown` reads.
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
            rate = _gemm_rate(framework, device, dtype)
            note = f"{GEMM_SIZE}x{GEMM_SIZE} {dtype}"
            note += f", {framework.gemm_op}" if framework.gemm_op else ""
            for execution, rows in measurements.items():
                label = framework.label(execution)
                rows.append(
                    Measurement(
                        label, "gemm", "gemm", device, dtype, GEMM_SIZE, gflops=rate, note=note
                    )
                )
            _time_layers(framework, device, dtype, lengths, base, measurements)
            one = replace(base, batch=1)
            _time_layers(framework, device, dtype, small_lengths, one, measurements)
            grouped = replace(base, num_kv_heads=num_kv_heads)
            _time_layers(framework, device, dtype, grouped_lengths, grouped, measurements)
            for length in pruned_lengths:
                shape = replace(base, length=length)
                kept = [k for k in kept_heads if k <= base.num_heads]
                measurements[framework.executions[0]] += _time_pruned(
                    framework, device, dtype, shape, kept
                )
            if generation is not None:
                executions = framework.generation_executions or framework.executions[:1]
                for heads in (None, num_kv_heads):
                    for execution in executions:
                        measurements[execution] += run_generation(
                            framework,
                            device,
                            dtype,
                            replace(generation, num_kv_heads=heads),
                            ITEMSIZE[dtype],
                            execution=execution,
                            ways=generation_ways,
                        )
        if device == "cpu":
            for length in sharded_lengths:
                shape = replace(base, length=length)
                measurements[framework.sharded_execution] += _time_sharded(framework, shape)
        if framework.measures_memory(device):
            memory = _measure_memory(framework, device, memory_lengths, base)
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

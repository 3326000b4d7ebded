"""Framework-free benchmark pieces: shapes, inputs, FLOP and byte counts, timing statistics."""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "ITEMSIZE",
    "LIMIT_BYTES",
    "Measurement",
    "Shape",
    "attention_flops",
    "collector_paused",
    "inputs",
    "key_lengths",
    "kv_bytes",
    "median_seconds",
    "medians_in_turns",
    "score_bytes",
]

#: Past this estimate of what one pass holds at once, a configuration is not
#: run: the machines the benchmark runs on are shared.
LIMIT_BYTES = 4 << 30
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class Shape:
    """Self-attention of ``batch`` sequences of ``length`` tokens of ``num_hiddens``."""

    batch: int = 8
    length: int = 512
    num_hiddens: int = 512
    num_heads: int = 8
    #: Grouped key/value heads; ``None``: ``num_heads`` (multi-head attention).
    num_kv_heads: int | None = None

    @property
    def kv_heads(self) -> int:
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads


def attention_flops(shape: Shape) -> float:
    """FLOPs of one forward pass of self-attention: projections plus attention.

    For ``Q`` queries and ``K`` keys of sizes ``dq``, ``dk``, ``dv``, ``nh``
    hiddens and key/value projections of ``nkv = nh * kv_heads / num_heads``:
    ``2*B*(Q*dq*nh + K*dk*nkv + K*dv*nkv + Q*nh*nh)`` for the four
    projections and ``4*B*Q*K*nh`` for scores and weighted values; here
    ``Q = K = N`` and every size is ``nh``.
    """
    b, n, d = shape.batch, shape.length, shape.num_hiddens
    kv = d * shape.kv_heads // shape.num_heads
    projections = 2 * b * n * (d * d + d * kv + d * kv + d * d)
    attention = 4 * b * n * n * d
    return float(projections + attention)


def kv_bytes(shape: Shape, itemsize: int = 4) -> int:
    """Bytes of the projected keys and values: what a key/value cache holds."""
    head_dim = shape.num_hiddens // shape.num_heads
    return 2 * shape.batch * shape.length * shape.kv_heads * head_dim * itemsize


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


def median_seconds(
    step: Callable[[], object], *, warmup: int = 2, repeats: int = 7, budget_s: float = 20.0
) -> float:
    """Median wall time of ``step`` after ``warmup`` calls.

    ``step`` must block until its result is ready (synchronise devices).
    Stops early, after at least three timed runs, once ``budget_s`` is spent.
    """
    for _ in range(warmup):
        step()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < repeats:
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
        if len(times) >= 3 and time.perf_counter() - start > budget_s:
            break
    return statistics.median(times)


#: The shortest sample :func:`medians_in_turns` times: short calls are timed in runs.
SAMPLE_S = 0.005


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's garbage collector off while ways are timed, after a collection (as
    :mod:`timeit` times).

    The outputs a generation keeps, step after step, are objects the collector
    tracks: a few hundred of them set off its passes, and a full one walks every
    object of the process (tens of milliseconds beside a framework, as long as a
    quarter of a 256-step generation on a CPU), falling on whichever way's turn
    was running. Garbage a way makes waits for the collection after.
    """
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def medians_in_turns(
    steps: dict[str, Callable[[], object]],
    *,
    warmup: int = 2,
    repeats: int = 7,
    budget_s: float = 20.0,
) -> dict[str, float]:
    """The median wall time of each step, the steps taking turns.

    A shared machine's speed drifts over seconds: steps timed one after the
    other differ by that drift too, while steps timed in turns meet the same
    moments, so their ratios hold. A step shorter than :data:`SAMPLE_S` is
    timed in runs of as many calls as fill it (the median is per call). The
    steps take their turns in the same order every time, so that no step's
    turn follows its own: in an order reversed at every turn, the steps at
    its ends would run two turns in a row, the second on caches warm with
    their own arrays, and a step between them never. Each ``step`` must block
    until its result is ready (synchronise devices). Stops early, after at
    least three samples of each, once ``budget_s`` per step is spent.
    """
    runs = {}
    for name, step in steps.items():
        for _ in range(warmup):
            step()
        start = time.perf_counter()
        step()
        runs[name] = max(1, min(1000, int(SAMPLE_S / max(time.perf_counter() - start, 1e-7))))
    times: dict[str, list[float]] = {name: [] for name in steps}
    start = time.perf_counter()
    while min(map(len, times.values()), default=repeats) < repeats:
        for name, step in steps.items():
            calls = runs[name]
            t0 = time.perf_counter()
            for _ in range(calls):
                step()
            times[name].append((time.perf_counter() - t0) / calls)
        spent = time.perf_counter() - start
        if min(map(len, times.values())) >= 3 and spent > budget_s * len(steps):
            break
    return {name: statistics.median(samples) for name, samples in times.items()}


@dataclass
class Measurement:
    """One timing or memory figure."""

    backend: str
    implementation: str  # "ours", "ours (generic)", "native", "gemm"
    mode: str  # "forward", "forward+backward", "peak memory", "gemm"
    device: str
    dtype: str
    length: int
    seconds: float | None = None
    gflops: float | None = None
    peak_mib: float | None = None
    #: Generated tokens per second (mode "generate"), the batch's together.
    tokens_per_s: float | None = None
    #: Python function calls per call, counted by cProfile (mode "python calls").
    calls: float | None = None
    note: str = ""
    shape: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, object]:
        """The measurement as the result files hold it."""
        return asdict(self)


def peak_rss_mib() -> float:
    """This process's peak resident memory (``VmHWM``), in MiB.

    ``ru_maxrss`` would not do: Linux carries it across ``fork``/``exec``, so
    a child started by a large parent reports the parent's peak.
    """
    with open("/proc/self/status") as file:
        for line in file:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise OSError("no VmHWM in /proc/self/status")


def reset_peak_rss() -> None:
    """Resets ``VmHWM`` to the current resident size (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as file:
        file.write("5")

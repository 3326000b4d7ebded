"""Framework-free benchmark pieces: FLOP counts, timing statistics, the report."""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

__all__ = [
    "Measurement",
    "Shape",
    "attention_flops",
    "format_markdown",
    "kv_bytes",
    "machine_info",
    "median_seconds",
    "medians_in_turns",
]


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
    timed in runs of as many calls as fill it (the median is per call); the
    order of the steps reverses at every turn. Each ``step`` must block
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
    order = list(steps)
    start = time.perf_counter()
    while min(map(len, times.values()), default=repeats) < repeats:
        for name in order:
            step, calls = steps[name], runs[name]
            t0 = time.perf_counter()
            for _ in range(calls):
                step()
            times[name].append((time.perf_counter() - t0) / calls)
        order.reverse()
        spent = time.perf_counter() - start
        if len(times[order[0]]) >= 3 and spent > budget_s * len(steps):
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
    note: str = ""
    shape: dict[str, int] = field(default_factory=dict)

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


def machine_info() -> dict[str, object]:
    """Platform, processor, core count and Python version of this machine."""
    info: dict[str, object] = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
    }
    try:
        with open("/proc/cpuinfo") as file:
            for line in file:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return info


def _ms(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    # Small calls take fractions of a millisecond: three significant digits.
    return f"{seconds * 1e3:.1f}" if seconds >= 0.01 else f"{seconds * 1e3:.3g}"


def _ms_or_note(m: dict) -> str:
    """A row's time in ms, or its note (why it has none)."""
    return _ms(m.get("seconds")) if m.get("seconds") else m["note"]


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if not a or not b else f"{a / b:.2f}x"


def _row(*cells: object) -> str:
    return "| " + " | ".join(str(cell) for cell in cells) + " |"


def _table_head(title: str, columns: Sequence[str]) -> list[str]:
    """The lines above a table's rows: its title, its column names, the separator."""
    return ["", title, "", _row(*columns), "|" + "---|" * len(columns)]


def format_markdown(results: Sequence[dict]) -> str:
    """One table per backend: ours vs native per length and mode, then memory."""
    lines = ["# mha_multi benchmark", ""]
    for result in results:
        backend = result["backend"]
        measurements = result["measurements"]
        gemm = next((m for m in measurements if m["mode"] == "gemm"), None)
        lines += [f"## {backend}", ""]
        versions = ", ".join(f"{k} {v}" for k, v in result.get("versions", {}).items())
        machine = result.get("machine", {})
        lines.append(
            f"{versions}; {machine.get('cpu', machine.get('processor', '?'))}, "
            f"{machine.get('cpu_count', '?')} cores; device {result.get('device', 'cpu')}."
        )
        if gemm:
            lines.append(f"Measured GEMM rate ({gemm['note']}): {gemm['gflops']:.0f} GFLOP/s.")
        timed = [m for m in measurements if m["mode"] in ("forward", "forward+backward")]
        if timed:
            lines += [
                "",
                "| mode | dtype | B | N | heads (q/kv) | ours (ms) | native (ms) | ours / native "
                "| ours GFLOP/s | % of GEMM | generic path (ms) |",
                "|---|---|---|---|---|---|---|---|---|---|---|",
            ]

        def key(m: dict) -> tuple:
            shape = m.get("shape") or {}
            heads = shape.get("num_heads", 0)
            kv_heads = shape.get("num_kv_heads") or heads
            return (m["mode"], m["dtype"], shape.get("batch", 0), m["length"], -kv_heads, heads)

        for mode, dtype, batch, length, minus_kv, heads in sorted({key(m) for m in timed}):
            row = {
                m["implementation"]: m
                for m in timed
                if key(m) == (mode, dtype, batch, length, minus_kv, heads)
            }
            ours, native = row.get("ours", {}), row.get("native", {})
            generic = row.get("ours (generic)", {})
            gflops = ours.get("gflops")
            share = f"{100 * gflops / gemm['gflops']:.0f}%" if gflops and gemm else "-"
            lines.append(
                f"| {mode} | {dtype} | {batch} | {length} | {heads}/{-minus_kv} | "
                f"{_ms(ours.get('seconds'))} | "
                f"{_ms(native.get('seconds'))} | "
                f"{_ratio(ours.get('seconds'), native.get('seconds'))} | "
                f"{'-' if gflops is None else f'{gflops:.0f}'} | {share} | "
                f"{_ms(generic.get('seconds'))} |"
            )
        memory = [m for m in measurements if m["mode"] == "peak memory"]
        if memory:
            implementations = sorted({m["implementation"] for m in memory})
            lines += _table_head(
                "Peak memory of one forward pass above the inputs (MiB):", ["N", *implementations]
            )
            for length in sorted({m["length"] for m in memory}):
                cells = []
                for implementation in implementations:
                    m = next(
                        (
                            m
                            for m in memory
                            if m["length"] == length and m["implementation"] == implementation
                        ),
                        None,
                    )
                    if m is None:
                        cells.append("-")
                    elif m["peak_mib"] is None:
                        cells.append(m["note"] or "-")
                    else:
                        cells.append(f"{m['peak_mib']:.0f}")
                lines.append(f"| {length} | " + " | ".join(cells) + " |")
        lines += _pruned_lines(measurements)
        lines += _sharded_lines(measurements)
        lines += _generation_lines(measurements)
        notes = sorted({m["note"] for m in timed if m.get("note", "").startswith("K/V")})
        if notes:
            lines += ["", *(f"Grouped heads: {note}." for note in notes)]
        lines.append("")
    return "\n".join(lines)


def _pruned_lines(measurements: Sequence[dict]) -> list[str]:
    """The pruned-heads table: forward time of each pruned layer and its speed-up."""
    pruned = [m for m in measurements if m["mode"] == "pruned forward"]
    if not pruned:
        return []
    lines = _table_head(
        'Forward pass of the layer pruned to fewer heads (docs: "Heads"):',
        ["dtype", "N", "heads (q/kv)", "forward (ms)", "full / this"],
    )
    for dtype, length in sorted({(m["dtype"], m["length"]) for m in pruned}):
        rows = [m for m in pruned if (m["dtype"], m["length"]) == (dtype, length)]
        rows.sort(key=lambda m: -m["shape"]["num_heads"])
        full = rows[0].get("seconds")
        for m in rows:
            heads = f"{m['shape']['num_heads']}/{m['shape']['num_kv_heads']}"
            lines.append(_row(dtype, length, heads, _ms_or_note(m), _ratio(full, m.get("seconds"))))
    return lines


def _sharded_lines(measurements: Sequence[dict]) -> list[str]:
    """The sharded-heads table: forward time against the number of shards."""
    sharded = [m for m in measurements if m["mode"] == "sharded forward"]
    if not sharded:
        return []
    lines = _table_head(
        "Forward pass with the heads sharded, CPU devices sharing the same cores "
        '(overhead only; docs: "Sharding heads"):',
        ["dtype", "N", "heads (q/kv)", "shards", "forward (ms)", "this / unsharded"],
    )
    for length in sorted({m["length"] for m in sharded}):
        rows = [m for m in sharded if m["length"] == length]
        unsharded = next((m for m in rows if m["note"] == "unsharded"), {})
        for m in rows:
            shape = m["shape"]
            heads = f"{shape['num_heads']}/{shape.get('num_kv_heads') or shape['num_heads']}"
            count = m["implementation"].rsplit(" ", 1)[-1]
            ratio = _ratio(m.get("seconds"), unsharded.get("seconds"))
            lines.append(_row(m["dtype"], length, heads, count, _ms_or_note(m), ratio))
    return lines


def _generation_lines(measurements: Sequence[dict]) -> list[str]:
    """The generation table: tokens/s of each way, and the ratios the docs quote."""
    generated = [m for m in measurements if m["mode"] == "generate"]
    memory = [m for m in measurements if m["mode"] == "generate memory"]
    if not generated:
        return []
    lines = _table_head(
        'Generation after a prompt, one token per step (docs: "Generating with a cache"):',
        ["dtype", "prompt + new", "heads (q/kv)", "way", "tokens/s", "cached / this", "notes"],
    )

    def key(m: dict) -> tuple:
        shape = m.get("shape") or {}
        heads = shape.get("num_heads", 0)
        return (
            m["dtype"],
            shape.get("prompt", 0),
            m["length"],
            heads,
            shape.get("num_kv_heads") or heads,
        )

    for group in sorted({key(m) for m in generated}):
        rows = [m for m in generated if key(m) == group]
        cached = next((m for m in rows if m["implementation"] == "cached"), {})
        dtype, prompt, length, heads, kv_heads = group
        sizes = (dtype, f"{prompt} + {length - prompt}", f"{heads}/{kv_heads}")
        for m in rows:
            rate = m.get("tokens_per_s")
            ratio = _ratio(cached.get("tokens_per_s"), rate) if m is not cached else "-"
            shown = "-" if rate is None else f"{rate:.0f}"
            lines.append(_row(*sizes, m["implementation"], shown, ratio, m.get("note", "")))
        for m in memory:
            if key(m) == group:
                memory_cells = ("cached: peak memory", f"{m['peak_mib']:.0f} MiB", "-", m["note"])
                lines.append(_row(*sizes, *memory_cells))
    return lines

"""The benchmark's tables: Markdown from its results, per backend and across backends.

:func:`format_markdown` is the report of ``python -m mha_multi.bench
report``. It opens with the tables across backends (:func:`ratio_table`,
:func:`generation_table`, :func:`memory_table`), which the results page
shows too (:mod:`mha_multi.bench.page`), then gives each backend's rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from mha_multi.bench.call_tables import calls_table, host_table, llama_table
from mha_multi.bench.cells import Table
from mha_multi.bench.cells import ms as _ms
from mha_multi.bench.cells import ratio as _ratio
from mha_multi.bench.cells import row as _row
from mha_multi.bench.cells import table as _table
from mha_multi.bench.cells import table_head as _table_head
from mha_multi.bench.common import ITEMSIZE, Shape, kv_bytes
from mha_multi.bench.long import long_table

__all__ = [
    "TIMED_MODES",
    "Table",
    "format_markdown",
    "generation_table",
    "memory_table",
    "ratio_table",
    "small_calls_table",
    "speed_table",
    "summary_lines",
]

#: The modes of the timed rows, each a pass of ours and of the native layer.
TIMED_MODES = ("forward", "forward+backward")


def _ms_or_note(m: dict) -> str:
    """A row's time in ms, or its note (why it has none)."""
    return _ms(m.get("seconds")) if m.get("seconds") else m["note"]


def _heads(m: dict) -> tuple[int, int]:
    """A row's query and key/value heads."""
    shape = m.get("shape") or {}
    heads = shape.get("num_heads", 0)
    return heads, shape.get("num_kv_heads") or heads


def ratio_table(measurements: Sequence[dict], select: Callable[[dict], bool]) -> Table:
    """Ours against the native layer, one column per sequence length.

    A row per backend, dtype and mode; a cell is ours / native (below 1 when
    ours is faster) and our time, or why there is none. ``select`` picks the
    timed rows (e.g. by batch).
    """
    timed = [
        m
        for m in measurements
        if m["mode"] in TIMED_MODES
        and m["implementation"] in ("ours", "native")
        and _heads(m)[0] == _heads(m)[1]
        and select(m)
    ]
    lengths = sorted({m["length"] for m in timed})
    rows, shown = [], []
    for backend, dtype, mode in sorted({(m["backend"], m["dtype"], m["mode"]) for m in timed}):
        cells = []
        for length in lengths:
            pair = {
                m["implementation"]: m
                for m in timed
                if (m["backend"], m["dtype"], m["mode"], m["length"])
                == (backend, dtype, mode, length)
            }
            shown += pair.values()
            ours, native = pair.get("ours", {}), pair.get("native", {})
            if not ours.get("seconds"):
                cells.append(ours.get("note") or "-")
                continue
            ratio = _ratio(ours["seconds"], native.get("seconds"))
            cells.append(f"{ratio} ({_ms(ours['seconds'])} ms)")
        rows.append((backend, dtype, mode, *cells))
    columns = ["backend", "dtype", "mode", *(f"N = {length}" for length in lengths)]
    return _table(columns, rows, shown)


def _rate_or_note(m: dict) -> str:
    """A generation's tokens per second, or its note (why it has none)."""
    rate = m.get("tokens_per_s")
    return (m.get("note") or "-") if rate is None else f"{rate:.0f}"


def generation_table(measurements: Sequence[dict]) -> Table:
    """Generation with our cache against the hand-written loop, per backend and heads.

    The ratio is ours / hand-written in tokens per second: above 1 when ours
    is faster. The peak memory of our generation stands beside its cache's size.
    Layers with rotary positions have a table of their own
    (:func:`~mha_multi.bench.call_tables.llama_table`).
    """
    generated = [
        m
        for m in measurements
        if (
            (m["mode"], m["implementation"])
            in {("generate", "cached"), ("generate", "hand-written")}
            or m["mode"] == "generate memory"
        )
        and not (m.get("shape") or {}).get("rotary")  # the Llama-shaped rows' table
    ]

    def key(m: dict) -> tuple:
        return (
            m["backend"],
            m["dtype"],
            *(-h for h in _heads(m)),
            (m.get("shape") or {}).get("prompt"),
        )

    rows, shown = [], []
    for group in sorted({key(m) for m in generated}):
        ways = {m["mode"] + m["implementation"]: m for m in generated if key(m) == group}
        ours, hand = ways.get("generatecached", {}), ways.get("generatehand-written", {})
        memory = ways.get("generate memorycached")
        if not ours and not hand:
            continue
        shown += ways.values()
        backend, dtype, heads, kv_heads = group[0], group[1], -group[2], -group[3]
        if memory and memory.get("peak_mib") is not None:
            shape = Shape(**{k: v for k, v in memory["shape"].items() if k != "prompt"})
            cache = kv_bytes(shape, ITEMSIZE[dtype]) / 2**20
            peak = f"{memory['peak_mib']:.0f} MiB ({cache:.1f} MiB)"
        else:
            peak = "-"
        rates = [_rate_or_note(m) for m in (ours, hand)]
        ratio = _ratio(ours.get("tokens_per_s"), hand.get("tokens_per_s"))
        rows.append((backend, dtype, f"{heads}/{kv_heads}", *rates, ratio, peak))
    columns = [
        "backend",
        "dtype",
        "heads (q/kv)",
        "ours (tokens/s)",
        "hand-written (tokens/s)",
        "ours / hand-written",
        "peak memory (the cache)",
    ]
    return _table(columns, rows, shown)


def memory_table(measurements: Sequence[dict]) -> Table:
    """Peak memory of one forward pass above its inputs, in MiB, one column per length."""
    memory = [m for m in measurements if m["mode"] == "peak memory"]
    lengths = sorted({m["length"] for m in memory})
    rows = []
    for backend, implementation in sorted({(m["backend"], m["implementation"]) for m in memory}):
        cells = []
        for length in lengths:
            m = next(
                (
                    m
                    for m in memory
                    if (m["backend"], m["implementation"], m["length"])
                    == (backend, implementation, length)
                ),
                None,
            )
            if m is None:
                cells.append("-")
            elif m["peak_mib"] is None:
                cells.append(m["note"] or "-")
            else:
                cells.append(f"{m['peak_mib']:.0f}")
        rows.append((backend, implementation, *cells))
    columns = ["backend", "layer", *(f"N = {length}" for length in lengths)]
    return _table(columns, rows, memory)


def speed_table(measurements: Sequence[dict]) -> Table:
    """:func:`ratio_table` of the rows of a batch of several examples."""
    return ratio_table(measurements, lambda m: (m.get("shape") or {}).get("batch", 0) > 1)


def small_calls_table(measurements: Sequence[dict]) -> Table:
    """:func:`ratio_table` of the rows of one example, where a call's fixed cost shows."""
    return ratio_table(measurements, lambda m: (m.get("shape") or {}).get("batch", 0) == 1)


#: Title -> the table across backends: what the report opens with, per device.
SUMMARIES: dict[str, Callable[[Sequence[dict]], Table]] = {
    "Ours / the native layer, a batch of examples (ms: ours)": speed_table,
    "Ours / the native layer, one example (ms: ours)": small_calls_table,
    "Generation, ours against the hand-written loop": generation_table,
    "Generation by a Llama-shaped layer (rotary), ours against the hand-written loop": llama_table,
    "Host time of the tiny layer, per call": host_table,
    "Python calls per call (cProfile)": calls_table,
    "Peak memory of one forward pass (MiB)": memory_table,
    "A long causal pass with its backward, ours against SDPA's layer": long_table,
}


def summary_lines(measurements: Sequence[dict]) -> list[str]:
    """Every table across backends that has rows, each under its title, per device."""
    lines = []
    for device in sorted({m["device"] for m in measurements}):
        on_device = [m for m in measurements if m["device"] == device]
        for title, make in SUMMARIES.items():
            table = make(on_device)
            if table.lines:
                lines += ["", f"### {title}, {device}", "", *table.lines]
    return lines


#: The tables of what a call costs around its kernels, and the long pass's, in each
#: backend's part of the report.
_CALL_TABLES = {
    'The tiny layer\'s host time per call (us; docs: "Results")': host_table,
    "Python calls per call (cProfile)": calls_table,
    "A long causal pass with its backward, ours against SDPA's layer": long_table,
}


def format_markdown(results: Sequence[dict]) -> str:
    """The tables across backends, then each backend's: timings, memory, pruned, sharded,
    generation."""
    lines = ["# mha_multi benchmark"]
    every = [m for result in results for m in result["measurements"]]
    if len({m["backend"] for m in every}) > 1:
        lines += ["", "## Across backends", *summary_lines(every)]
    lines.append("")
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
        memory = memory_table(measurements)
        if memory.lines:
            lines += ["", "Peak memory of one forward pass above the inputs (MiB):", ""]
            lines += memory.lines
        lines += _pruned_lines(measurements)
        lines += _sharded_lines(measurements)
        lines += _packed_lines(measurements)
        lines += _generation_lines(measurements)
        for title, make in _CALL_TABLES.items():
            made = make(measurements)
            lines += ["", f"{title}:", "", *made.lines] if made.lines else []
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


def _packed_lines(measurements: Sequence[dict]) -> list[str]:
    """The packed table: real tokens per second, padded and packed, and their ratio."""
    layouts: dict[tuple[str, int], dict[str, dict]] = {}
    for m in measurements:
        if m["mode"] == "packed forward+backward":
            layout = m["implementation"].rsplit(" ", 1)[-1]
            layouts.setdefault((m["dtype"], m["length"]), {})[layout] = m
    if not layouts:
        return []
    lines = _table_head(
        "Forward+backward over long-tailed lengths, packed into rows against padded "
        '(causal, rotary; docs: "Packed sequences"):',
        ["dtype", "N", "layout", "rows", "tokens/s", "packed / padded", "notes"],
    )
    for (dtype, length), rows in sorted(layouts.items()):
        padded = rows.get("padded", {}).get("tokens_per_s")
        for layout, m in rows.items():
            rate = m.get("tokens_per_s")
            ratio = _ratio(rate, padded) if layout == "packed" else "-"
            shown = "-" if rate is None else f"{rate:.0f}"
            lines.append(_row(dtype, length, layout, m["shape"]["batch"], shown, ratio, m["note"]))
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
            "rotary" if shape.get("rotary") else "",
        )

    for group in sorted({key(m) for m in generated}):
        rows = [m for m in generated if key(m) == group]
        cached = next((m for m in rows if m["implementation"] == "cached"), {})
        dtype, prompt, length, heads, kv_heads, rotary = group
        sizes = (dtype, f"{prompt} + {length - prompt}", f"{heads}/{kv_heads} {rotary}".strip())
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

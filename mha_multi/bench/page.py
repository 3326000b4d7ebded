"""The results page's tables, made from the result files kept in the repository.

``docs/results/`` holds parity reports (``parity-*.json``, as ``python -m
mha_multi.parity report`` writes them) and benchmark results (``bench-*.json``,
as ``python -m mha_multi.bench run`` writes them), each with its date, machine
and command. :func:`blocks` makes every table of the page from them, newest
figure first; :func:`render` writes them between the page's markers, and
:func:`stale` names those that no longer match (docs: "Measured results").
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from mha_multi.bench.call_tables import calls_table, host_table, llama_table
from mha_multi.bench.tables import (
    SUMMARIES,
    Table,
    generation_table,
    memory_table,
    small_calls_table,
    speed_table,
)
from mha_multi.parity.provenance import describe_machine
from mha_multi.parity.report import matrix_lines

__all__ = [
    "Results",
    "Source",
    "blocks",
    "load",
    "render",
    "stale",
    "take",
]

#: A generated block is the text between these two lines of the page.
BEGIN = "<!-- generated: {name} (python -m mha_multi.bench page) -->"
END = "<!-- end generated: {name} -->"
_MARKER = re.compile(r"<!-- (end )?generated: ([\w-]+)")


@dataclass(frozen=True)
class Source:
    """Where figures come from: a result file's date, machine and command."""

    date: str
    machine: str
    command: str
    #: Set where the figures were copied from a run's report, not its files.
    transcribed_from: str = ""

    @classmethod
    def of(cls, record: dict) -> Source:
        """The source a parity report or a benchmark result records."""
        return cls(
            str(record.get("date", "undated")),
            describe_machine(record.get("machine") or {}),
            str(record.get("command", "an unrecorded command")),
            str(record.get("transcribed_from", "")),
        )


@dataclass
class Results:
    """What a results folder holds, newest figure first.

    Attributes:
        reports: the parity reports, newest first.
        rows: every benchmark measurement no newer one replaces.
        sources: ``id`` of a row -> where it comes from.
        winners: the files that hold at least one row of :attr:`rows`.
    """

    reports: list[dict]
    rows: list[dict]
    sources: dict[int, Source]
    winners: set[Path]


def _row_key(m: dict) -> str:
    """What a measurement measures: a newer one of the same key replaces it.

    The device is its kind (``"cpu"``, ``"gpu"``), not its model: a run on
    another GPU replaces the GPU's rows.
    """
    fields = ("backend", "implementation", "mode", "device", "dtype", "length", "shape")
    return json.dumps([m.get(f) for f in fields])


def load(directory: str | Path) -> Results:
    """The parity reports and the newest benchmark rows of ``directory``."""
    folder = Path(directory)
    reports = [
        {**json.loads(path.read_text()), "path": path}
        for path in sorted(folder.glob("parity-*.json"))
    ]
    reports.sort(key=lambda report: str(report.get("date", "")), reverse=True)
    newest: dict[str, tuple[str, dict, Source, Path]] = {}
    for path in sorted(folder.glob("bench-*.json")):
        for result in json.loads(path.read_text()):
            source = Source.of(result)
            for m in result["measurements"]:
                key = _row_key(m)
                if key not in newest or newest[key][0] <= source.date:
                    newest[key] = (source.date, m, source, path)
    rows = [m for _, m, _, _ in newest.values()]
    sources = {id(m): source for _, m, source, _ in newest.values()}
    return Results(reports, rows, sources, {path for *_, path in newest.values()})


def _devices(report: dict) -> set[str]:
    """The devices a parity report has results on."""
    return {cell["device"] for cell in report["cells"]} - {"-"}


def _source_lines(sources: Iterable[Source]) -> list[str]:
    """One line per date and machine, with the commands run there."""
    groups: dict[tuple[str, str, str], list[str]] = {}
    for source in sorted(set(sources), key=lambda s: (s.date, s.command)):
        key = (source.date[:10], source.machine, source.transcribed_from)
        if source.command not in groups.setdefault(key, []):
            groups[key].append(source.command)
    lines = []
    for (day, machine, transcribed), commands in groups.items():
        line = f"Measured {day} on {machine}: {_commands(commands)}."
        if transcribed:
            line += f" Transcribed from {transcribed}."
        lines.append(line)
    return lines


def _commands(commands: Sequence[str]) -> str:
    """The commands, those that differ in their last word only (the backend) written once."""
    endings: dict[str, list[str]] = {}
    for command in commands:
        start, _, last = command.rpartition(" ")
        endings.setdefault(start, []).append(last)
    return "; ".join(
        f"`{start} {lasts[0]}`"
        if len(lasts) == 1
        else f"`{start} <backend>` for {', '.join(lasts)}"
        for start, lasts in endings.items()
    )


def _with_sources(table: Table, results: Results) -> list[str]:
    if not table.lines:
        return ["No result file holds these rows yet."]
    return [*table.lines, "", *_source_lines(results.sources[id(m)] for m in table.rows)]


def _parity_lines(results: Results, device: str) -> list[str]:
    """The newest parity report's error matrix on ``device``, and how far backends differ."""
    report = next((r for r in results.reports if device in _devices(r)), None)
    if report is None:
        return ["No parity report in the results holds these rows yet."]
    # A backend that ran nothing has a cell on no device ("-"): it shows on every device.
    cells = [c for c in report["cells"] if c["device"] in (device, "-")]
    failed = [cell for cell in cells if not cell["passed"]]
    verdict = f"**{len(failed)} of {len(cells)} failed.**" if failed else "Every row passed."
    lines = [*matrix_lines(cells), "", verdict]
    pairs = [
        p for p in report.get("pairwise", []) if (p["device"], p["dtype"]) == (device, "float32")
    ]
    if pairs:
        largest = max(p["max_abs"] for p in pairs)
        lines[-1] += f" Backend against backend, float32 outputs differ by {largest:.2e} at most."
    return [*lines, "", *_source_lines([Source.of(report)])]


def _gpu_lines(results: Results) -> list[str]:
    """Every table with rows on a GPU, each under its title."""
    on_gpu = [m for m in results.rows if m["device"] == "gpu"]
    lines = ["**Parity.**", "", *_parity_lines(results, "gpu")]
    for title, make in SUMMARIES.items():
        table = make(on_gpu)
        if table.lines:
            lines += ["", f"**{title}.**", "", *_with_sources(table, results)]
    return lines


def blocks(results: Results) -> dict[str, list[str]]:
    """Block name -> its generated lines, for every block of the page."""
    on_cpu = [m for m in results.rows if m["device"] == "cpu"]
    return {
        "parity": _parity_lines(results, "cpu"),
        "speed": _with_sources(speed_table(on_cpu), results),
        "small-calls": _with_sources(small_calls_table(on_cpu), results),
        "decoding": _with_sources(generation_table(on_cpu), results),
        "llama-decoding": _with_sources(llama_table(on_cpu), results),
        "host": _with_sources(host_table(on_cpu), results),
        "calls": _with_sources(calls_table(on_cpu), results),
        "memory": _with_sources(memory_table(on_cpu), results),
        "gpu": _gpu_lines(results),
    }


def _spans(page: str) -> dict[str, tuple[int, int]]:
    """Block name -> the indices of its first and last line in ``page``'s lines.

    Raises:
        ValueError: a block begins without ending, or ends without beginning.
    """
    spans, open_at = {}, {}
    for index, line in enumerate(page.splitlines()):
        found = _MARKER.match(line.strip())
        if not found:
            continue
        ending, name = found.groups()
        if not ending:
            open_at[name] = index
        elif name not in open_at:
            raise ValueError(f"the page ends block {name!r} without beginning it")
        else:
            spans[name] = (open_at.pop(name), index)
    if open_at:
        raise ValueError(f"the page begins block(s) {sorted(open_at)} without ending them")
    return spans


def render(page: str, generated: dict[str, list[str]]) -> str:
    """``page`` with every block's lines between its markers replaced by ``generated``'s.

    Raises:
        ValueError: the page lacks a block's markers, or has markers of no block.
    """
    spans = _spans(page)
    if set(spans) != set(generated):
        missing, unknown = set(generated) - set(spans), set(spans) - set(generated)
        raise ValueError(f"the page lacks blocks {sorted(missing)}; unknown: {sorted(unknown)}")
    lines = page.splitlines()
    for name, (first, last) in sorted(spans.items(), key=lambda item: -item[1][0]):
        lines[first : last + 1] = [BEGIN.format(name=name), *generated[name], END.format(name=name)]
    return "\n".join(lines) + "\n"


def stale(page: str, generated: dict[str, list[str]]) -> list[str]:
    """The blocks whose text on ``page`` differs from ``generated``'s, or that it lacks.

    A block the page has and ``generated`` does not is named too.
    """
    spans, lines = _spans(page), page.splitlines()
    differ = {
        name
        for name, (first, last) in spans.items()
        if lines[first + 1 : last] != generated.get(name)
    }
    return sorted(differ | (set(generated) - set(spans)))


def _stamp(record: dict, path: Path) -> str:
    date = record.get("date")
    if not date:
        raise ValueError(f"{path} records no date: make it again with this version")
    return re.sub(r"[-:]", "", str(date))


def take(paths: Sequence[str | Path], directory: str | Path) -> list[Path]:
    """Copies result files into ``directory`` under names that say what they hold.

    Each path is a parity report, a benchmark result file or a folder of them.
    A parity report is kept as ``parity-<devices>-<date>.json``, a benchmark
    file as ``bench-<backend>-<devices>-<date>.json``; then a file that no
    longer gives a figure is removed: a parity report when newer ones cover its
    devices, a benchmark file when newer files measure every row it holds.

    Returns:
        The files written.
    """
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for path in (Path(p) for p in paths):
        for file in sorted(path.glob("*.json")) if path.is_dir() else [path]:
            data = json.loads(file.read_text())
            if isinstance(data, dict):
                devices = "-".join(sorted(_devices(data)))
                name = f"parity-{devices}-{_stamp(data, file)}.json"
            else:
                backend = data[0]["backend"].split(" (")[0]
                devices = sorted({m["device"] for r in data for m in r["measurements"]})
                name = f"bench-{backend}-{'-'.join(devices)}-{_stamp(data[0], file)}.json"
            if file.resolve() != (folder / name).resolve():
                shutil.copyfile(file, folder / name)
            written.append(folder / name)
    results = load(folder)
    for path in sorted(folder.glob("bench-*.json")):
        if path not in results.winners:
            path.unlink()
    # Reports are newest first: one that adds no device to those before it goes.
    covered: set[str] = set()
    for report in results.reports:
        if _devices(report) <= covered:
            report["path"].unlink()
        covered |= _devices(report)
    return written

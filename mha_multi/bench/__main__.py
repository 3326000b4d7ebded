"""``python -m mha_multi.bench``: run backends' benchmarks, then report."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from mha_multi.bench import BENCHMARKS, driver, page
from mha_multi.bench.common import Shape
from mha_multi.bench.framework import load
from mha_multi.bench.generate import GenerationShape, generation_peak_mib
from mha_multi.bench.memory import peak_memory_mib
from mha_multi.bench.tables import format_markdown
from mha_multi.parity.provenance import provenance

#: ``--only`` choice -> the ``driver.run`` lengths argument of those rows;
#: the generation rows are ``generation=None`` when left out.
ROWS = {
    "timing": "lengths",
    "memory": "memory_lengths",
    "grouped": "grouped_lengths",
    "pruned": "pruned_lengths",
    "sharded": "sharded_lengths",
    "small-calls": "small_lengths",
}


#: Every kind of row ``--only`` takes: ``host`` the tiny layer's host time,
#: ``calls`` the Python calls of a call (:mod:`mha_multi.bench.host`),
#: ``packed`` packed sequences against padded (:mod:`mha_multi.bench.packed`),
#: ``long`` the long training pass on a GPU (:mod:`mha_multi.bench.long`).
KINDS = (*ROWS, "generation", "host", "calls", "packed", "long")


def kinds_of_rows(text: str) -> tuple[str, ...]:
    """``--only``'s comma-separated kinds of row, each checked."""
    kinds = tuple(kind for kind in text.split(",") if kind)
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown or not kinds:
        raise argparse.ArgumentTypeError(f"expected kinds of row among {', '.join(KINDS)}")
    return kinds


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mha_multi.bench")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="benchmark backends, writing OUT/<backend>.json")
    run.add_argument("--out", required=True)
    run.add_argument("--quick", action="store_true", help="small sizes only (a smoke run)")
    run.add_argument(
        "--only",
        type=kinds_of_rows,
        help="comma-separated kinds of row to run, of "
        + ", ".join(KINDS)
        + " (default: all; the GEMM rate is always measured)",
    )
    run.add_argument(
        "--devices",
        help="comma-separated devices to run on, of cpu and gpu (default: every one present)",
    )
    run.add_argument(
        "--ways",
        help="comma-separated ways of generating to time, of cached, recompute, hand-written"
        " and native (default: every one the backend has)",
    )
    run.add_argument(
        "--layers",
        help="comma-separated layers to generate with, of plain, grouped (8/2 heads) and llama"
        " (8/2 heads, rotary) (default: all three)",
    )
    run.add_argument(
        "--executions",
        help="comma-separated ways of executing the generation rows, of those the backend"
        " has (default, eager, compiled, imperative; default: every one)",
    )
    run.add_argument("backends", nargs="+", choices=sorted(BENCHMARKS))
    report = commands.add_parser("report", help="print and write report.md from results")
    report.add_argument("--results", required=True)
    report.add_argument("--out", required=True)
    results_page = commands.add_parser(
        "page", help="write the results page's tables from the result files kept for it"
    )
    results_page.add_argument("--results", default="docs/results", help="the result files")
    results_page.add_argument("--page", default="docs/results.md", help="the page")
    results_page.add_argument(
        "--take",
        action="append",
        default=[],
        metavar="PATH",
        help="a parity report, a benchmark result file or a folder of them, to keep in"
        " RESULTS first (repeatable)",
    )
    results_page.add_argument(
        "--check", action="store_true", help="write nothing; fail if a table is out of date"
    )
    # What ``run`` starts for each peak-memory figure, a process's peak being
    # meaningful only for its first pass.
    memory = commands.add_parser("memory", help="peak memory of one forward pass, in MiB")
    memory.add_argument("backend", choices=sorted(BENCHMARKS))
    memory.add_argument("implementation")
    memory.add_argument("device")
    memory.add_argument("shape", type=lambda text: Shape(**json.loads(text)))
    generation = commands.add_parser(
        "generation-memory", help="peak memory of one cached generation, in MiB"
    )
    generation.add_argument("backend", choices=sorted(BENCHMARKS))
    generation.add_argument("device")
    generation.add_argument("dtype")
    generation.add_argument("shape", type=lambda text: GenerationShape(**json.loads(text)))
    args = parser.parse_args(argv)
    arguments = sys.argv[1:] if argv is None else argv

    if args.command == "page":
        return write_page(args.page, args.results, args.take, check=args.check)

    if args.command == "generation-memory":
        framework = load(args.backend)
        print(generation_peak_mib(framework, args.device, args.dtype, args.shape))
        return 0

    if args.command == "memory":
        framework = load(args.backend)
        print(peak_memory_mib(framework, args.implementation, args.device, args.shape))
        return 0

    if args.command == "run":
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        for backend in args.backends:
            kwargs = (
                {
                    "lengths": (64, 128),
                    "memory_lengths": (256,),
                    "grouped_lengths": (64,),
                    "generation": GenerationShape(prompt=32, new_tokens=32),
                    "pruned_lengths": (64,),
                    "sharded_lengths": (64,),
                    "host_blocks": 5,
                    "packed_sequences": 8,
                    "packed_length": 128,
                    "long": Shape(batch=1, length=128, num_hiddens=64, num_heads=2),
                    "long_on_cpu": True,
                }
                if args.quick
                else {}
            )
            if args.only:
                # Every other kind of row is left out.
                kwargs |= {name: () for kind, name in ROWS.items() if kind not in args.only}
                kwargs |= {"generation": None} if "generation" not in args.only else {}
                kwargs |= {"host_blocks": 0} if "host" not in args.only else {}
                kwargs |= {"calls": False} if "calls" not in args.only else {}
                kwargs |= {"packed_sequences": 0} if "packed" not in args.only else {}
                kwargs |= {"long": None} if "long" not in args.only else {}
            if args.devices:
                kwargs["devices"] = args.devices.split(",")
            if args.ways:
                kwargs["generation_ways"] = args.ways.split(",")
            if args.executions:
                kwargs["generation_executions"] = args.executions.split(",")
            if args.layers:
                kwargs["generation_layers"] = args.layers.split(",")
                unknown = set(kwargs["generation_layers"]) - {"plain", "grouped", "llama"}
                if unknown:
                    parser.error(f"--layers: unknown layers {sorted(unknown)}")
            # Where the figures come from, for the report and the results page.
            made = provenance("python -m mha_multi.bench", arguments)
            results = [result | made for result in driver.run(load(backend), **kwargs)]
            (out / f"{backend}.json").write_text(json.dumps(results, indent=2))
            print(format_markdown(results), flush=True)
        return 0
    results = []
    for path in sorted(Path(args.results).glob("*.json")):
        results += json.loads(path.read_text())
    markdown = format_markdown(results)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text(markdown)
    (out / "report.json").write_text(json.dumps(results, indent=2))
    print(markdown)
    print(f"[bench] report written to {out / 'report.md'}")
    return 0


def write_page(path: str, results: str, takes: Sequence[str], *, check: bool) -> int:
    """``page``: keeps ``takes`` in ``results``, then writes or checks the page's tables."""
    for written in page.take(takes, results) if takes else ():
        print(f"[bench] kept {written}")
    text = Path(path).read_text()
    generated = page.blocks(page.load(results))
    outdated = page.stale(text, generated)
    if check:
        if outdated:
            print(
                f"[bench] {path}: tables {', '.join(outdated)} differ from the files in"
                f" {results}; `nox -s results` writes them"
            )
            return 1
        print(f"[bench] {path}: every table matches the files in {results}")
        return 0
    Path(path).write_text(page.render(text, generated))
    print(f"[bench] {path}: tables written ({', '.join(outdated) or 'none'} changed)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

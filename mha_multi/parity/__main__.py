"""``python -m mha_multi.parity``: cases, run, report.

python -m mha_multi.parity cases DIR                  # write the case files
python -m mha_multi.parity run --cases DIR --out RES torch jax-nnx
python -m mha_multi.parity report --results RES --out REPORT_DIR
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mha_multi.parity",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    cases = commands.add_parser("cases", help="write every parity case to DIR/<name>.npz")
    cases.add_argument("directory")
    clean = commands.add_parser("clean", help="remove a results directory")
    clean.add_argument("directory")
    run = commands.add_parser("run", help="run backends on the case files")
    run.add_argument("--cases", required=True)
    run.add_argument("--out", required=True)
    run.add_argument("--devices", default="cpu,gpu", help="comma-separated devices, of cpu and gpu")
    run.add_argument(
        "backends",
        nargs="+",
        help="the backends to run, of: " + ", ".join(_runner_names()),
    )
    report = commands.add_parser("report", help="compare results and write report.md/json")
    report.add_argument("--results", required=True)
    report.add_argument("--cases", help="case directory (default: RESULTS/../cases)")
    report.add_argument("--out", required=True)
    report.add_argument("--expect", default="", help="comma-separated backends that must appear")
    args = parser.parse_args(argv)
    try:
        return _command(args, parser, argv)
    except (ValueError, TypeError, OSError, ImportError) as error:
        # Bad arguments and files, and missing frameworks, are the user's to fix: one
        # line, as argparse reports its own errors (and python -m mha_multi its own).
        # Other exceptions are bugs and keep their traceback.
        message = " ".join(str(error).split()) or type(error).__name__
        print(f"{parser.prog}: error: {message}", file=sys.stderr)
        return 2


def _runner_names() -> list[str]:
    from mha_multi.parity.runners import runner_names

    return runner_names()


def _command(
    args: argparse.Namespace, parser: argparse.ArgumentParser, argv: Sequence[str] | None
) -> int:
    """The command ``args`` names; its exit status."""
    if args.command == "cases":
        from mha_multi.parity.cases import CACHED_CASES, CASES, write_cases
        from mha_multi.parity.packed_cases import PACKED_CASES

        paths = write_cases(args.directory, CASES + CACHED_CASES + PACKED_CASES)
        print(f"[parity] wrote {len(paths)} cases to {args.directory}")
        return 0
    if args.command == "clean":
        if os.path.lexists(args.directory) and not os.path.isdir(args.directory):
            raise NotADirectoryError(f"{args.directory!r} is no results directory")
        shutil.rmtree(args.directory, ignore_errors=True)
        return 0
    if args.command == "run":
        from mha_multi.parity.run import run_backends

        require_gpu = os.environ.get("MHA_MULTI_REQUIRE_GPU", "") not in ("", "0")
        devices = [d for d in args.devices.split(",") if d]
        unknown = sorted(set(devices) - {"cpu", "gpu"})
        if unknown:
            parser.error(f"--devices: unknown device(s) {', '.join(unknown)}; expected cpu, gpu")
        ok = run_backends(
            args.backends, args.cases, args.out, require_gpu=require_gpu, devices=devices
        )
        return 0 if ok else 1
    from mha_multi.parity.provenance import provenance
    from mha_multi.parity.report import build_report, format_markdown

    cases_dir = args.cases or str(Path(args.results).parent / "cases")
    expected = [b for b in args.expect.split(",") if b]
    result = build_report(args.results, cases_dir, expected)
    # The results page prints when, where and how the report was made.
    arguments = sys.argv[1:] if argv is None else argv
    result |= provenance("python -m mha_multi.parity", arguments)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    markdown = format_markdown(result)
    try:
        from mha_multi.parity.cases import load_case
        from mha_multi.parity.heads_figure import plot_heads

        heads = plot_heads(args.results, load_case(Path(cases_dir) / "book.npz"), out / "heads.png")
        if heads:
            markdown += f"\nAttention weights per head: `{heads.name}`.\n"
    except ImportError:
        print("[parity] matplotlib is not installed: no heads.png")
    (out / "report.md").write_text(markdown)
    (out / "report.json").write_text(json.dumps(result, indent=2))
    print(markdown)
    print(f"[parity] report written to {out / 'report.md'} and {out / 'report.json'}")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())

"""The parity report: every backend x device x dtype against the float64 reference."""

from __future__ import annotations

import itertools
import json
import os
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mha_multi.parity.cases import Case, load_cases
from mha_multi.parity.compare import Check, compare, errors, tolerance
from mha_multi.parity.importance import IMPORTANCE_CASES, reference_importance

__all__ = ["Cell", "build_report", "format_markdown", "matrix_lines"]


@dataclass
class Cell:
    """One backend x device x dtype: the worst errors over every case."""

    backend: str
    device: str
    dtype: str
    forward: Check | None = None
    gradient: Check | None = None
    cases: int = 0
    failures: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.cases > 0 and not self.failures

    def as_dict(self) -> dict[str, object]:
        return {
            "backend": self.backend,
            "device": self.device,
            "dtype": self.dtype,
            "cases": self.cases,
            "forward": self.forward and self.forward.as_dict(),
            "gradient": self.gradient and self.gradient.as_dict(),
            "failures": self.failures,
            "passed": self.passed,
        }


def _worse(current: Check | None, new: Check) -> Check:
    return new if current is None or not new.max_abs <= current.max_abs else current


def _load(path: Path) -> dict[str, np.ndarray]:
    try:
        with np.load(path, allow_pickle=False) as file:
            return {name: file[name] for name in file.files}
    except (zipfile.BadZipFile, EOFError, ValueError, MemoryError) as error:
        raise ValueError(f"{os.fspath(path)!r} is damaged: {error}") from error


def build_report(
    results_dir: str | os.PathLike[str],
    cases_dir: str | os.PathLike[str],
    expected_backends: Sequence[str] = (),
) -> dict[str, object]:
    """Compares every stored result with the reference and with each other.

    A backend in ``expected_backends`` with no results, a backend folder
    without the run's ``meta.json`` (an interrupted run), or without any
    result, or without a cell, workflow or importance result the run
    recorded it would make, or a case missing from a backend's cell, is a
    failure.
    """
    cases: dict[str, Case] = {case.name: case for case in load_cases(cases_dir)}
    results_root = Path(results_dir)
    metas = {}
    cells: dict[tuple[str, str, str], Cell] = {}
    outputs: dict[tuple[str, str, str], dict[str, np.ndarray]] = {}
    backends = (
        sorted(p.name for p in results_root.iterdir() if p.is_dir())
        if results_root.exists()
        else []
    )
    for backend in backends:
        meta_path = results_root / backend / "meta.json"
        metas[backend] = json.loads(meta_path.read_text()) if meta_path.exists() else {}
        missing_files = [
            name
            for name in ("meta.json", "workflow.npy", "importance.json")
            if not (results_root / backend / name).exists()
        ]
        if missing_files:
            cells[(backend, "-", "-")] = Cell(
                backend, "-", "-", failures=[f"no {', '.join(missing_files)}: the run did not end"]
            )
        for path in sorted((results_root / backend).glob("*.npz")):
            parts = path.stem.split("__")
            if len(parts) != 3 or parts[2] not in cases:
                raise ValueError(
                    f"{os.fspath(path)!r} is no result of these cases "
                    f"(<device>__<dtype>__<case>.npz, a case of {os.fspath(cases_dir)!r})"
                )
            device, dtype, case_name = parts
            cell = cells.setdefault((backend, device, dtype), Cell(backend, device, dtype))
            results = _load(path)
            cell.cases += 1
            for check in compare(results, cases[case_name].reference, dtype):
                if check.quantity.startswith("grad."):
                    cell.gradient = _worse(cell.gradient, check)
                else:
                    cell.forward = _worse(cell.forward, check)
                if not check.passed:
                    cell.failures.append(
                        f"{case_name}: {check.quantity} max abs {check.max_abs:.3g} "
                        f"> {check.tolerance:g}"
                    )
            outputs.setdefault((backend, device, dtype), {})[case_name] = results["output"]
        for error in metas[backend].get("errors", []):
            cell = cells.setdefault((backend, "-", "-"), Cell(backend, "-", "-"))
            cell.failures.append(error.strip().splitlines()[0])
    for cell in cells.values():
        if cell.device != "-" and cell.cases < len(cases):
            cell.failures.append(f"{len(cases) - cell.cases} of {len(cases)} cases have no result")
    for backend in backends:
        ran = [(device, dtype) for device, dtype in metas[backend].get("cells", [])]
        if not any(key[0] == backend and key[1] != "-" for key in cells):
            ran = ran or [("-", "-")]  # (a run of no cell: none of its devices was there)
        for device, dtype in ran:
            if (backend, device, dtype) not in cells:
                cells[(backend, device, dtype)] = Cell(
                    backend, device, dtype, failures=["no results"]
                )
    missing = [b for b in expected_backends if b not in backends]
    for backend in missing:
        cells[(backend, "-", "-")] = Cell(backend, "-", "-", failures=["no results"])

    pairwise = []
    for (key_a, out_a), (key_b, out_b) in itertools.combinations(sorted(outputs.items()), 2):
        if key_a[1:] != key_b[1:]:
            continue  # pairs on the same device and dtype
        common = sorted(set(out_a) & set(out_b))
        if common:
            diff = max(errors(out_a[c], out_b[c])[0] for c in common)
            pairwise.append(
                {
                    "a": key_a[0],
                    "b": key_b[0],
                    "device": key_a[1],
                    "dtype": key_a[2],
                    "max_abs": diff,
                    "cases": len(common),
                }
            )
    workflow = _workflow(results_root, backends, cases["book"])
    importance = _importance(results_root, backends, cases)
    ordered = sorted(cells.values(), key=lambda c: (c.backend, c.device, _dtype_order(c.dtype)))
    return {
        "passed": bool(ordered)
        and all(c.passed for c in ordered)
        and all(w["passed"] for w in workflow)
        and all(row["passed"] for row in importance),
        "cells": [c.as_dict() for c in ordered],
        "pairwise": pairwise,
        "workflow": workflow,
        "importance": importance,
        "environments": metas,
        "cases": list(cases),
    }


def _workflow(results_root: Path, backends: Sequence[str], book: Case) -> list[dict]:
    """One ``.safetensors`` file in every backend: against the reference and pairwise."""
    outputs = {}
    for backend in backends:
        path = results_root / backend / "workflow.npy"
        if path.exists():
            outputs[backend] = np.load(path, allow_pickle=False)
    tol = tolerance("float32", "output")
    rows = []
    for backend, output in outputs.items():
        max_abs = errors(output, book.reference["output"])[0]
        others = [errors(output, other)[0] for name, other in outputs.items() if name != backend]
        pairwise = max(others, default=0.0)
        rows.append(
            {
                "backend": backend,
                "max_abs": max_abs,
                "max_pairwise": pairwise,
                "tolerance": tol,
                "passed": max_abs <= tol and pairwise <= tol,
            }
        )
    return rows


def _importance(
    results_root: Path, backends: Sequence[str], cases: Mapping[str, Case]
) -> list[dict]:
    """Each backend's ``head_importance``: against the reference and pairwise."""
    scores: dict[str, dict[str, np.ndarray]] = {}
    for backend in backends:
        path = results_root / backend / "importance.json"
        if path.exists():
            saved = json.loads(path.read_text())
            scores[backend] = {name: np.asarray(saved[name]) for name in saved}
    reference = {name: reference_importance(cases[name]) for name in IMPORTANCE_CASES}
    tol = tolerance("float32", "grad.head_mask")
    rows = []
    for backend, found in scores.items():
        max_abs = max(errors(found[n], reference[n])[0] for n in IMPORTANCE_CASES)
        pairwise = max(
            (
                errors(found[n], other[n])[0]
                for name, other in scores.items()
                if name != backend
                for n in IMPORTANCE_CASES
            ),
            default=0.0,
        )
        rows.append(
            {
                "backend": backend,
                "importance": {n: found[n].tolist() for n in IMPORTANCE_CASES},
                "max_abs": max_abs,
                "max_pairwise": pairwise,
                "tolerance": tol,
                "passed": max_abs <= tol and pairwise <= tol,
            }
        )
    return rows


def _dtype_order(dtype: str) -> int:
    order = ("float64", "float32", "bfloat16", "float16")
    return order.index(dtype) if dtype in order else len(order)


def _fmt(check: dict | None) -> str:
    if not check:
        return "-"
    return f"{check['max_abs']:.2e} / {check['max_rel']:.1e}"


def _section(title: str, text: Sequence[str], columns: Sequence[str]) -> list[str]:
    """The lines above a section's table rows: heading, text, column names, separator."""
    return [
        "",
        f"## {title}",
        "",
        *text,
        *([""] if text else []),
        "| " + " | ".join(columns) + " |",
        "|" + "---|" * len(columns),
    ]


def _verdict(passed: bool) -> str:
    return "pass" if passed else "**FAIL**"


def matrix_lines(cells: Sequence[dict]) -> list[str]:
    """The error matrix: a row per backend x device x dtype (the results page shows it too)."""
    lines = [
        "| backend | device | dtype | cases | forward | gradients | tolerance | result |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for cell in cells:
        tol = "-"
        if cell["forward"] and cell["gradient"]:
            tol = f"{cell['forward']['tolerance']:g} / {cell['gradient']['tolerance']:g}"
        lines.append(
            f"| {cell['backend']} | {cell['device']} | {cell['dtype']} | {cell['cases']} | "
            f"{_fmt(cell['forward'])} | {_fmt(cell['gradient'])} | {tol} | "
            f"{_verdict(cell['passed'])} |"
        )
    return lines


def format_markdown(report: dict[str, object]) -> str:
    """The report as Markdown (also what is printed)."""
    lines = [
        "# mha_multi parity report",
        "",
        f"Cases: {len(report['cases'])} ({', '.join(report['cases'])}).",
        "Errors are max abs / max rel against the float64 reference, worst over every case;",
        "forward covers the output of every code path and the attention weights,",
        "gradients cover queries, keys, values and every weight.",
        "",
        *matrix_lines(report["cells"]),
    ]
    if report["pairwise"]:
        lines += _section(
            "Backend vs backend (output, max abs)", [], ["a", "b", "device", "dtype", "max abs"]
        )
        for pair in report["pairwise"]:
            lines.append(
                f"| {pair['a']} | {pair['b']} | {pair['device']} | {pair['dtype']} | "
                f"{pair['max_abs']:.2e} |"
            )
    if report.get("workflow"):
        lines += _section(
            "One weights file, every backend",
            ["`book.safetensors` loaded with `load_weights` + `set_weights`, float32 on CPU:"],
            ["backend", "vs reference", "vs other backends (max)", "result"],
        )
        for row in report["workflow"]:
            lines.append(
                f"| {row['backend']} | {row['max_abs']:.2e} | {row['max_pairwise']:.2e} | "
                f"{_verdict(row['passed'])} |"
            )
    if report.get("importance"):
        first = report["importance"][0]["importance"]
        lines += _section(
            "Head importance, every backend",
            [
                "`head_importance` (normalized) of the weights of "
                + " and ".join(f"`{name}`" for name in first)
                + ", two batches, float32 on CPU; the first case's scores shown:"
            ],
            ["backend", "importance", "vs reference", "vs other backends (max)", "result"],
        )
        for row in report["importance"]:
            shown = next(iter(row["importance"].values()))
            lines.append(
                f"| {row['backend']} | {' '.join(f'{x:.4f}' for x in shown)} | "
                f"{row['max_abs']:.2e} | {row['max_pairwise']:.2e} | "
                f"{_verdict(row['passed'])} |"
            )
    lines += ["", "## Environments", ""]
    for backend, meta in report["environments"].items():
        versions = ", ".join(f"{k} {v}" for k, v in meta.get("versions", {}).items())
        devices = ", ".join(f"{k}: {v}" for k, v in meta.get("devices", {}).items())
        lines.append(f"- **{backend}**: {versions}; devices {devices}")
    failures = [(c, f) for c in report["cells"] for f in c["failures"]]
    if failures:
        lines += ["", "## Failures", ""]
        lines += [f"- {c['backend']} {c['device']} {c['dtype']}: {f}" for c, f in failures]
    lines += ["", "**PASS**" if report["passed"] else "**FAIL**", ""]
    return "\n".join(lines)

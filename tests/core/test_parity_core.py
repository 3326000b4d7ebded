"""The harness itself: case files, comparison, report verdicts."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mha_multi.parity.cases import (
    CACHED_CASES,
    CASES,
    WEIGHTS_FILE,
    build_case,
    load_cases,
    write_cases,
)
from mha_multi.parity.compare import compare
from mha_multi.parity.importance import IMPORTANCE_CASES, reference_importance
from mha_multi.parity.report import build_report, format_markdown
from mha_multi.parity.run import result_path
from mha_multi.weights import load_weights


@pytest.fixture(scope="module")
def case_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("cases")
    write_cases(directory)
    return directory


def test_case_files_round_trip_bit_exact(case_dir):
    loaded = {case.name: case for case in load_cases(case_dir)}
    assert list(loaded) == [config.name for config in CASES + CACHED_CASES]
    for config in CASES + CACHED_CASES:
        built, read = build_case(config), loaded[config.name]
        assert read.config == built.config
        for group in ("weights", "inputs", "reference"):
            a, b = getattr(built, group), getattr(read, group)
            assert a.keys() == b.keys()
            assert all(a[k].tobytes() == b[k].tobytes() and a[k].dtype == b[k].dtype for k in a)
        if built.valid_lens is None:
            assert read.valid_lens is None
        else:
            assert read.valid_lens.dtype == built.valid_lens.dtype
            np.testing.assert_array_equal(read.valid_lens, built.valid_lens)
    book = loaded["book"]
    weights = load_weights(case_dir / WEIGHTS_FILE)
    assert all(weights[k].tobytes() == book.weights[k].tobytes() for k in book.weights)


def test_book_case_is_d2l_example():
    book = build_case(CASES[0])
    assert book.inputs["queries"].shape == (2, 4, 100)
    assert book.inputs["keys"].shape == (2, 6, 100)
    assert book.reference["attention_weights"].shape == (2, 5, 4, 6)
    np.testing.assert_array_equal(book.valid_lens, [3, 2])


def test_compare_fails_on_nan_missing_and_large_errors():
    reference = {"output": np.ones((2, 2)), "grad.W_q": np.ones(3)}
    checks = {
        c.quantity: c for c in compare({"output": np.ones((2, 2)) + 1e-7}, reference, "float32")
    }
    assert checks["output"].passed and checks["output"].max_abs == pytest.approx(1e-7)
    assert not checks["grad.W_q"].passed  # missing from the results
    nan = compare({"output": np.full((2, 2), np.nan), "grad.W_q": np.ones(3)}, reference, "float32")
    assert not next(c for c in nan if c.quantity == "output").passed
    big = compare({"output": np.ones((2, 2)) * 1.1, "grad.W_q": np.ones(3)}, reference, "float64")
    assert not next(c for c in big if c.quantity == "output").passed


def _write_results(results_dir, backend, case, shift=0.0, dtype="float32"):
    path = result_path(results_dir, backend, "cpu", dtype, case.name)
    path.parent.mkdir(parents=True, exist_ok=True)
    results = {k: v + shift for k, v in case.reference.items()}
    results["output[weights]"] = case.reference["output"]
    np.savez(path, **results)


def test_report_verdicts(tmp_path, case_dir):
    cases = load_cases(case_dir)
    for case in cases:
        _write_results(tmp_path, "good", case)
        _write_results(tmp_path, "bad", case, shift=1e-3 if case.name == "lens_2d" else 0.0)
    _write_results(tmp_path, "partial", cases[0])
    report = build_report(tmp_path, case_dir, expected_backends=["good", "bad", "absent"])
    cells = {cell["backend"]: cell for cell in report["cells"]}
    assert cells["good"]["passed"]
    assert not cells["bad"]["passed"]
    assert any(f.startswith("lens_2d: ") for f in cells["bad"]["failures"])
    assert not cells["partial"]["passed"]  # 15 cases have no result
    assert cells["absent"]["failures"] == ["no results"]
    assert not report["passed"]
    pair = next(p for p in report["pairwise"] if {p["a"], p["b"]} == {"bad", "good"})
    assert pair["max_abs"] == pytest.approx(1e-3)
    markdown = format_markdown(report)
    assert "**FAIL**" in markdown and "lens_2d" in markdown
    good_only = build_report(tmp_path, case_dir, expected_backends=["good"])
    assert not good_only["passed"]  # the other backends' results are still there


def _write_run(results_dir, backend, case_dir, cells):
    """What a run writes besides its results: its meta (the cells it runs), the
    workflow's output and the heads' importance, each the reference's."""
    cases = {case.name: case for case in load_cases(case_dir)}
    directory = results_dir / backend
    directory.mkdir(parents=True, exist_ok=True)
    meta = {"backend": backend, "cells": [list(cell) for cell in cells], "errors": []}
    (directory / "meta.json").write_text(json.dumps(meta))
    np.save(directory / "workflow.npy", cases["book"].reference["output"])
    scores = {name: reference_importance(cases[name]).tolist() for name in IMPORTANCE_CASES}
    (directory / "importance.json").write_text(json.dumps(scores))


def test_report_passes_when_everything_is_within_tolerance(tmp_path, case_dir):
    for case in load_cases(case_dir):
        _write_results(tmp_path, "good", case)
        _write_results(tmp_path, "good", case, shift=1e-13, dtype="float64")
    _write_run(tmp_path, "good", case_dir, [("cpu", "float64"), ("cpu", "float32")])
    report = build_report(tmp_path, case_dir, expected_backends=["good"])
    assert report["passed"], format_markdown(report)
    assert [c["dtype"] for c in report["cells"]] == ["float64", "float32"]


def test_a_run_that_left_results_out_fails(tmp_path, case_dir):
    """A backend whose run made no result (a GPU-only run on a host without one), lost a
    cell the run made (its float64 results), or did not end (no meta, workflow or
    importance), fails, where the report passed every one."""
    cases = load_cases(case_dir)
    for case in cases:
        _write_results(tmp_path, "lost_a_cell", case)
        _write_results(tmp_path, "unfinished", case)
    _write_run(tmp_path, "no_device", case_dir, [])
    _write_run(tmp_path, "lost_a_cell", case_dir, [("cpu", "float64"), ("cpu", "float32")])
    report = build_report(
        tmp_path, case_dir, expected_backends=["no_device", "lost_a_cell", "unfinished"]
    )
    failures = {}
    for cell in report["cells"]:
        failures.setdefault(cell["backend"], []).extend(
            f"{cell['device']} {cell['dtype']}: {failure}" for failure in cell["failures"]
        )
    assert failures == {
        "lost_a_cell": ["cpu float64: no results"],
        "no_device": ["- -: no results"],
        "unfinished": ["- -: no meta.json, workflow.npy, importance.json: the run did not end"],
    }
    assert not report["passed"]


def test_the_command_names_bad_arguments_and_files_in_one_line(tmp_path, case_dir, capsys):
    """``python -m mha_multi.parity``: an unknown backend, a stray file among results, a
    file given as results to clean: one line on stderr and exit status 2, as ``python -m
    mha_multi`` reports them (tracebacks before, and clean removed nothing, said 0)."""
    from mha_multi.parity.__main__ import main

    stray = tmp_path / "results" / "torch" / "stray.npz"
    stray.parent.mkdir(parents=True)
    np.savez(stray, output=np.zeros(1))
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    commands = {
        "unknown backend 'bogus'": ["run", "--cases", str(case_dir), "--out", "o", "bogus"],
        "stray.npz' is no result of these cases": [
            "report",
            "--results",
            str(stray.parent.parent),
            "--cases",
            str(case_dir),
            "--out",
            str(tmp_path / "report"),
        ],
        "a_file' is no results directory": ["clean", str(a_file)],
    }
    for message, argv in commands.items():
        assert main(argv) == 2, argv
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("python -m mha_multi.parity: error: ")
        assert message in lines[0]
    assert a_file.exists()

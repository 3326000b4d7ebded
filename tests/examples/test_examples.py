"""Runs the documentation's code examples in the environment of their framework.

Every example is a script ``docs/examples/<framework>_<name>.py`` that asserts
its own claims (shapes, agreement with the float64 reference...). The
frameworks come from ``MHA_MULTI_BACKENDS``, the runner names a nox session
selects (``torch``, ``jax-nnx``, ``keras-tensorflow``, ``mxnet-hybrid``...):
a runner's framework is its name up to the first ``-``. An empty selection is
the framework-free environment, which runs the ``core`` examples. Examples of
frameworks that are not selected are not collected at all.
"""

from __future__ import annotations

import os
import runpy
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"
FRAMEWORKS = ("core", "torch", "jax", "keras", "mxnet")


def framework_of(path: Path) -> str:
    return path.stem.split("_", 1)[0]


def selected_frameworks() -> set[str]:
    runners = [n.strip() for n in os.environ.get("MHA_MULTI_BACKENDS", "").split(",")]
    runners = [n for n in runners if n]
    return {n.split("-", 1)[0] for n in runners} if runners else {"core"}


def selected_examples() -> list[Path]:
    frameworks = selected_frameworks()
    return [p for p in sorted(EXAMPLES.glob("*.py")) if framework_of(p) in frameworks]


def test_every_example_names_a_known_framework() -> None:
    paths = sorted(EXAMPLES.glob("*.py"))
    assert paths, f"no examples in {EXAMPLES}"
    unknown = [p.name for p in paths if framework_of(p) not in FRAMEWORKS]
    assert not unknown, f"examples must be named <framework>_<name>.py, {FRAMEWORKS}: {unknown}"


def test_every_selected_framework_has_examples() -> None:
    frameworks = selected_frameworks()
    assert frameworks <= set(FRAMEWORKS), f"unknown frameworks in MHA_MULTI_BACKENDS: {frameworks}"
    missing = frameworks - {framework_of(p) for p in selected_examples()}
    assert not missing, f"no examples for {sorted(missing)}"


@pytest.mark.parametrize("path", selected_examples(), ids=lambda p: p.name)
def test_example(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Examples that write files write them into a fresh directory.
    monkeypatch.chdir(tmp_path)
    runpy.run_path(str(path), run_name="__main__")

"""Comparison of backend results with the float64 reference, against the tolerances.

The tolerances and why they hold on any machine: docs, "Architecture".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass

import numpy as np

__all__ = ["TOLERANCES", "Check", "compare", "tolerance"]

#: Max abs error allowed against the float64 reference: (forward, gradients).
TOLERANCES: dict[str, tuple[float, float]] = {
    "float64": (1e-12, 1e-12),
    "float32": (5e-6, 5e-5),
    "bfloat16": (2e-2, 2e-2),
    "float16": (2e-2, 2e-2),
}


def tolerance(dtype: str, quantity: str) -> float:
    """The tolerance for ``quantity`` (``output``, ``grad.W_q``...) in ``dtype``."""
    forward, gradient = TOLERANCES[dtype]
    return gradient if quantity.startswith("grad.") else forward


@dataclass(frozen=True)
class Check:
    """One quantity of one result against its reference."""

    quantity: str
    max_abs: float
    max_rel: float
    tolerance: float

    @property
    def passed(self) -> bool:
        return bool(np.isfinite(self.max_abs)) and self.max_abs <= self.tolerance

    def as_dict(self) -> dict[str, object]:
        return {**asdict(self), "passed": self.passed}


def errors(actual: np.ndarray, expected: np.ndarray) -> tuple[float, float]:
    """``(max abs error, max abs error / max |expected|)``; NaN-aware (NaN is inf)."""
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    if actual.shape != expected.shape:
        raise ValueError(f"shape {actual.shape} differs from the reference {expected.shape}")
    if actual.size == 0:
        return 0.0, 0.0
    diff = np.abs(actual - expected)
    max_abs = float(np.inf if not np.all(np.isfinite(diff)) else diff.max())
    scale = float(np.abs(expected).max())
    return max_abs, (max_abs / scale if scale > 0 else max_abs)


def _reference_key(quantity: str) -> str:
    # Extra outputs of other code paths ("output[weights]") share the reference.
    return quantity.split("[", 1)[0]


def compare(
    results: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray], dtype: str
) -> list[Check]:
    """Checks every quantity of ``results`` against ``reference``.

    A reference quantity that no result covers fails with an infinite error:
    a runner that forgets a gradient must not pass by omission.

    Raises:
        KeyError: a result has no reference (a runner reporting something
            the case cannot check is a harness bug, not a pass).
    """
    checks = []
    for quantity, actual in sorted(results.items()):
        expected = reference[_reference_key(quantity)]
        max_abs, max_rel = errors(actual, expected)
        checks.append(Check(quantity, max_abs, max_rel, tolerance(dtype, quantity)))
    covered = {_reference_key(quantity) for quantity in results}
    for quantity in sorted(set(reference) - covered):
        checks.append(Check(quantity, np.inf, np.inf, tolerance(dtype, quantity)))
    return checks

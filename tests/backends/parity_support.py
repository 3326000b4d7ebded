"""What the parity tests of ``tests/backends`` share: a case run and checked."""

from __future__ import annotations

import pytest

from mha_multi.parity.cases import Case
from mha_multi.parity.compare import Check, compare
from mha_multi.parity.runners import Runner


def checks_within_tolerance(runner: Runner, device: str, dtype: str, case: Case) -> list[Check]:
    """The checks of ``case`` run on ``device`` in ``dtype``, each within its tolerance.

    Skips where the runner does not run ``dtype`` on ``device``; fails naming
    every quantity over its tolerance.
    """
    if not runner.dtype_supported(device, dtype):
        pytest.skip(f"{runner.name} does not run {dtype} on {device}")
    checks = compare(runner.run(case, device=device, dtype=dtype), case.reference, dtype)
    failures = [c for c in checks if not c.passed]
    assert not failures, "\n".join(
        f"{c.quantity}: max abs {c.max_abs:.3g} > {c.tolerance:g}" for c in failures
    )
    return checks

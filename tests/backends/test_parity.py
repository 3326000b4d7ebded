"""Every backend on every parity case, device and dtype, against the float64 reference."""

from __future__ import annotations

import pytest

from mha_multi.parity.cases import CASES
from mha_multi.parity.compare import compare
from mha_multi.parity.runners import DTYPES


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case_name", [c.name for c in CASES])
def test_case_within_tolerance(runner, available_device, dtype, case_name, cases):
    if not runner.dtype_supported(available_device, dtype):
        pytest.skip(f"{runner.name} does not run {dtype} on {available_device}")
    case = cases[case_name]
    checks = compare(runner.run(case, device=available_device, dtype=dtype), case.reference, dtype)
    failures = [c for c in checks if not c.passed]
    assert not failures, "\n".join(
        f"{c.quantity}: max abs {c.max_abs:.3g} > {c.tolerance:g}" for c in failures
    )
    # Every quantity of the reference was checked: outputs, weights, gradients.
    assert {c.quantity.split("[")[0] for c in checks} == set(case.reference)

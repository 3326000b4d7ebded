"""Every backend on every parity case, device and dtype, against the float64 reference."""

from __future__ import annotations

import pytest
from parity_support import checks_within_tolerance

from mha_multi.parity.cases import CASES
from mha_multi.parity.runners import DTYPES


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case_name", [c.name for c in CASES])
def test_case_within_tolerance(runner, available_device, dtype, case_name, cases):
    case = cases[case_name]
    checks = checks_within_tolerance(runner, available_device, dtype, case)
    # Every quantity of the reference was checked: outputs, weights, gradients.
    assert {c.quantity.split("[")[0] for c in checks} == set(case.reference)

"""Every backend's ``head_importance`` equals the float64 reference importance
(docs: "Heads"), so the same batches and loss rank the heads alike in every
framework."""

from __future__ import annotations

import numpy as np
import pytest

from mha_multi.parity.compare import tolerance
from mha_multi.parity.importance import (
    IMPORTANCE_CASES,
    reference_importance,
    runner_importance,
)


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("case_name", IMPORTANCE_CASES)
def test_head_importance_is_the_reference_importance(runner, cases, case_name, normalize):
    case = cases[case_name]
    expected = reference_importance(case, normalize=normalize)
    got = runner_importance(runner, case, normalize=normalize)
    assert got.shape == (case.config.num_heads,)
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, expected, rtol=0, atol=tolerance("float32", "grad.head_mask"))
    # The ranking the pruning follows, where the reference separates the heads.
    assert np.argmax(got) == np.argmax(expected)
    if normalize:
        assert np.linalg.norm(got) == pytest.approx(1.0, abs=1e-6)

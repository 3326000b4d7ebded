"""What the Keras tests share: the runner of the process's Keras backend, a
case's inputs, and the warning Keras' own numpy conversions raise.

Imported by the test modules after ``pytest.importorskip("keras")``; not a
``conftest.py``, whose module name would shadow the root one that other
test folders import from.
"""

from __future__ import annotations

import numpy as np
import pytest

from mha_multi.keras import harness as backend
from mha_multi.parity.cases import Case
from mha_multi.parity.runners import Runner, get_runner

#: Keras' own numpy conversions (``Layer.get_weights``, ``predict``...) call
#: ``np.array`` on framework arrays whose ``__array__`` predates numpy 2's
#: copy keyword.
COPY_KEYWORD_WARNING = pytest.mark.filterwarnings(
    "ignore:__array__ implementation doesn't accept a copy keyword:DeprecationWarning"
)


@pytest.fixture(scope="session", name="runner")
def keras_runner() -> Runner:
    """The parity runner of the Keras backend this process runs (``KERAS_BACKEND``).

    Whatever other backends ``MHA_MULTI_BACKENDS`` selects for
    ``tests/backends``: these tests are Keras'.
    """
    return get_runner(f"keras-{backend.BACKEND}")


def inputs(case: Case) -> list[np.ndarray]:
    """The case's queries, keys and values."""
    return [case.inputs[name] for name in backend.INPUT_NAMES]

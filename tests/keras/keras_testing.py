"""What the Keras tests share: the runner of the process's Keras backend, a
case's inputs, the warning Keras' own numpy conversions raise, and the
fused kernel taken and watched.

Imported by the test modules after ``pytest.importorskip("keras")``; not a
``conftest.py``, whose module name would shadow the root one that other
test folders import from.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

import mha_multi.keras._kernel as kernel_module
from mha_multi.parity.cases import Case
from mha_multi.parity.harness import keras as backend
from mha_multi.parity.runners import Runner, get_runner

#: Keras' own numpy conversions (``Layer.get_weights``, ``predict``...) call
#: ``np.array`` on framework arrays whose ``__array__`` predates numpy 2's
#: copy keyword.
COPY_KEYWORD_WARNING = pytest.mark.filterwarnings(
    "ignore:__array__ implementation doesn't accept a copy keyword:DeprecationWarning"
)


@pytest.fixture
def eager_flow(monkeypatch: pytest.MonkeyPatch) -> None:
    """Eager calls run the eager flow, operation by operation, on every backend: no
    call plan compiles them (Keras on JAX's, :mod:`mha_multi.keras._call_plan`), so
    that a test may watch what that flow does."""
    from mha_multi.keras._frameworks import active

    monkeypatch.setattr(type(active()), "compile_call", None)


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


@pytest.fixture(name="fused_here")
def fused_kernel_here(monkeypatch):
    """The default call takes the kernel on this backend, whatever the benchmark chose."""
    monkeypatch.setattr(kernel_module, "FUSED_BACKENDS", frozenset({backend.BACKEND}))


def kernel_key_heads(monkeypatch) -> list[int]:
    """Records the key heads of every call of the fused kernel."""
    key_heads = []
    original = kernel_module.dot_product_attention

    @functools.wraps(original)  # its signature, which the kernel spy reads
    def recording(query, key, value, *args, **kwargs):
        key_heads.append(int(key.shape[2]))
        return original(query, key, value, *args, **kwargs)

    monkeypatch.setattr(kernel_module, "dot_product_attention", recording)
    return key_heads

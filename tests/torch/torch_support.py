"""What the PyTorch layer's and cache's test modules share: the runner, ``torch.compile``, spies.

A module takes a fixture by importing it (``from torch_support import runner as
runner``): pytest finds fixtures among a module's names, and the explicit
re-export tells the linter that the name is meant. (A ``conftest.py`` here would
take the name ``conftest`` from the root one, whose helpers the tests import.)
"""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
import torch

from mha_multi.parity.runners import get_runner

#: The ``torch.compile`` backend of tests whose claim is the trace (one graph, guards,
#: shapes taken as symbols, functionalized writes): dynamo's and AOTAutograd's graph, run
#: by eager kernels. Inductor's own numbers are the tests' that compile with it; each of
#: its graphs takes seconds of code generation on a 2-core machine.
TRACED = "aot_eager"


@pytest.fixture(scope="module")
def runner():
    """The PyTorch parity runner alone (the shared ``runner`` takes every selected backend)."""
    return get_runner("torch")


@pytest.fixture
def compiler():
    """``torch.compile`` with dynamo's caches emptied.

    Every layer shares ``forward``'s code object, whose compilations are
    limited per process; the tests compile it for many shapes.
    """
    torch._dynamo.reset()
    yield torch.compile
    torch._dynamo.reset()


def kernel_ran(run):
    """``run()``, and whether SDPA ran in it, as PyTorch's profiler records its ops."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        result = run()
    return result, any("scaled_dot_product" in event.key for event in profile.key_averages())


def sdpa_spy():
    """``scaled_dot_product_attention`` wrapped, so that its operands can be read."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    return mock.patch.object(torch.nn.functional, "scaled_dot_product_attention", wraps=sdpa)


def assert_same_nonfinite_pattern(got, expected):
    """NaN and infinities where ``expected`` has them, and its finite numbers elsewhere."""
    for test in (np.isnan, np.isposinf, np.isneginf):
        np.testing.assert_array_equal(test(got), test(expected))
    finite = np.isfinite(expected)
    np.testing.assert_allclose(got[finite], expected[finite], rtol=0, atol=5e-6)


def draw_norm_weights(weights, layer, rng):
    """``layer``'s query/key norms' weights drawn around 1 into ``weights`` (a scale of
    ones would hide one applied twice or left out), from ``rng``."""
    for name in ("q_norm", "k_norm"):
        shape = tuple(getattr(layer, name).shape)
        weights[name] = (1.0 + 0.25 * rng.standard_normal(shape)).astype(np.float32)

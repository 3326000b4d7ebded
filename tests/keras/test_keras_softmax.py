"""The generic path's softmax in Keras, on each backend (docs: "Fast paths").

Its weights are the float64 softmax's (the spec's numpy formula, apart from the
code under test), NaN exactly where it is NaN, whether or not the scores may
hold hidden keys' (``hides``). On PyTorch's CPU, scores that may hide keys
are floored before ``exp`` (PyTorch's generic path's floor, whose gradients
its own tests hold to the float64 softmax's): a hidden key weighs exactly 0,
and a layer's call with lengths takes that way.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

keras = pytest.importorskip("keras")

from mha_multi import spec  # noqa: E402
from mha_multi.keras import MultiHeadAttention, get_weights  # noqa: E402
from mha_multi.keras._framework_ops import framework_ops  # noqa: E402
from mha_multi.keras._ops import OPS  # noqa: E402
from mha_multi.parity.compare import TOLERANCES  # noqa: E402
from mha_multi.parity.harness import keras as backend  # noqa: E402

ON_TORCH = keras.backend.backend() == "torch"
#: Offsets from a row's maximum: about float32's and float64's floors and past them.
OFFSETS = [0.0, -1.0, -80.0, -86.5, -87.0, -88.0, -100.0, -707.0, -709.0, -800.0]


def scores_of_every_kind() -> np.ndarray:
    """Rows of far scores and the spec's hidden one, and rows holding non-finite ones."""
    far = np.array([*OFFSETS, spec.MASK_VALUE]) + 3.0
    rows = [far, far[::-1], far - 1e4, np.random.default_rng(0).standard_normal(far.size)]
    rows += [np.full(far.size, 0.5) for _ in range(5)]
    rows[4][-1] = math.nan
    rows[5][0] = math.inf
    rows[6][:] = -math.inf
    rows[7][3] = -math.inf
    rows[8][:] = 3e38  # (the float32 maximum's neighbours: the shift keeps them finite)
    return np.stack(rows)


@pytest.mark.filterwarnings("ignore:Explicitly requested dtype float64:UserWarning")
@pytest.mark.parametrize("hides", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_weights_are_the_float64_softmaxs(dtype, hides):
    scores = scores_of_every_kind()
    with np.errstate(invalid="ignore", over="ignore"):
        exact = spec.NumpyOps().softmax(scores)
    given = keras.ops.cast(backend.to_native(scores, dtype="float64"), dtype)
    weights = OPS.softmax(given, hides=hides)
    got = backend.to_numpy(weights).astype(np.float64)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(exact))
    forward, _ = TOLERANCES[keras.backend.standardize_dtype(weights.dtype)]
    np.testing.assert_allclose(got, exact, rtol=0, atol=forward)
    assert (got[[0, 1, 2], [-1, 0, -1]] == 0).all()  # (the hidden key's)


@pytest.mark.skipif(not ON_TORCH, reason="the floor is PyTorch's (its CPU exp)")
def test_scores_that_may_hide_keys_are_floored_on_pytorchs_cpu(monkeypatch):
    """``hides`` takes the floor; so does a layer's call whose lengths hide keys (the
    float64 reference's output), and a call that hides none does not."""
    import torch

    native = framework_ops()
    floored, floor = [], native.floored_exp

    def watched(shifted):
        floored.append(tuple(shifted.shape))
        return floor(shifted)

    monkeypatch.setattr(native, "floored_exp", watched)
    scores = torch.randn(2, 3, 5)
    OPS.softmax(scores)
    assert floored == []
    OPS.softmax(scores, hides=True)
    assert floored == [(2, 3, 5)]

    floored.clear()
    layer = MultiHeadAttention(16, 2)
    x, lengths = torch.randn(3, 4, 16), torch.tensor([4, 2, 1])
    out, _ = layer(x, x, x, lengths, return_attention_weights=True)
    assert floored == [(3, 2, 4, 4)]
    expected, _ = spec.reference_forward(
        get_weights(layer), *(x.double().numpy(),) * 3, lengths.numpy(), num_heads=2
    )
    np.testing.assert_allclose(
        out.detach().double().numpy(), expected, rtol=0, atol=TOLERANCES["float32"][0]
    )
    floored.clear()
    layer(x, x, x, return_attention_weights=True)
    assert floored == []

"""The generic path's softmax in Keras, on each backend (docs: "Fast paths").

Its weights are the float64 softmax's (the spec's numpy formula, apart from the
code under test), NaN exactly where it is NaN, for few scores and for many. On
PyTorch, Keras' layer softmaxes as PyTorch's generic path does (``torch.softmax``,
or on a CPU short rows of many scores by the floored formula, whose gradients
PyTorch's own tests hold to the float64 softmax's): a hidden key weighs exactly 0,
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
@pytest.mark.parametrize("copies", [1, 11])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_weights_are_the_float64_softmaxs(dtype, copies):
    """Few scores, and (``copies``) their rows repeated past PyTorch's ``FEW_SCORES``."""
    scores = np.tile(scores_of_every_kind(), (copies, 1))
    with np.errstate(invalid="ignore", over="ignore"):
        exact = spec.NumpyOps().softmax(scores)
    given = keras.ops.cast(backend.to_native(scores, dtype="float64"), dtype)
    weights = OPS.softmax(given)
    got = backend.to_numpy(weights).astype(np.float64)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(exact))
    forward, _ = TOLERANCES[keras.backend.standardize_dtype(weights.dtype)]
    np.testing.assert_allclose(got, exact, rtol=0, atol=forward)
    assert (got[[0, 1, 2], [-1, 0, -1]] == 0).all()  # (the hidden key's)


@pytest.mark.skipif(not ON_TORCH, reason="PyTorch's generic path's softmax")
def test_a_layer_on_pytorch_softmaxes_as_pytorchs_generic_path(monkeypatch):
    """A call with lengths that hide keys softmaxes its scores by PyTorch's own
    generic path's softmax (the float64 reference's output), to its bits."""
    import torch

    from mha_multi.torch._ops import FEW_SCORES, softmax

    native = framework_ops()
    taken = []

    def watched(scores):
        taken.append(tuple(scores.shape))
        return softmax(scores)

    monkeypatch.setattr(native, "torch_softmax", watched)
    for rows in (2, FEW_SCORES):
        scores = torch.randn(rows, 5, dtype=torch.float64)
        assert torch.equal(OPS.softmax(scores), softmax(scores))
    assert taken == [(2, 5), (FEW_SCORES, 5)]

    taken.clear()
    layer = MultiHeadAttention(16, 2)
    x, lengths = torch.randn(3, 4, 16), torch.tensor([4, 2, 1])
    out, _ = layer(x, x, x, lengths, return_attention_weights=True)
    assert taken == [(3, 2, 4, 4)]
    expected, _ = spec.reference_forward(
        get_weights(layer), *(x.double().numpy(),) * 3, lengths.numpy(), num_heads=2
    )
    np.testing.assert_allclose(
        out.detach().double().numpy(), expected, rtol=0, atol=TOLERANCES["float32"][0]
    )

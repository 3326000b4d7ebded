"""The generic path's softmax in PyTorch (docs: "Fast paths").

Rows shorter than ``SHORT_ROWS`` on a CPU, ``FEW_SCORES`` scores or more in
all, are softmaxed by the formula's own operations, fewer scores by
``torch.softmax``: the float64 softmax's numbers and gradients (computed here
in numpy, apart from the code under test), NaN exactly where it is NaN, for
rows on both sides of each threshold; and a layer's attention weights over so
few keys are the float64 reference's.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mha_multi import spec
from mha_multi.parity.compare import TOLERANCES
from mha_multi.torch import MultiHeadAttention, get_weights
from mha_multi.torch._ops import FEW_SCORES, SHORT_ROWS, softmax

#: Row lengths about the threshold, and far from it.
LENGTHS = [1, 2, 7, SHORT_ROWS - 1, SHORT_ROWS, SHORT_ROWS + 1, 40]


#: Few scores (``torch.softmax``), or their rows repeated to ``FEW_SCORES`` or more
#: (the formula's, where the rows are short).
MANY = [False, True]


def tiled(scores: torch.Tensor, many: bool) -> torch.Tensor:
    """``scores``, or where ``many`` its rows repeated along the first axis until there
    are ``FEW_SCORES`` or more."""
    if not many:
        return scores
    copies = -(-FEW_SCORES // scores.numel())
    return scores.repeat(copies, *([1] * (scores.dim() - 1)))


def reference(scores: np.ndarray) -> np.ndarray:
    """The float64 softmax of each row, by IEEE arithmetic: NaN across a row that holds
    a NaN or +inf, or that -inf hides whole."""
    with np.errstate(invalid="ignore", over="ignore"):
        shifted = scores - scores.max(axis=-1, keepdims=True)
        exps = np.exp(shifted)
        return exps / exps.sum(axis=-1, keepdims=True)


def assert_the_float64_softmax(scores: torch.Tensor) -> torch.Tensor:
    """Checks the weights of ``scores`` and their gradient against the float64 softmax's,
    within the parity tolerances of ``scores``' dtype; returns the weights."""
    given = scores.detach().requires_grad_()
    weights = softmax(given)
    upstream = torch.randn_like(weights)
    weights.backward(upstream)
    exact = reference(given.detach().double().numpy())
    # The softmax's gradient, y * (g - sum(g * y)), from the float64 weights.
    g = upstream.double().numpy()
    exact_gradient = exact * (g - (g * exact).sum(axis=-1, keepdims=True))
    forward, backward = TOLERANCES["float32" if scores.dtype == torch.float32 else "float64"]
    np.testing.assert_allclose(weights.detach().double().numpy(), exact, rtol=0, atol=forward)
    np.testing.assert_allclose(given.grad.double().numpy(), exact_gradient, rtol=0, atol=backward)
    return weights.detach()


@pytest.mark.parametrize("many", MANY)
@pytest.mark.parametrize("num_keys", LENGTHS)
@pytest.mark.parametrize("scale", [1.0, 30.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_short_and_long_rows_are_the_float64_softmax(num_keys, scale, dtype, many):
    torch.manual_seed(num_keys)
    scores = torch.randn(3, 4, 5, num_keys, dtype=torch.float64) * scale
    assert_the_float64_softmax(tiled(scores, many).to(dtype))


@pytest.mark.parametrize("many", MANY)
@pytest.mark.parametrize("num_keys", LENGTHS)
def test_non_finite_rows_are_nan_where_the_float64_softmaxs_are(num_keys, many):
    """A NaN or +inf score makes its row NaN; -inf scores weigh nothing, and a row hidden
    whole by them is NaN; the other rows keep their numbers."""
    scores = torch.randn(7, num_keys, dtype=torch.float64)
    scores[0, -1] = math.nan
    scores[1, 0] = math.inf
    scores[2, :] = -math.inf
    scores[3, 0] = -math.inf
    scores[4, -1] = -math.inf
    scores[5, :] = 3e38  # (the float32 maximum's neighbours: the shift keeps them finite)
    scores = tiled(scores, many)
    exact = reference(scores.numpy())
    for dtype in (torch.float32, torch.float64):
        weights = softmax(scores.to(dtype)).double().numpy()
        np.testing.assert_array_equal(np.isnan(weights), np.isnan(exact))
        np.testing.assert_allclose(weights, exact, rtol=0, atol=1e-6)


@pytest.mark.parametrize("many", MANY)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_far_and_hidden_scores_weigh_what_the_float64_softmaxs_do(dtype, many):
    """Scores far below a row's maximum, about each dtype's floor and past it, and the
    spec's hidden score: the float64 softmax's weights and gradients, a hidden key's
    weight exactly 0, with a gradient recorded or not."""
    offsets = [0.0, -1.0, -80.0, -86.5, -87.0, -88.0, -100.0, -707.0, -709.0, -800.0]
    scores = torch.tensor([*offsets, spec.MASK_VALUE], dtype=torch.float64) + 3.0
    scores = tiled(torch.stack([scores, scores.flip(0), scores - 1e4]), many)
    given = scores.to(dtype)
    weights = assert_the_float64_softmax(given)
    hidden = given == given.amin(-1, keepdim=True)
    assert (weights[hidden] == 0).all()
    # Without a gradient the floor is taken another way, to the same bits.
    assert torch.equal(softmax(given), weights)


@pytest.mark.parametrize("many", MANY)
def test_non_finite_rows_have_nan_gradients(many):
    """A NaN score makes its row's gradient NaN, as the float64 softmax's; a +inf score's
    own gradient is NaN; finite rows keep finite gradients."""
    scores = torch.randn(4, 10, dtype=torch.float64)
    scores[0, 3] = math.nan
    scores[1, 2] = math.inf
    scores[2, :] = -math.inf
    scores = tiled(scores, many)
    for dtype in (torch.float32, torch.float64):
        given = scores.to(dtype).requires_grad_()
        softmax(given).backward(torch.ones_like(given))
        grad = given.grad
        assert grad[0].isnan().all() and grad[2].isnan().all() and grad[1, 2].isnan()
        assert grad[3].isfinite().all()


def test_no_keys_give_no_weights():
    scores = torch.zeros(2, 3, 0)
    assert softmax(scores).shape == (2, 3, 0)


@pytest.mark.parametrize("num_keys", [1, 10, SHORT_ROWS - 1, SHORT_ROWS + 1])
def test_a_layers_weights_over_few_keys_are_the_references(num_keys):
    """The generic path (asked for the attention weights), with lengths that hide keys and
    one that hides every key: the float64 reference's output and weights."""
    torch.manual_seed(num_keys)
    layer = MultiHeadAttention(16, 4, bias=True)
    x, memory = torch.randn(3, 5, 16), torch.randn(3, num_keys, 16)
    valid_lens = torch.tensor([num_keys, max(num_keys // 2, 1), 0])
    with torch.no_grad():
        out, weights = layer(x, memory, memory, valid_lens, return_attention_weights=True)
    expected, expected_weights = spec.reference_forward(
        get_weights(layer),
        x.double().numpy(),
        memory.double().numpy(),
        memory.double().numpy(),
        valid_lens.numpy(),
        num_heads=4,
    )
    forward, _ = TOLERANCES["float32"]
    np.testing.assert_allclose(out.double().numpy(), expected, rtol=0, atol=forward)
    np.testing.assert_allclose(weights.double().numpy(), expected_weights, rtol=0, atol=forward)

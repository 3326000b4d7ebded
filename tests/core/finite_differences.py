"""Central differences of a scalar loss, against hand-derived gradients."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np


def assert_central_differences(
    grads: Mapping[str, np.ndarray],
    arrays: Mapping[str, np.ndarray],
    loss: Callable[[], float],
    *,
    rng: np.random.Generator,
    entries: int,
    step: float = 1e-6,
    atol: float = 1e-7,
) -> None:
    """Each gradient against ``(loss(x + step) - loss(x - step)) / (2 step)`` at a few entries.

    ``loss`` reads ``arrays``, which are stepped in place (and restored) at
    ``entries`` random entries of each (a 0-d array as a whole).
    """
    for name, grad in grads.items():
        array = arrays[name]
        assert grad.shape == np.shape(array), name
        for flat in rng.choice(array.size, size=min(entries, array.size), replace=False):
            index = np.unravel_index(flat, array.shape)
            original = array[index]
            array[index] = original + step
            plus = loss()
            array[index] = original - step
            minus = loss()
            array[index] = original
            numeric = (plus - minus) / (2 * step)
            assert abs(numeric - grad[index]) < atol, (name, index, numeric, grad[index])

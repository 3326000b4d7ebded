"""The arrays of a Keras attention layer's projections: read from the layer, checked as a state.

Part of :mod:`mha_multi.interop.keras`: ``keras.layers.MultiHeadAttention``
and ``keras.layers.GroupQueryAttention`` both hold ``EinsumDense``
projections, stored as ``<sublayer>/kernel`` and ``<sublayer>/bias`` arrays.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from mha_multi.keras import _facts
from mha_multi.weights import check_state_mapping


def _kernels_of_state(
    state: Mapping[str, Any], names: Mapping[str, str], layer: str
) -> tuple[dict[str, np.ndarray], bool]:
    """The kernels of a Keras attention layer's arrays, and whether it has biases.

    Args:
        state: ``<sublayer>/kernel`` and ``<sublayer>/bias`` arrays.
        names: the layer's sublayer names.
        layer: the layer's class name, for messages.

    Raises:
        ValueError: an unexpected entry, a missing kernel, or biases on some
            projections only.
    """
    check_state_mapping(state, "state")
    expected = {f"{name}/{kind}" for name in names for kind in ("kernel", "bias")}
    extra = sorted(set(state) - expected)
    if extra:
        raise ValueError(f"unexpected keras.layers.{layer} entries: {extra}")
    missing = [f"{name}/kernel" for name in names if f"{name}/kernel" not in state]
    if missing:
        raise ValueError(f"keras.layers.{layer} weights are missing {missing}")
    with_bias = [name for name in names if f"{name}/bias" in state]
    if with_bias and len(with_bias) != len(names):
        raise ValueError(
            f"unsupported: biases on some projections only ({', '.join(with_bias)}); "
            "the canonical layer has biases on all four or on none"
        )
    return {name: np.asarray(state[f"{name}/kernel"]) for name in names}, bool(with_bias)


def _projection_state(projections: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """``<name>/kernel`` and, where there is one, ``<name>/bias`` of each projection, as numpy."""
    state = {}
    for name, dense in projections.items():
        state[f"{name}/kernel"] = _facts.host_array(dense.kernel)
        if dense.bias is not None:
            state[f"{name}/bias"] = _facts.host_array(dense.bias)
    return state

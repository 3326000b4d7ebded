"""Parity runners for :mod:`mha_multi.jax` (Flax NNX) and :mod:`mha_multi.jax.linen`;
they drive the layers through :mod:`mha_multi.parity.harness.jax`.

The default call takes the generic path on a CPU (docs: "Fast paths"), so
``fused_kernel`` is ``None``; the fused path runs where a layer asks for
``implementation="xla"`` or ``"cudnn"``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from mha_multi.parity.harness.jax import LinenLayer
from mha_multi.parity.runners import Runner


class JaxNNXRunner(Runner):
    name = "jax-nnx"
    distributions = ("jax", "jaxlib", "flax")
    package = "mha_multi.jax"
    harness = "mha_multi.parity.harness.jax"
    fused_kernel = None
    reads_shortest_length = False


class JaxLinenRunner(JaxNNXRunner):
    """The Linen module with its variables beside it (``harness.LinenLayer``)."""

    name = "jax-linen"

    def make_layer(self, num_hiddens: int, num_heads: int, **kwargs: Any) -> LinenLayer:
        return self.facts.linen_layer(num_hiddens, num_heads, **kwargs)

    def set_weights(self, layer: LinenLayer, weights: Mapping[str, np.ndarray]) -> LinenLayer:
        return layer.set_weights(weights)

    def get_weights(self, layer: LinenLayer) -> dict[str, np.ndarray]:
        return layer.get_weights()

    def call_as_given(self, layer: LinenLayer, *args: Any, **kwargs: Any) -> Any:
        return layer.module.apply(layer.variables, *args, **kwargs)

    def head_importance(self, layer: LinenLayer, *args: Any, **kwargs: Any) -> np.ndarray:
        return super().head_importance((layer.module, layer.variables), *args, **kwargs)

"""Parity runners for :mod:`mha_multi.mxnet`: imperative (``mxnet``) and hybridized
(``mxnet-hybrid``); what drives the layer is in :mod:`mha_multi.parity.harness.mxnet`.

MXNet 1.9's numpy interface has no bfloat16, so :meth:`MXNetRunner.dtype_supported`
declines it and those parity tests show as skips. float16 runs on the CPU too: the
layer takes its matrix products in float32 on every device (MXNet 1.9 has float16
products only on GPUs).
"""

from __future__ import annotations

from typing import Any

from mha_multi.mxnet import MultiHeadAttention
from mha_multi.mxnet._kernel import SEQUENCE_MASK
from mha_multi.parity.runners import Runner


class MXNetRunner(Runner):
    """Drives the layer imperatively (Gluon's default, not hybridized)."""

    name = "mxnet"
    distributions = ("mxnet", "mxnet-cu112", "mxnet-cu110")
    package = "mha_multi.mxnet"
    harness = "mha_multi.parity.harness.mxnet"
    fused_kernel = SEQUENCE_MASK
    keeps_rotary_tables = True
    # The plan is made from shapes and flags only: a hybridized graph is
    # built per configuration, not per length.
    reads_shortest_length = False
    hybridize = False

    def versions(self) -> dict[str, str]:
        found = super().versions()
        return {name: v for name, v in found.items() if v != "not installed"} or found

    def make_layer(self, num_hiddens: int, num_heads: int, **kwargs: Any) -> MultiHeadAttention:
        return self.facts.make_layer(num_hiddens, num_heads, hybridize=self.hybridize, **kwargs)


class MXNetHybridRunner(MXNetRunner):
    """Drives the hybridized layer (cached graphs)."""

    name = "mxnet-hybrid"
    hybridize = True

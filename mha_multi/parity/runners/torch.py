"""Parity runner for :mod:`mha_multi.torch`; it drives the layer through
:mod:`mha_multi.parity.harness.torch`."""

from __future__ import annotations

from mha_multi.parity.runners import Runner
from mha_multi.torch._kernel import SDPA


class TorchRunner(Runner):
    name = "torch"
    distributions = ("torch",)
    package = "mha_multi.torch"
    harness = "mha_multi.parity.harness.torch"
    fused_kernel = SDPA
    # The layer reads the shortest length before it plans, so lengths that
    # hide nothing need no mask.
    reads_shortest_length = True
    passes_options = True
    keeps_rotary_tables = True

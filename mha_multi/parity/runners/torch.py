"""Parity runner for :mod:`mha_multi.torch`; PyTorch's facts are in its ``_backend``."""

from __future__ import annotations

from mha_multi.parity.runners import Runner
from mha_multi.torch import _backend as backend
from mha_multi.torch.layer import SDPA


class TorchRunner(Runner):
    name = "torch"
    distributions = ("torch",)
    package = "mha_multi.torch"
    fused_kernel = SDPA
    # The layer reads the shortest length before it plans, so lengths that
    # hide nothing need no mask.
    reads_shortest_length = True

    def __init__(self) -> None:
        backend.exact_float32()

    def device_available(self, device: str) -> bool:
        return device == "cpu" or (device == "gpu" and backend.gpu_available())

    # The framework's facts, as its backend module gives them.
    device_description = staticmethod(backend.device_description)
    make_layer = staticmethod(backend.make_layer)
    to_native = staticmethod(backend.to_native)
    to_numpy = staticmethod(backend.to_numpy)
    native_lens = staticmethod(backend.lens_to_native)
    forward = staticmethod(backend.forward)
    vjp = staticmethod(backend.vjp)
    kernel_spy = staticmethod(backend.kernel_spy)

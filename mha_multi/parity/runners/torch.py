"""Parity runner for :mod:`mha_multi.torch`; PyTorch's facts are in its ``_backend``."""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
import torch

from mha_multi.parity.runners import KernelCall, Runner
from mha_multi.torch import MultiHeadAttention
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

    def device_description(self, device: str) -> str:
        return backend.device_description(device)

    def make_layer(self, num_hiddens: int, num_heads: int, **kwargs: Any) -> MultiHeadAttention:
        return backend.make_layer(num_hiddens, num_heads, **kwargs)

    def to_native(self, x: np.ndarray, device: str = "cpu", dtype: str = "float32") -> torch.Tensor:
        return backend.to_native(x, device, dtype)

    def to_numpy(self, x: torch.Tensor) -> np.ndarray:
        return backend.to_numpy(x)

    def native_lens(self, valid_lens: Any, device: str = "cpu") -> Any:
        return backend.lens_to_native(valid_lens, device)

    def forward(self, layer: MultiHeadAttention, *args: Any, **kwargs: Any) -> Any:
        return backend.forward(layer, *args, **kwargs)

    def vjp(self, layer: MultiHeadAttention, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return backend.vjp(layer, *args, **kwargs)

    def kernel_spy(self) -> contextlib.AbstractContextManager[list[KernelCall]]:
        return backend.kernel_spy()

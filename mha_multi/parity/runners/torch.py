"""Parity runner for :mod:`mha_multi.torch`."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from mha_multi.parity.runners import Runner, as_float64, is_numeric
from mha_multi.torch import MultiHeadAttention
from mha_multi.weights import KERNEL_NAMES

DTYPES = {
    "float64": torch.float64,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def exact_matmuls() -> None:
    """IEEE float32 matmuls and single-rounding 16-bit ones on GPU (docs: "Architecture").

    TF32 off for float32 parity. cuBLAS may add up split-K partial sums of
    16-bit GEMMs in 16 bits unless told not to; the layer leaves these
    process-wide settings to its caller, and parity asks for the products
    accumulated in float32 and rounded once.
    """
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False


class TorchRunner(Runner):
    name = "torch"
    distributions = ("torch",)
    package = "mha_multi.torch"

    def __init__(self) -> None:
        exact_matmuls()

    def device_available(self, device: str) -> bool:
        return device == "cpu" or (device == "gpu" and torch.cuda.is_available())

    def device_description(self, device: str) -> str:
        return torch.cuda.get_device_name() if device == "gpu" else "cpu"

    def _device(self, device: str) -> torch.device:
        return torch.device("cuda" if device == "gpu" else "cpu")

    def to_native(self, x: np.ndarray, device: str = "cpu", dtype: str = "float32") -> torch.Tensor:
        return torch.from_numpy(np.array(x, copy=True)).to(self._device(device), DTYPES[dtype])

    def _lens(self, valid_lens: Any, device: str) -> Any:
        if is_numeric(valid_lens):
            return torch.from_numpy(np.array(valid_lens, copy=True)).to(self._device(device))
        return valid_lens

    def make_layer(
        self,
        num_hiddens: int,
        num_heads: int,
        *,
        device: str = "cpu",
        dtype: str = "float32",
        **kwargs: Any,
    ) -> MultiHeadAttention:
        return MultiHeadAttention(
            num_hiddens, num_heads, device=self._device(device), dtype=DTYPES[dtype], **kwargs
        )

    def call(
        self,
        layer: MultiHeadAttention,
        queries: np.ndarray,
        keys: np.ndarray,
        values: np.ndarray,
        valid_lens: Any = None,
        *,
        training: bool = False,
        device: str = "cpu",
        dtype: str = "float32",
        **kwargs: Any,
    ) -> Any:
        layer.train(training)
        tensors = [self.to_native(x, device, dtype) for x in (queries, keys, values)]
        with torch.no_grad():
            result = layer(*tensors, self._lens(valid_lens, device), **kwargs)
        if isinstance(result, tuple):
            return tuple(as_float64(r.double().cpu()) for r in result)
        return as_float64(result.double().cpu())

    def gradients(
        self,
        layer: MultiHeadAttention,
        queries: np.ndarray,
        keys: np.ndarray,
        values: np.ndarray,
        valid_lens: Any,
        *,
        causal: bool,
        output_gradient: np.ndarray,
        device: str,
        dtype: str,
    ) -> dict[str, np.ndarray]:
        layer.eval()
        layer.zero_grad(set_to_none=True)
        inputs = [
            self.to_native(x, device, dtype).requires_grad_(True) for x in (queries, keys, values)
        ]
        output = layer(*inputs, self._lens(valid_lens, device), causal=causal)
        output.backward(self.to_native(output_gradient, device, dtype))
        grads = {
            name: as_float64(t.grad.double().cpu())
            for name, t in zip(("queries", "keys", "values"), inputs, strict=True)
        }
        for name in KERNEL_NAMES:
            linear = getattr(layer, name)
            grads[name] = as_float64(linear.weight.grad.T.double().cpu())
            if linear.bias is not None:
                grads[f"b_{name[-1]}"] = as_float64(linear.bias.grad.double().cpu())
        return grads

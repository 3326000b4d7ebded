"""Parity runners for :mod:`mha_multi.mxnet`: imperative (``mxnet``) and hybridized
(``mxnet-hybrid``).

MXNet 1.9's numpy interface has no bfloat16 (``mxnet.numpy`` rejects the
dtype name), so :meth:`MXNetRunner.dtype_supported` declines it and those
parity tests show as skips. float16 runs on the CPU too: the layer takes its
matrix products in float32 on every device (MXNet 1.9 has float16 products
only on GPUs).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

# Float32 parity needs IEEE float32 products on GPUs (docs: "Architecture"): no silent
# conversion to tensor-core math. This is MXNet's default; it is pinned here
# before MXNet reads it.
os.environ.setdefault("MXNET_CUDA_TENSOR_OP_MATH_ALLOW_CONVERSION", "0")

import mxnet as mx
from mxnet import autograd

from mha_multi.mxnet import MultiHeadAttention
from mha_multi.parity.runners import Runner, as_float64, is_numeric
from mha_multi.weights import KERNEL_NAMES

#: dtypes MXNet 1.9's numpy interface has (no bfloat16).
DTYPES = ("float64", "float32", "float16")
#: Numeric dtypes of ``mxnet.numpy`` arrays (no unsigned integers beyond uint8).
LENS_DTYPES = ("float64", "float32", "float16", "int64", "int32", "int8", "uint8")


class MXNetRunner(Runner):
    """Drives the layer imperatively (Gluon's default, not hybridized)."""

    name = "mxnet"
    distributions = ("mxnet", "mxnet-cu112", "mxnet-cu110")
    package = "mha_multi.mxnet"
    hybridize = False

    def device_available(self, device: str) -> bool:
        return device == "cpu" or (device == "gpu" and mx.context.num_gpus() > 0)

    def dtype_supported(self, device: str, dtype: str) -> bool:
        return dtype in DTYPES

    def device_description(self, device: str) -> str:
        return str(self._ctx(device))

    def versions(self) -> dict[str, str]:
        found = super().versions()
        return {name: v for name, v in found.items() if v != "not installed"} or found

    def _ctx(self, device: str) -> mx.Context:
        return mx.gpu(0) if device == "gpu" else mx.cpu()

    def to_native(
        self, x: np.ndarray, device: str = "cpu", dtype: str = "float32"
    ) -> mx.np.ndarray:
        return mx.np.array(np.asarray(x, dtype=dtype), dtype=dtype, ctx=self._ctx(device))

    def _lens(self, valid_lens: Any, device: str) -> Any:
        if is_numeric(valid_lens):
            if np.dtype(valid_lens.dtype).name not in LENS_DTYPES:
                # As a user must: MXNet has no such arrays; the layer takes numpy ones.
                return valid_lens
            return mx.np.array(valid_lens, dtype=valid_lens.dtype, ctx=self._ctx(device))
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
        layer = MultiHeadAttention(num_hiddens, num_heads, dtype=dtype, **kwargs)
        # Zeros: every use here loads weights next; the parameters (or their
        # deferred initialization) are placed on the device now.
        layer.initialize(mx.init.Zero(), ctx=self._ctx(device))
        if self.hybridize:
            layer.hybridize()
        return layer

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
        arrays = [self.to_native(x, device, dtype) for x in (queries, keys, values)]
        lens = self._lens(valid_lens, device)
        if training:
            with autograd.record(train_mode=True):
                result = layer(*arrays, lens, **kwargs)
        else:
            result = layer(*arrays, lens, **kwargs)
        if isinstance(result, tuple):
            return tuple(as_float64(r.asnumpy()) for r in result)
        return as_float64(result.asnumpy())

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
        inputs = [self.to_native(x, device, dtype) for x in (queries, keys, values)]
        for array in inputs:
            array.attach_grad()
        with autograd.record(train_mode=False):
            output = layer(*inputs, self._lens(valid_lens, device), causal=causal)
        output.backward(self.to_native(output_gradient, device, dtype))
        grads = {
            name: as_float64(array.grad.asnumpy())
            for name, array in zip(("queries", "keys", "values"), inputs, strict=True)
        }
        ctx = self._ctx(device)
        for name in KERNEL_NAMES:
            dense = getattr(layer, name)
            grads[name] = as_float64(dense.weight.grad(ctx).asnumpy().T)
            if dense.bias is not None:
                grads[f"b_{name[-1]}"] = as_float64(dense.bias.grad(ctx).asnumpy())
        return grads


class MXNetHybridRunner(MXNetRunner):
    """Drives the hybridized layer (cached graphs)."""

    name = "mxnet-hybrid"
    hybridize = True

"""PyTorch benchmark: ours (fused and generic) vs ``torch.nn.MultiheadAttention``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from mha_multi.bench.common import Shape
from mha_multi.bench.driver import Framework, score_bytes
from mha_multi.interop.torch import key_padding_mask
from mha_multi.torch import _backend as backend
from mha_multi.torch import set_weights
from mha_multi.weights import init_weights


class Torch(Framework):
    """Forward passes under ``torch.inference_mode``; the native layer gets the
    key padding as ``key_padding_mask`` (``True`` = hidden)."""

    name = "torch"

    def setup(self) -> None:
        backend.exact_float32()

    def devices(self) -> list[str]:
        return ["cpu"] + (["gpu"] if backend.gpu_available() else [])

    def describe(self, device: str, execution: str | None) -> str:
        return backend.device_description(device)

    def versions(self) -> dict[str, str]:
        return {"torch": torch.__version__}

    def array(self, value: np.ndarray, device: str, dtype: str) -> torch.Tensor:
        return backend.to_native(value, device, dtype)

    def matmul(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.matmul(a, b)

    def convert(
        self, x: np.ndarray, lens: np.ndarray, visible: np.ndarray, device: str, dtype: str
    ) -> tuple[torch.Tensor, ...]:
        padding = key_padding_mask(lens, x.shape[1]).to(backend.device(device))
        return self.array(x, device, dtype), backend.lens_to_native(lens, device), padding

    def build(self, shape: Shape, device: str, dtype: str) -> dict[str, Any]:
        d, h = shape.num_hiddens, shape.num_heads
        weights = init_weights(d)  # both layers hold the same weights
        ours = backend.make_layer(
            d, h, query_size=d, key_size=d, value_size=d, device=device, dtype=dtype
        )
        ours = set_weights(ours, weights).eval()
        native = backend.native_layer(weights, h, device=device, dtype=dtype)
        return {
            "ours": (ours, lambda x, lens, padding: ours(x, x, x, lens)),
            "ours (generic)": (
                ours,
                lambda x, lens, padding: ours(x, x, x, lens, return_attention_weights=True)[0],
            ),
            "native": (
                native,
                lambda x, lens, padding: native(
                    x, x, x, key_padding_mask=padding, need_weights=False
                )[0],
            ),
        }

    def step(self, impl: Any, args: Any, mode: str, execution: str | None) -> Callable[[], Any]:
        module, call = impl
        x, *rest = args
        if mode == "forward":

            def forward() -> torch.Tensor:
                with torch.inference_mode():
                    return call(x, *rest)

            return forward

        def forward_backward() -> torch.Tensor | None:
            inputs = x.detach().requires_grad_(True)
            call(inputs, *rest).float().sum().backward()
            module.zero_grad(set_to_none=True)
            return inputs.grad

        return forward_backward

    def sync(self, value: Any) -> None:
        backend.sync(value)

    def scratch_bytes(
        self, implementation: str, shape: Shape, dtype: str, device: str, *, training: bool
    ) -> int:
        # Only the generic path materialises (B*H, N, N) arrays: scores,
        # masked scores and weights.
        return score_bytes(shape, 3, dtype) if implementation == "ours (generic)" else 0

    def peak_mib(self, device: str, run: Callable[[], None]) -> float:
        if device != "gpu":
            return super().peak_mib(device, run)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        run()
        return (torch.cuda.max_memory_allocated() - before) / 2**20


FRAMEWORK = Torch()

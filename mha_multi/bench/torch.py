"""PyTorch benchmark: ours (fused and generic) vs ``torch.nn.MultiheadAttention``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from mha_multi.bench.common import Shape
from mha_multi.bench.driver import Framework, score_bytes
from mha_multi.torch import MultiHeadAttention

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class Torch(Framework):
    """Forward passes under ``torch.inference_mode``; the native layer gets the
    key padding as ``key_padding_mask`` (``True`` = hidden)."""

    name = "torch"

    def setup(self) -> None:
        torch.set_float32_matmul_precision("highest")

    def devices(self) -> list[str]:
        return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

    def describe(self, device: str, execution: str | None) -> str:
        return torch.cuda.get_device_name() if device == "cuda" else device

    def versions(self) -> dict[str, str]:
        return {"torch": torch.__version__}

    def array(self, value: np.ndarray, device: str, dtype: str) -> torch.Tensor:
        return torch.from_numpy(value).to(device, DTYPES[dtype])

    def matmul(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.matmul(a, b)

    def convert(
        self, x: np.ndarray, lens: np.ndarray, visible: np.ndarray, device: str, dtype: str
    ) -> tuple[torch.Tensor, ...]:
        padding = torch.from_numpy(~visible).to(device)
        return self.array(x, device, dtype), torch.from_numpy(lens).to(device), padding

    def build(self, shape: Shape, device: str, dtype: str) -> dict[str, Any]:
        d, h = shape.num_hiddens, shape.num_heads
        kwargs = {"device": device, "dtype": DTYPES[dtype]}
        ours = MultiHeadAttention(d, h, query_size=d, key_size=d, value_size=d, **kwargs).eval()
        native = torch.nn.MultiheadAttention(d, h, bias=False, batch_first=True, **kwargs).eval()
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
        if isinstance(value, torch.Tensor) and value.is_cuda:
            torch.cuda.synchronize()

    def scratch_bytes(
        self, implementation: str, shape: Shape, dtype: str, device: str, *, training: bool
    ) -> int:
        # Only the generic path materialises (B*H, N, N) arrays: scores,
        # masked scores and weights.
        return score_bytes(shape, 3, dtype) if implementation == "ours (generic)" else 0

    def peak_mib(self, device: str, run: Callable[[], None]) -> float:
        if device != "cuda":
            return super().peak_mib(device, run)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        run()
        return (torch.cuda.max_memory_allocated() - before) / 2**20


FRAMEWORK = Torch()

"""What several JAX test files build: runners whose layers take JAX-only
options, a case's inputs as JAX arrays, the GPU, a fused kernel that leaves
NaN where nothing is seen."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import pytest

from conftest import device_or_skip
from mha_multi.parity.cases import Case
from mha_multi.parity.harness import jax as backend
from mha_multi.parity.runners.jax import JaxLinenRunner, JaxNNXRunner


class _WithOptions:
    """A runner whose layers get ``options`` (``implementation``, ``dropout``,
    ``precision``...) besides the case's configuration."""

    def __init__(self, **options: Any) -> None:
        super().__init__()
        self.options = options
        self.name = f"{self.name}[{', '.join(f'{k}={v!r}' for k, v in options.items())}]"

    def make_layer(self, num_hiddens: int, num_heads: int, **kwargs: Any) -> Any:
        return super().make_layer(num_hiddens, num_heads, **kwargs, **self.options)


class NNXRunner(_WithOptions, JaxNNXRunner):
    """The NNX runner with layer options."""


class LinenRunner(_WithOptions, JaxLinenRunner):
    """The Linen runner with layer options."""


def inputs(case: Case, dtype: str = "float32", device: str = "cpu") -> list[jax.Array]:
    """The case's queries, keys and values as JAX arrays."""
    return [backend.to_native(case.inputs[name], device, dtype) for name in backend.INPUT_NAMES]


def gpu() -> str:
    """``"gpu"`` where JAX sees one; skips the test otherwise (fails it where one is required)."""
    return device_or_skip("gpu", backend.gpu_available(), "no GPU visible to JAX")


def nan_where_nothing_is_seen(monkeypatch: pytest.MonkeyPatch) -> None:
    """Makes the kernel leave NaN in every row its mask hides, as cuDNN's flash kernel may."""
    original = jax.nn.dot_product_attention

    def kernel(q, k, v, *, mask=None, **kwargs):
        out = original(q, k, v, mask=mask, **kwargs)
        if mask is None:
            return out
        mask = mask if mask.ndim == 4 else mask[None, None]
        seen = jnp.transpose(jnp.any(mask, axis=-1), (0, 2, 1))[..., None]  # (B|1, Q|1, 1, 1)
        return jnp.where(seen, out, jnp.nan)

    monkeypatch.setattr(jax.nn, "dot_product_attention", kernel)

"""Where Keras' tensors live and how exactly their products are taken, on the active backend."""

from __future__ import annotations

import contextlib
from typing import Any

import keras

from mha_multi.keras._frameworks import active

# (In the order defined: devices, then precision.)
__all__ = [
    "gpu_available",
    "device_description",
    "device_scope",
    "device_of",
    "exact_float32",
    "enable_float64",
]

Tensor = Any


def gpu_available() -> bool:
    """Whether the framework under Keras sees a GPU."""
    return active().gpu_available()


def device_description(name: str) -> str:
    """The device as reports name it: the GPU's model, or ``"cpu"``.

    Args:
        name: ``"cpu"`` or ``"gpu"``.
    """
    return active().gpu_name() if name == "gpu" else "cpu"


def device_scope(name: str) -> contextlib.AbstractContextManager[Any]:
    """Creates tensors and variables on ``name`` (``"cpu"`` or ``"gpu"``) while active.

    No device index: Keras on PyTorch turns variables created under
    ``"cpu:0"`` into plain tensors (its Parameter is moved with ``.to()``).
    """
    return keras.device(name)


def device_of(x: Tensor) -> str:
    """``"gpu"`` or ``"cpu"``: where the tensor ``x`` lives."""
    return active().device_of(x)


def exact_float32() -> None:
    """IEEE float32 products on GPU: TF32 off, or the highest matmul precision.

    Process-wide settings the layer leaves to its caller (docs: "Architecture").
    """
    active().exact_float32()


def enable_float64() -> None:
    """float64 arrays, which JAX gives only with ``jax_enable_x64``."""
    active().enable_float64()

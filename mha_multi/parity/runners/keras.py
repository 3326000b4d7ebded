"""Parity runners for :mod:`mha_multi.keras`, one per Keras backend.

They drive the layer through :mod:`mha_multi.parity.harness.keras`; Keras' facts,
those of each backend included, are in its ``_facts``.
Keras picks its backend once per process from ``KERAS_BACKEND``; each nox
environment sets it. A runner whose backend is not the active one raises
``ImportError`` when created, so it counts as unavailable in the wrong
environment.
"""

from __future__ import annotations

from typing import Any, ClassVar

import keras

from mha_multi import spec
from mha_multi.keras import _facts
from mha_multi.keras._kernel import DOT_PRODUCT_ATTENTION, FUSED_BACKENDS
from mha_multi.parity.runners import Runner

__all__ = ["KerasJaxRunner", "KerasRunner", "KerasTensorFlowRunner", "KerasTorchRunner"]


def fused_kernel_on(keras_backend: str) -> spec.FusedKernel | None:
    """The kernel a default call may plan for on ``keras_backend``."""
    return DOT_PRODUCT_ATTENTION if keras_backend in FUSED_BACKENDS else None


class KerasRunner(Runner):
    """The layer on the active Keras backend."""

    package = "mha_multi.keras"
    harness = "mha_multi.parity.harness.keras"
    keeps_rotary_tables = True
    #: ``keras.backend.backend()`` this runner needs.
    keras_backend: ClassVar[str]

    def __init__(self) -> None:
        if self.keras_backend != _facts.BACKEND:
            raise ImportError(
                f"{self.name} needs KERAS_BACKEND={self.keras_backend}; "
                f"this process runs Keras on {_facts.BACKEND!r}"
            )
        super().__init__()
        _facts.enable_float64()

    def inner_product(self, a: Any, b: Any) -> Any:
        # A TensorFlow tensor has no ``.sum()``; keras.ops serves every backend.
        return keras.ops.sum(a * b)


class KerasTensorFlowRunner(KerasRunner):
    name = "keras-tensorflow"
    keras_backend = "tensorflow"
    distributions = ("keras", "tensorflow")
    fused_kernel = fused_kernel_on(keras_backend)


class KerasJaxRunner(KerasRunner):
    name = "keras-jax"
    keras_backend = "jax"
    distributions = ("keras", "jax", "jaxlib")
    fused_kernel = fused_kernel_on(keras_backend)


class KerasTorchRunner(KerasRunner):
    name = "keras-torch"
    keras_backend = "torch"
    distributions = ("keras", "torch")
    fused_kernel = fused_kernel_on(keras_backend)

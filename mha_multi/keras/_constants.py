"""Where an eager Keras call's constants land, per backend: the key its rotary tables are kept by.

A call's rotary tables are made from constants (``keras.ops.convert_to_tensor``)
and kept for later calls of the same signature
(:mod:`mha_multi.call.rotary_tables`). They are the numbers a call would make
only where they are made on the same device, so the key names it: the
backend's device scope where it decides (TensorFlow's, JAX's default device)
and the tensor's own device. Nothing is kept for a traced tensor
(:func:`mha_multi.keras._frameworks.values_readable`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mha_multi.keras._first_use import made_on_first_use
from mha_multi.keras._frameworks import BACKEND, values_readable

__all__ = ["constants_key"]

Tensor = Any


def _tensorflow_place() -> Callable[[Tensor], Any]:
    # The eager context's device scope (tf.device, keras.device), which places
    # the constants' operations; no public function reads it.
    from tensorflow.python.eager import context

    def place(x: Tensor) -> Any:
        return context.context().device_name, x.device

    return place


def _jax_place() -> Callable[[Tensor], Any]:
    import jax

    def place(x: Tensor) -> Any:
        # (keras.device is jax.default_device: where constants land.)
        return jax.config.jax_default_device, x.sharding

    return place


def _torch_place() -> Callable[[Tensor], Any]:
    import torch

    def place(x: Tensor) -> Any:
        device = x.device
        if device.type == "meta":  # a symbolic call's (Keras' compute_output_spec)
            return None
        # Tables made in inference mode cannot be saved for a backward pass.
        return device, torch.is_inference_mode_enabled()

    return place


@made_on_first_use
def _place() -> Callable[[Tensor], Any]:
    # Made on first use, not at import: the documentation imports this module
    # against mocked frameworks, where there is no backend to look up.
    return {"tensorflow": _tensorflow_place, "jax": _jax_place, "torch": _torch_place}[BACKEND]()


def constants_key(x: Tensor) -> Any:
    """Where constants made for an eager call on ``x`` land, or ``None`` where ``x``
    is traced (:meth:`mha_multi.call.Facts.constants_key`)."""
    return _place()(x) if values_readable(x) else None

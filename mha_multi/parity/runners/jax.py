"""Parity runners for :mod:`mha_multi.jax` (Flax NNX) and :mod:`mha_multi.jax.linen`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mha_multi.jax import MultiHeadAttention, linen
from mha_multi.parity.runners import Runner, is_numeric
from mha_multi.weights import KERNEL_NAMES

DTYPES = {
    "float64": jnp.float64,
    "float32": jnp.float32,
    "bfloat16": jnp.bfloat16,
    "float16": jnp.float16,
}


def configure() -> None:
    """float64 needs x64; float32 parity needs IEEE matmuls on GPU (docs: "Architecture")."""
    jax.config.update("jax_enable_x64", True)
    jax.config.update("jax_default_matmul_precision", "highest")


def as_float64(x: Any) -> np.ndarray:
    return np.asarray(jax.device_get(x)).astype(np.float64)


class _JaxRunner(Runner):
    """What the NNX and Linen runners share: devices, conversions."""

    distributions = ("jax", "jaxlib", "flax")
    package = "mha_multi.jax"

    def __init__(self) -> None:
        configure()

    def device_available(self, device: str) -> bool:
        if device == "cpu":
            return True
        try:
            return bool(jax.devices("gpu"))
        except RuntimeError:
            return False

    def device_description(self, device: str) -> str:
        return self._device(device).device_kind

    def _device(self, device: str) -> jax.Device:
        return jax.devices("gpu" if device == "gpu" else "cpu")[0]

    def to_native(self, x: np.ndarray, device: str = "cpu", dtype: str = "float32") -> jax.Array:
        return jax.device_put(np.asarray(x).astype(np.dtype(DTYPES[dtype])), self._device(device))

    def _lens(self, valid_lens: Any, device: str) -> Any:
        if is_numeric(valid_lens):
            return jax.device_put(np.asarray(valid_lens), self._device(device))
        return valid_lens

    def _inputs(self, arrays: tuple[np.ndarray, ...], device: str, dtype: str) -> list[jax.Array]:
        return [self.to_native(x, device, dtype) for x in arrays]


def _results(result: Any) -> Any:
    if isinstance(result, tuple):
        return tuple(as_float64(r) for r in result)
    return as_float64(result)


class JaxNNXRunner(_JaxRunner):
    name = "jax-nnx"

    def make_layer(
        self,
        num_hiddens: int,
        num_heads: int,
        *,
        device: str = "cpu",
        dtype: str = "float32",
        **kwargs: Any,
    ) -> MultiHeadAttention:
        with jax.default_device(self._device(device)):
            return MultiHeadAttention(
                num_hiddens, num_heads, param_dtype=DTYPES[dtype], rngs=nnx.Rngs(0), **kwargs
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
        if training:
            layer.train()
        else:
            layer.eval()
        arrays = self._inputs((queries, keys, values), device, dtype)
        return _results(layer(*arrays, self._lens(valid_lens, device), **kwargs))

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
        graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
        lens = self._lens(valid_lens, device)

        def forward(params: nnx.State, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
            return nnx.merge(graphdef, params, rest)(q, k, v, lens, causal=causal)

        arrays = self._inputs((queries, keys, values), device, dtype)
        _, vjp = jax.vjp(forward, params, *arrays)
        param_grads, *input_grads = vjp(self.to_native(output_gradient, device, dtype))
        grads = {
            name: as_float64(g)
            for name, g in zip(("queries", "keys", "values"), input_grads, strict=True)
        }
        pure = nnx.to_pure_dict(param_grads)
        for name in KERNEL_NAMES:
            grads[name] = as_float64(pure[name]["kernel"])
            if layer.bias:
                grads[f"b_{name[-1]}"] = as_float64(pure[name]["bias"])
        return grads


@dataclass
class LinenLayer:
    """A Linen module with its variables and the rng that feeds its dropout."""

    module: linen.MultiHeadAttention
    variables: dict[str, Any] | None
    device: jax.Device
    rng: jax.Array

    def next_rng(self) -> jax.Array:
        self.rng, key = jax.random.split(self.rng)
        return key


class JaxLinenRunner(_JaxRunner):
    name = "jax-linen"

    def make_layer(
        self,
        num_hiddens: int,
        num_heads: int,
        *,
        device: str = "cpu",
        dtype: str = "float32",
        **kwargs: Any,
    ) -> LinenLayer:
        module = linen.MultiHeadAttention(
            num_hiddens, num_heads, param_dtype=DTYPES[dtype], **kwargs
        )
        layer = LinenLayer(module, None, self._device(device), jax.random.key(0))
        sizes = (module.query_size, module.key_size, module.value_size)
        if all(size is not None for size in sizes):
            shapes = [jnp.zeros((1, 1, size), DTYPES[dtype]) for size in sizes]
            with jax.default_device(layer.device):
                layer.variables = module.init(layer.next_rng(), *shapes)
        return layer

    def set_weights(self, layer: LinenLayer, weights: Mapping[str, np.ndarray]) -> LinenLayer:
        variables = linen.variables_from_weights(weights, layer.module)
        layer.variables = jax.device_put(variables, layer.device)
        return layer

    def get_weights(self, layer: LinenLayer) -> dict[str, np.ndarray]:
        if layer.variables is None:
            raise ValueError("the layer has no variables yet: call init or set its weights")
        return linen.weights_from_variables(layer.variables)

    def call(
        self,
        layer: LinenLayer,
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
        arrays = self._inputs((queries, keys, values), device, dtype)
        rngs = {"dropout": layer.next_rng()} if training else {}
        result = layer.module.apply(
            layer.variables,
            *arrays,
            self._lens(valid_lens, device),
            training=training,
            rngs=rngs,
            **kwargs,
        )
        return _results(result)

    def call_as_given(self, layer: LinenLayer, *args: Any, **kwargs: Any) -> Any:
        return layer.module.apply(layer.variables, *args, **kwargs)

    def gradients(
        self,
        layer: LinenLayer,
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
        lens = self._lens(valid_lens, device)

        def forward(variables: Any, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
            return layer.module.apply(variables, q, k, v, lens, causal=causal)

        arrays = self._inputs((queries, keys, values), device, dtype)
        _, vjp = jax.vjp(forward, layer.variables, *arrays)
        variable_grads, *input_grads = vjp(self.to_native(output_gradient, device, dtype))
        grads = {
            name: as_float64(g)
            for name, g in zip(("queries", "keys", "values"), input_grads, strict=True)
        }
        params = variable_grads["params"]
        for name in KERNEL_NAMES:
            grads[name] = as_float64(params[name]["kernel"])
            if layer.module.bias:
                grads[f"b_{name[-1]}"] = as_float64(params[name]["bias"])
        return grads

"""Parity runners for :mod:`mha_multi.jax` (Flax NNX) and :mod:`mha_multi.jax.linen`.

Eager JAX compiles every operation anew for every new shape, and the
test-suite and the parity cases bring many shapes: so the runners build
layers and run evaluation calls and gradients through ``jax.jit`` (one
compilation per configuration and shape, cached across layers of the same
configuration). A runner with ``jit = False`` calls everything eagerly, and
anything a compiled call cannot take as an argument (training with dropout,
non-numeric ``valid_lens``, a ``causal`` that is not a bool, meant to meet
the layer's own checks) is called eagerly too.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

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
    """float64 needs x64; float32 parity needs IEEE matmuls on GPU (DESIGN §5)."""
    jax.config.update("jax_enable_x64", True)
    jax.config.update("jax_default_matmul_precision", "highest")


def as_float64(x: Any) -> np.ndarray:
    return np.asarray(jax.device_get(x)).astype(np.float64)


def _compilable(valid_lens: Any, kwargs: Mapping[str, Any]) -> bool:
    """Whether a call can go through ``jax.jit`` and still meet the layer's checks.

    ``valid_lens`` must be ``None`` or an array (non-numeric ones must reach
    the layer's own ``TypeError``), and the keyword arguments hashable
    Python values with ``causal`` a bool (an array would fail as a static
    argument before the layer could say what is wrong with it).
    """
    if valid_lens is not None and not isinstance(valid_lens, jax.Array):
        return False
    if not isinstance(kwargs.get("causal", False), bool):
        return False
    return all(isinstance(value, (bool, int, float, str, type(None))) for value in kwargs.values())


@functools.partial(nnx.jit, static_argnames=("num_hiddens", "num_heads", "param_dtype", "options"))
def _new_nnx_layer(
    num_hiddens: int, num_heads: int, param_dtype: Any, options: tuple[tuple[str, Any], ...]
) -> MultiHeadAttention:
    return MultiHeadAttention(
        num_hiddens, num_heads, param_dtype=param_dtype, rngs=nnx.Rngs(0), **dict(options)
    )


@functools.partial(nnx.jit, static_argnames=("options",))
def _nnx_call(
    layer: MultiHeadAttention, *arrays: jax.Array | None, options: tuple[tuple[str, Any], ...]
) -> Any:
    return layer(*arrays, **dict(options))


@functools.partial(jax.jit, static_argnames=("graphdef", "causal"))
def _nnx_vjp(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    rest: nnx.State,
    arrays: tuple[jax.Array, ...],
    valid_lens: jax.Array | None,
    output_gradient: jax.Array,
    causal: bool,
) -> tuple[Any, ...]:
    """The cotangents of the parameters and the three inputs (eval mode)."""

    def forward(params: nnx.State, *arrays: jax.Array) -> jax.Array:
        return nnx.merge(graphdef, params, rest)(*arrays, valid_lens, causal=causal)

    _, vjp = jax.vjp(forward, params, *arrays)
    return vjp(output_gradient)


@functools.partial(jax.jit, static_argnames=("module",))
def _linen_init(module: linen.MultiHeadAttention, rng: jax.Array, *shapes: jax.Array) -> Any:
    return module.init(rng, *shapes)


@functools.partial(jax.jit, static_argnames=("module", "options"))
def _linen_apply(
    module: linen.MultiHeadAttention,
    variables: Any,
    *arrays: jax.Array | None,
    options: tuple[tuple[str, Any], ...],
) -> Any:
    return module.apply(variables, *arrays, **dict(options))


@functools.partial(jax.jit, static_argnames=("module", "causal"))
def _linen_vjp(
    module: linen.MultiHeadAttention,
    variables: Any,
    arrays: tuple[jax.Array, ...],
    valid_lens: jax.Array | None,
    output_gradient: jax.Array,
    causal: bool,
) -> tuple[Any, ...]:
    """The cotangents of the variables and the three inputs."""

    def forward(variables: Any, *arrays: jax.Array) -> jax.Array:
        return module.apply(variables, *arrays, valid_lens, causal=causal)

    _, vjp = jax.vjp(forward, variables, *arrays)
    return vjp(output_gradient)


def _hashable(value: Any) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


# The same functions called eagerly (``jit = False``).
_nnx_vjp_eager = _nnx_vjp.__wrapped__
_linen_vjp_eager = _linen_vjp.__wrapped__
_linen_init_eager = _linen_init.__wrapped__


class _JaxRunner(Runner):
    """What the NNX and Linen runners share: devices, conversions."""

    distributions = ("jax", "jaxlib", "flax")
    package = "mha_multi.jax"
    #: Whether layers are built and called through ``jax.jit`` (see the module notes).
    jit: ClassVar[bool] = True

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
        options = tuple(sorted(kwargs.items()))
        with jax.default_device(self._device(device)):
            if self.jit and _hashable(options):
                return _new_nnx_layer(num_hiddens, num_heads, DTYPES[dtype], options)
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
        lens = self._lens(valid_lens, device)
        if self.jit and not training and _compilable(lens, kwargs):
            return _results(_nnx_call(layer, *arrays, lens, options=tuple(sorted(kwargs.items()))))
        return _results(layer(*arrays, lens, **kwargs))

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
        arrays = tuple(self._inputs((queries, keys, values), device, dtype))
        cotangent = self.to_native(output_gradient, device, dtype)
        vjp = _nnx_vjp if self.jit and _compilable(lens, {"causal": causal}) else _nnx_vjp_eager
        param_grads, *input_grads = vjp(graphdef, params, rest, arrays, lens, cotangent, causal)
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
            with jax.default_device(layer.device):
                shapes = [jnp.zeros((1, 1, size), DTYPES[dtype]) for size in sizes]
                init = _linen_init if self.jit else _linen_init_eager
                layer.variables = init(module, layer.next_rng(), *shapes)
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
        lens = self._lens(valid_lens, device)
        if self.jit and not training and _compilable(lens, kwargs):
            options = tuple(sorted(kwargs.items()))
            return _results(
                _linen_apply(layer.module, layer.variables, *arrays, lens, options=options)
            )
        rngs = {"dropout": layer.next_rng()} if training else {}
        result = layer.module.apply(
            layer.variables,
            *arrays,
            lens,
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
        arrays = tuple(self._inputs((queries, keys, values), device, dtype))
        cotangent = self.to_native(output_gradient, device, dtype)
        vjp = _linen_vjp if self.jit and _compilable(lens, {"causal": causal}) else _linen_vjp_eager
        variable_grads, *input_grads = vjp(
            layer.module, layer.variables, arrays, lens, cotangent, causal
        )
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

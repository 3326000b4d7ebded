"""JAX's facts, in one place: dtypes, devices, conversions, layers, gradients.

The parity runners, the benchmark and the tests drive the NNX and Linen
layers through these functions rather than each knowing JAX's conventions
(docs: "Architecture"). :func:`make_layer` builds the NNX layer and
:func:`linen_layer` the Linen one; :func:`forward` and :func:`vjp` take
either. Only :func:`host_array` is needed by the layers themselves; everything that
builds a layer imports it when called, so that the layers can import this
module.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.typing import DTypeLike

from mha_multi import spec
from mha_multi.weights import KERNEL_NAMES

if TYPE_CHECKING:
    from mha_multi.jax import linen
    from mha_multi.jax.layer import MultiHeadAttention
    from mha_multi.parity.runners import KernelCall

__all__ = [
    "DTYPES",
    "INPUT_NAMES",
    "LinenLayer",
    "device",
    "device_description",
    "exact_float32",
    "forward",
    "gpu_available",
    "head_mask_gradient",
    "host_array",
    "init_cache",
    "kernel_spy",
    "lens_to_native",
    "linen_layer",
    "make_layer",
    "native_layer",
    "sync",
    "to_native",
    "to_numpy",
    "vjp",
]

#: Dtype name -> JAX dtype. float64 needs :func:`exact_float32`'s x64.
DTYPES: dict[str, DTypeLike] = {
    "float64": jnp.float64,
    "float32": jnp.float32,
    "bfloat16": jnp.bfloat16,
    "float16": jnp.float16,
}

#: The differentiable inputs of a call, in order.
INPUT_NAMES = ("queries", "keys", "values")

# -- devices and settings -------------------------------------------------------


def device(name: str) -> jax.Device:
    """The first JAX device of ``name``.

    Args:
        name: ``"cpu"`` or ``"gpu"``.

    Raises:
        ValueError: another name.
        RuntimeError: no such device here.
    """
    if name not in ("cpu", "gpu"):
        raise ValueError(f"device must be 'cpu' or 'gpu'; got {name!r}")
    return jax.devices(name)[0]


_device = device  # for functions whose ``device`` argument hides this one


def gpu_available() -> bool:
    """Whether JAX sees a GPU."""
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


def device_description(name: str) -> str:
    """The device's kind as JAX names it (``"cpu"``, ``"NVIDIA H100 80GB HBM3"``)."""
    return str(device(name).device_kind)


def exact_float32() -> None:
    """float64 arrays (x64) and IEEE float32 products on every device.

    A process-wide setting the layers never make themselves: float64 needs
    x64, and float32 parity needs JAX's default matmul precision
    ``"highest"`` on GPUs, where the default is TF32 (docs: "Architecture").
    """
    jax.config.update("jax_enable_x64", True)
    jax.config.update("jax_default_matmul_precision", "highest")


def sync(value: Any) -> None:
    """Blocks until every array in ``value`` (any pytree) is computed."""
    jax.block_until_ready(value)


# -- conversions ----------------------------------------------------------------


def to_native(x: Any, device: str = "cpu", dtype: str = "float32") -> jax.Array:
    """``x`` as a JAX array of ``dtype`` (a key of :data:`DTYPES`) on ``device``."""
    return jax.device_put(np.asarray(x).astype(np.dtype(DTYPES[dtype])), _device(device))


def to_numpy(x: Any) -> np.ndarray:
    """A JAX array (bfloat16 included) as float64 numpy, on the host."""
    return np.asarray(jax.device_get(x)).astype(np.float64)


def host_array(x: Any) -> np.ndarray:
    """A JAX array (or an ``nnx.Variable``) as a numpy copy in a canonical dtype.

    bfloat16 becomes float32, which holds it exactly (the canonical weights
    hold numpy floating dtypes only, and numpy has no bfloat16); every other
    dtype is kept.
    """
    if isinstance(x, nnx.Variable):
        x = x[...]
    array = np.asarray(jax.device_get(x))
    if array.dtype == np.dtype(jnp.bfloat16):
        return array.astype(np.float32)
    return array.copy()


def lens_to_native(valid_lens: Any, device: str = "cpu") -> Any:
    """Numeric numpy lengths as a JAX array on ``device``, keeping their dtype.

    Anything else (``None``, a list, a boolean array) is returned as it is,
    so that the layer's own checks answer.
    """
    if isinstance(valid_lens, np.ndarray) and valid_lens.dtype.kind in "iuf":
        return jax.device_put(valid_lens, _device(device))
    return valid_lens


# -- layers: construction, one call, one vector-Jacobian product ----------------


def make_layer(
    num_hiddens: int,
    num_heads: int,
    *,
    device: str = "cpu",
    dtype: str = "float32",
    **kwargs: Any,
) -> MultiHeadAttention:
    """Our NNX layer with ``dtype`` parameters on ``device`` (``nnx.Rngs(0)``).

    ``kwargs`` are the layer's (``dropout``, ``bias``, sizes,
    ``implementation``...). It starts in NNX's default mode, training;
    :func:`forward` sets the mode of each call.
    """
    from mha_multi.jax.layer import MultiHeadAttention

    with jax.default_device(_device(device)):
        return MultiHeadAttention(
            num_hiddens, num_heads, param_dtype=DTYPES[dtype], rngs=nnx.Rngs(0), **kwargs
        )


@dataclass
class LinenLayer:
    """A Linen module with its variables, device and the rng its dropout draws from."""

    module: linen.MultiHeadAttention
    variables: dict[str, Any] | None
    device: jax.Device
    rng: jax.Array

    def next_rng(self) -> jax.Array:
        """A fresh key; the stream advances."""
        self.rng, key = jax.random.split(self.rng)
        return key

    def set_weights(self, weights: Mapping[str, Any]) -> LinenLayer:
        """Loads canonical weights (strict) onto the layer's device; returns the layer."""
        from mha_multi.jax import linen

        variables = linen.variables_from_weights(weights, self.module)
        self.variables = jax.device_put(variables, self.device)
        return self

    def get_weights(self) -> dict[str, np.ndarray]:
        """The canonical weights, as numpy arrays.

        Raises:
            ValueError: the layer has no variables yet.
        """
        from mha_multi.jax import linen

        if self.variables is None:
            raise ValueError("the layer has no variables yet: call init or set its weights")
        return linen.weights_from_variables(self.variables)


def linen_layer(
    num_hiddens: int,
    num_heads: int,
    *,
    device: str = "cpu",
    dtype: str = "float32",
    **kwargs: Any,
) -> LinenLayer:
    """Our Linen module with ``dtype`` parameters on ``device``.

    Its variables are initialised where the module fixes every input size;
    otherwise they stay ``None`` until weights are set.
    """
    from mha_multi.jax import linen

    module = linen.MultiHeadAttention(num_hiddens, num_heads, param_dtype=DTYPES[dtype], **kwargs)
    layer = LinenLayer(module, None, _device(device), jax.random.key(0))
    sizes = (module.query_size, module.key_size, module.value_size)
    if all(size is not None for size in sizes):
        shapes = [jnp.zeros((1, 1, size), DTYPES[dtype]) for size in sizes]
        with jax.default_device(layer.device):
            layer.variables = module.init(layer.next_rng(), *shapes)
    return layer


def forward(
    layer: MultiHeadAttention | LinenLayer,
    queries: jax.Array,
    keys: jax.Array | None,
    values: jax.Array | None,
    valid_lens: Any = None,
    *,
    training: bool = False,
    head_mask: jax.Array | None = None,
    **kwargs: Any,
) -> Any:
    """One call of an NNX layer (in ``train()`` or ``eval()`` mode) or a Linen
    layer (whose dropout draws a fresh key in training).

    ``head_mask`` is the layer's, passed as it is; ``kwargs`` are the
    layer's (``causal``, ``return_attention_weights``, ``cache``).
    """
    kwargs["head_mask"] = head_mask
    if isinstance(layer, LinenLayer):
        rngs = {"dropout": layer.next_rng()} if training else {}
        return layer.module.apply(
            layer.variables,
            queries,
            keys,
            values,
            valid_lens,
            training=training,
            rngs=rngs,
            **kwargs,
        )
    if training:
        layer.train()
    else:
        layer.eval()
    return layer(queries, keys, values, valid_lens, **kwargs)


def vjp(
    layer: MultiHeadAttention | LinenLayer,
    queries: jax.Array,
    keys: jax.Array,
    values: jax.Array,
    valid_lens: Any,
    *,
    causal: bool,
    output_gradient: jax.Array,
    cache: spec.KVCache | None = None,
    head_mask: jax.Array | None = None,
) -> dict[str, jax.Array]:
    """The vector-Jacobian product of an eval-mode call at ``output_gradient``.

    Both layers hold their parameters in one tree,
    ``{'W_q': {'kernel': ..., 'bias': ...}, ...}`` (an NNX state, Linen's
    ``params``), in the canonical orientation. With a ``cache``, of the
    output of that cached call, the cache held fixed; with a ``head_mask``,
    of the gated call.

    Returns:
        Keyed ``queries``, ``keys``, ``values`` and the canonical weight
        names; with a ``head_mask``, its gradient too (in its dtype), keyed
        ``head_mask``.
    """
    options: dict[str, Any] = {"causal": causal}
    if cache is not None:
        options["cache"] = cache

    def output_of(result: Any) -> jax.Array:
        return result if cache is None else result[0]

    if isinstance(layer, LinenLayer):
        module = layer.module

        def call(variables: Any, gates: Any, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
            return output_of(
                module.apply(variables, q, k, v, valid_lens, head_mask=gates, **options)
            )

        params = layer.variables
        projections: Callable[[Any], Any] = operator.itemgetter("params")
    else:
        layer.eval()
        graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

        def call(
            params: nnx.State, gates: Any, q: jax.Array, k: jax.Array, v: jax.Array
        ) -> jax.Array:
            layer = nnx.merge(graphdef, params, rest)
            return output_of(layer(q, k, v, valid_lens, head_mask=gates, **options))

        projections = nnx.to_pure_dict

    # One compiled program per call: eager JAX would compile each operation
    # of the forward and backward passes for each new shape instead, several
    # times slower for the one product wanted here.
    @jax.jit
    def gradients(params: Any, gates: Any, q: Any, k: Any, v: Any, cotangent: Any) -> Any:
        _, pullback = jax.vjp(call, params, gates, q, k, v)
        return pullback(cotangent)

    param_grads, gate_grad, *input_grads = gradients(
        params, head_mask, queries, keys, values, output_gradient
    )
    grads = dict(zip(INPUT_NAMES, input_grads, strict=True))
    if head_mask is not None:
        grads["head_mask"] = gate_grad
    tree = projections(param_grads)
    for name in KERNEL_NAMES:
        grads[name] = tree[name]["kernel"]
        if tree[name].get("bias") is not None:
            grads[f"b_{name[-1]}"] = tree[name]["bias"]
    return grads


def head_mask_gradient(
    layer: MultiHeadAttention | LinenLayer, loss_fn: Callable[[jax.Array], Any]
) -> Callable[[jax.Array, jax.Array, jax.Array, Any], jax.Array]:
    """``dL/dξ`` at ``ξ = 1`` of a batch, the gradient a head's importance is made of.

    ``L = loss_fn(layer(queries, keys, values, valid_lens, head_mask=ξ))``
    with one gate per head (docs: "Heads"), in evaluation mode (no dropout),
    whatever the layer's mode, which is left as it is. The function returned
    is ``jax.jit``-ed once for the layer's parameters as they are now (an
    argument of it, not a constant): one compilation for each batch shape.

    Args:
        layer: an NNX layer, or a :class:`LinenLayer`.
        loss_fn: ``loss_fn(output) -> scalar`` (a JAX scalar, or an array of
            one element), traced.

    Returns:
        ``gradient(queries, keys, values, valid_lens) -> (num_heads,)``, in
        float32 (float64 for a float64 layer); zeros where the loss does not
        depend on the output.

    Raises (when the returned function is called):
        ValueError: ``loss_fn`` returned more than one number.
        TypeError: ``loss_fn`` returned something that is not a number.
    """
    if isinstance(layer, LinenLayer):
        module, state = layer.module, layer.variables
        num_heads = module.num_heads
        param_dtype = module.param_dtype if module.dtype is None else module.dtype

        def output(state: Any, gates: jax.Array, *args: Any) -> jax.Array:
            return module.apply(state, *args, head_mask=gates)

    else:
        graphdef, state = nnx.split(layer)
        num_heads = layer.num_heads
        param_dtype = layer.W_q.kernel.dtype if layer.dtype is None else layer.dtype

        def output(state: Any, gates: jax.Array, *args: Any) -> jax.Array:
            return nnx.merge(graphdef, state)(*args, head_mask=gates, deterministic=True)

    def loss(gates: jax.Array, state: Any, *args: Any) -> jax.Array:
        value = loss_fn(output(state, gates, *args))
        if not (hasattr(value, "shape") or isinstance(value, (int, float))):
            raise TypeError(f"loss_fn must return a scalar; got {type(value).__name__}")
        if np.size(value) != 1:
            raise ValueError(f"loss_fn must return a scalar; got shape {tuple(np.shape(value))}")
        return jnp.reshape(value, ())

    gradient = jax.jit(jax.grad(loss))
    ones = jnp.ones(num_heads, jnp.promote_types(param_dtype, jnp.float32))

    def of_batch(
        queries: jax.Array, keys: jax.Array, values: jax.Array, valid_lens: Any
    ) -> jax.Array:
        from mha_multi.jax.functional import as_valid_lens

        return gradient(ones, state, queries, keys, values, as_valid_lens(valid_lens))

    return of_batch


def init_cache(
    layer: MultiHeadAttention | LinenLayer, batch_size: int, max_length: int
) -> spec.KVCache:
    """The layer's empty cache (its ``init_cache``), of its dtype, on its device."""
    if isinstance(layer, LinenLayer):
        with jax.default_device(layer.device):
            return layer.module.init_cache(batch_size, max_length)
    return layer.init_cache(batch_size, max_length)


def native_layer(
    weights: Mapping[str, Any],
    num_heads: int,
    *,
    device: str = "cpu",
    dtype: str = "float32",
    **kwargs: Any,
) -> nnx.MultiHeadAttention:
    """``flax.nnx.MultiHeadAttention`` holding canonical ``weights``, in eval mode.

    Its parameters have ``dtype`` and live on ``device``; ``kwargs`` are
    further constructor arguments (see
    :func:`mha_multi.interop.jax.to_flax_nnx`).
    """
    from mha_multi.interop.jax import to_flax_nnx

    with jax.default_device(_device(device)):
        layer = to_flax_nnx(weights, num_heads, param_dtype=DTYPES[dtype], **kwargs)
    layer.eval()
    return layer


# -- the fused kernel -----------------------------------------------------------


@contextlib.contextmanager
def kernel_spy() -> Iterator[list[KernelCall]]:
    """Records every :func:`jax.nn.dot_product_attention` call of our layers while active.

    The layers look the kernel up at call time through
    ``mha_multi.jax.functional._dot_product_attention``, which this replaces
    for the duration. Under ``jax.jit`` a call is recorded once, while it is
    traced, and its key lengths are the traced array rather than numpy.

    Yields:
        The list that gets one ``KernelCall`` per call.
    """
    from mha_multi.jax import functional
    from mha_multi.parity.runners import KernelCall

    calls: list[KernelCall] = []
    original = functional._dot_product_attention

    def recording(*args: Any) -> jax.Array:
        _, _, _, mask, is_causal, lengths, _ = args
        if lengths is not None and not isinstance(lengths, jax.core.Tracer):
            lengths = np.asarray(lengths)
        calls.append(
            KernelCall(mask=mask is not None, is_causal=bool(is_causal), key_lengths=lengths)
        )
        return original(*args)

    functional._dot_product_attention = recording
    try:
        yield calls
    finally:
        functional._dot_product_attention = original

"""JAX's facts, once: dtypes, devices, conversions, host reads, the generic path's pieces.

What the NNX and Linen layers need of JAX sits here, below them (docs:
"Architecture"): the dtypes, devices and GPU detection, the process-wide
settings for exact float32 products, conversions to and from numpy
(bfloat16 included), and :class:`JaxFacts`, what the call flow of
:mod:`mha_multi.call` asks of JAX: how inputs, lengths, caches and gates are
checked, what can be read on the host (nothing while traced), the fused
kernel (:mod:`mha_multi.jax._kernel`) and the generic path piece by piece on
a CPU. This module imports no layer; the parity harness builds and drives
layers (docs: "Architecture").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import AxisType
from jax.typing import DTypeLike

from mha_multi import call, spec
from mha_multi.jax._cache import scatter_update
from mha_multi.jax._kernel import (
    DOT_PRODUCT_ATTENTION,
    chosen_kernel,
    fused_attention,
    fused_dtype_supported,
    platform,
)
from mha_multi.jax._ops import JaxOps, PrecisionLike, dtype_kind

__all__ = [
    *call.FACTS_MODULE_NAMES,
    "CPU_PIECE_BYTES",
    "JaxFacts",
    "as_valid_lens",
    "batch_pieces",
    "device",
    "map_pieces",
    "weight_array",
]

#: Dtype name -> JAX dtype. float64 needs :func:`exact_float32`'s x64.
DTYPES: dict[str, DTypeLike] = {
    "float64": jnp.float64,
    "float32": jnp.float32,
    "bfloat16": jnp.bfloat16,
    "float16": jnp.float16,
}

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


def weight_array(array: np.ndarray) -> jax.Array:
    """A canonical weight as a JAX array of its own dtype.

    Raises:
        ValueError: a float64 weight without ``jax_enable_x64``, where JAX would hold
            it as float32 (the weights would change).
    """
    converted = jnp.asarray(array)
    if converted.dtype != array.dtype:
        raise ValueError(
            f"JAX holds {array.dtype} weights as {converted.dtype} without x64: "
            "jax.config.update('jax_enable_x64', True) keeps them, or cast them first"
        )
    return converted


def check_held_dtype(name: str, dtype: DTypeLike | None) -> None:
    """Refuses a dtype that JAX holds as another (float64 as float32 without x64): a
    layer asked for it would compute in float32, with JAX's warning alone.

    Raises:
        ValueError: ``name`` is such a dtype.
    """
    if dtype is None:
        return
    try:
        asked = np.dtype(dtype)
    except TypeError:
        return  # (no dtype: Flax's own check names it)
    held = jax.dtypes.canonicalize_dtype(asked)
    if held != asked:
        raise ValueError(
            f"{name} {asked}: JAX holds {asked} arrays as {held} without x64: "
            "jax.config.update('jax_enable_x64', True) keeps them"
        )


def _explicit_axes(x: Any) -> list[str]:
    """The ``Explicit`` mesh axes ``x`` (a JAX array or tracer) is split on, in its type."""
    if not isinstance(x, (jax.Array, jax.core.Tracer)):
        return []
    sharding = getattr(jax.typeof(x), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or not mesh.axis_names:
        return []
    kinds = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
    named = []
    for entry in sharding.spec:
        named += entry if isinstance(entry, tuple) else [entry]
    return [axis for axis in named if axis is not None and kinds[axis] == AxisType.Explicit]


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


def as_valid_lens(valid_lens: Any) -> jax.Array | None:
    """``valid_lens`` as a JAX array (or tracer), its dtype checked.

    Accepts ``None``, JAX arrays, numpy arrays and nested sequences. Integer
    and floating dtypes are accepted (the rule is ``j < valid_lens``).
    Integer lengths that JAX cannot hold (beyond 32 bits without
    ``jax_enable_x64``, ``uint64`` beyond ``int64`` with it) are clipped,
    not wrapped: ``2**62`` still hides nothing instead of everything. JAX
    arrays are already within JAX's range and are taken as they are.

    Args:
        valid_lens: ``None`` or the lengths.

    Returns:
        ``None`` or the lengths as a JAX array.

    Raises:
        TypeError: a boolean, string or otherwise non-numeric ``valid_lens``.
    """
    if valid_lens is None:
        return None
    if isinstance(valid_lens, jax.Array):
        spec.check_valid_lens_dtype(dtype_kind(valid_lens.dtype))
        return valid_lens
    index, widest = (jax.dtypes.canonicalize_dtype(t) for t in (np.int64, np.float64))
    return jnp.asarray(
        spec.lens_as_numpy(valid_lens, index, None if widest == np.float64 else widest)
    )


# -- the generic path on a CPU ----------------------------------------------------

#: The most bytes of float32 scores ``(b, H, Q, K)`` that one piece of the
#: batch holds on a CPU (:func:`mha_multi.spec.batch_pieces`).
CPU_PIECE_BYTES = spec.CPU_PIECE_BYTES


def batch_pieces(batch: int, example_bytes: int) -> int:
    """:func:`mha_multi.spec.batch_pieces` within :data:`CPU_PIECE_BYTES`: how many pieces
    of the batch the generic path takes one after another on a CPU."""
    return spec.batch_pieces(batch, example_bytes, CPU_PIECE_BYTES)


def map_pieces(function: Callable[[Any], Any], stacked: Any) -> Any:
    """``function`` of each piece in turn (:func:`mha_multi.spec.in_pieces`): a piece's
    backward pass computes its scores and weights again rather than storing them for
    every piece. (lax.map already keeps XLA from merging the pieces: no CSE barrier.)"""
    return lax.map(jax.checkpoint(function, prevent_cse=False), stacked)


# -- the call's facts ----------------------------------------------------------------


def _array_as_it_is(name: str, x: Any, shape: str) -> Any:
    """``x`` if it is an array (or tracer) of any kind; ``shape`` words the TypeError."""
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise TypeError(f"{name} must be a floating-point array {shape}; got {type(x).__name__}")
    return x


class JaxFacts(call.Facts):
    """What a call of the NNX or Linen layer asks of JAX (:class:`mha_multi.call.Facts`).

    Every check reads static shapes and dtypes only, so it runs (and raises)
    while a ``jax.jit``-ed call is being traced, before any array operation.

    Args:
        precision: of every matrix product (``jax.lax.Precision`` or a
            string such as ``"highest"``); ``None`` for JAX's default.
        implementation: the layer's choice of kernel, ``None``,
            ``"generic"``, ``"xla"`` or ``"cudnn"``
            (:func:`mha_multi.jax._kernel.chosen_kernel`).
        platform: the platform the call runs on; ``None`` reads it from the
            arrays (a tracer's is JAX's default backend).
    """

    kernel = DOT_PRODUCT_ATTENTION

    def __init__(
        self,
        precision: PrecisionLike = None,
        implementation: str | None = None,
        *,
        platform: str | None = None,
    ) -> None:
        self.precision = precision
        self.implementation = implementation
        self.platform = platform
        self.vmap = jax.vmap
        self._ops = JaxOps(precision)

    def ops(self, like: jax.Array) -> JaxOps:
        return self._ops

    def dtype_kind(self, dtype: DTypeLike) -> str:
        return dtype_kind(dtype)

    def platform_of(self, x: jax.Array) -> str:
        """The call's platform: as given, else the one ``x`` lives on."""
        return self.platform or platform(x)

    def check_input(self, name: str, x: Any, *, like: Any, dtype: Any) -> Any:
        """Any floating array (or tracer): the call casts it to its computation dtype."""
        if not (hasattr(x, "shape") and hasattr(x, "dtype")):
            raise TypeError(f"{name} must be an array; got {type(x).__name__}")
        if dtype_kind(x.dtype) != "f":
            raise TypeError(f"{name} must be a floating-point array; got {x.dtype}")
        return x

    def as_lens(self, valid_lens: Any, like: Any) -> jax.Array | None:
        return as_valid_lens(valid_lens)

    def as_cache(self, cache: Any, like: Any) -> spec.KVCache:
        """The cache as JAX arrays; refused beside queries split on an ``Explicit`` mesh
        axis, whose rows would carry it in their type into a cache's update.

        Raises:
            ValueError: such queries, naming the axes.
        """
        explicit = _explicit_axes(like)
        if explicit:
            raise ValueError(
                f"a cached call takes no queries split on an Explicit mesh axis "
                f"({', '.join(map(repr, explicit))}): the cache's update would write rows "
                "whose type carries that axis; make it an Auto axis "
                '(axis_types=(jax.sharding.AxisType.Auto, ...); docs: "Sharding heads")'
            )
        return spec.KVCache(*(jnp.asarray(x) for x in spec.as_kv_cache(cache)))

    def as_positions(self, positions: Any, like: Any) -> Any:
        """A JAX array (or tracer) as it is; numpy arrays and sequences checked as numpy
        arrays JAX holds (:func:`mha_multi.spec.positions_on_host`: without
        ``jax_enable_x64``, positions beyond int32 are refused, where JAX would wrap)."""
        if isinstance(positions, jax.Array):
            return positions
        return spec.positions_on_host(positions, jax.dtypes.canonicalize_dtype(np.int64))

    def as_bias(self, bias: Any, like: Any) -> Any:
        """A JAX or numpy array (or tracer), as it is: the scores cast it."""
        return _array_as_it_is("bias", bias, call.BIAS_SHAPE)

    def as_gates(self, head_mask: Any, like: Any) -> Any:
        """A JAX or numpy array (or tracer), as it is: the gating casts it."""
        return _array_as_it_is("head_mask", head_mask, call.GATES_SHAPE)

    def read(self, *arrays: jax.Array | None) -> list[np.ndarray | None] | None:
        """One transfer to the host; nothing while traced."""
        if any(isinstance(x, jax.core.Tracer) for x in arrays):
            return None
        return list(jax.device_get(arrays))

    def write_cache(
        self, ops: JaxOps, cache: spec.KVCache, k: Any, v: Any, valid_lens: Any, **flags: Any
    ) -> tuple[spec.KVCache, jax.Array]:
        """The spec's update by one scatter of the new rows (:func:`scatter_update`).

        The head size is the cache's; JAX attends over every position, so a
        call's host lengths (``fill``) play no part.
        """
        return scatter_update(cache, k, v, valid_lens, causal=flags["causal"])

    def kernel_serves(self, q: jax.Array) -> bool:
        kernel = chosen_kernel(self.implementation, q, self.platform_of(q))
        return kernel != "generic" and fused_dtype_supported(q.dtype, self.precision)

    def fused_attention(self, ops: JaxOps, *args: Any, **kwargs: Any) -> jax.Array | None:
        """:func:`mha_multi.jax._kernel.fused_attention` of the layer's kernel and precision.

        ``None`` where cuDNN declined: it serves some head sizes, sequence
        lengths and GPUs only, and says so while the call is traced. Asked
        for by name, that is the caller's error; chosen by default, the
        generic path serves.
        """
        kernel = chosen_kernel(self.implementation, args[0], self.platform_of(args[0]))
        try:
            return fused_attention(
                ops, *args, precision=self.precision, implementation=kernel, **kwargs
            )
        except (NotImplementedError, ValueError, RuntimeError):
            if self.implementation is not None:
                raise
            return None

    map_pieces = staticmethod(map_pieces)

    def batch_pieces(self, q: jax.Array, example_bytes: int) -> int:
        """:meth:`mha_multi.call.Facts.batch_pieces`: on a CPU, the fewest pieces within
        :data:`CPU_PIECE_BYTES` (:func:`batch_pieces`). A piece's backward pass computes
        its scores and weights again rather than storing them for every piece (it reads
        them from the cache instead of memory), so training holds one piece's
        ``(b, H, Q, K)`` arrays rather than the batch's."""
        if self.platform_of(q) != "cpu":
            return 1
        return batch_pieces(q.shape[0], example_bytes)

"""Keras' facts, once, for whichever Keras backend the process runs on.

What the layer needs of Keras sits here, below it (docs: "Architecture"):
the dtypes, devices and GPU detection, the process-wide settings for exact
float32 products, whether values can be read now, conversions to and from
numpy (bfloat16 included), and :class:`KerasFacts`, what the call flow of
:mod:`mha_multi.call` asks of Keras: how inputs, lengths, caches and gates
are checked, what can be read on the host, and the fused kernel
(:mod:`mha_multi.keras._kernel`). This module imports no layer; the parity
harness builds and drives layers (docs: "Architecture").

Keras fixes its backend per process (``KERAS_BACKEND``); what differs
between TensorFlow, JAX and PyTorch underneath is one class each in
:mod:`mha_multi.keras._frameworks`, of which only the active backend's is
created, so only that framework is ever imported.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import keras
import numpy as np

from mha_multi import call, spec
from mha_multi.keras._constants import constants_key
from mha_multi.keras._devices import (
    device_description,
    device_of,
    device_scope,
    enable_float64,
    exact_float32,
    gpu_available,
)
from mha_multi.keras._frameworks import (
    BACKEND,
    active,
    all_finite,
    scalar_gradient,
    sync,
    values_readable,
    values_within,
)
from mha_multi.keras._kernel import (
    DOT_PRODUCT_ATTENTION,
    fused_attention,
    serves,
)
from mha_multi.keras._ops import OPS, dtype_kind, dtype_name, first_rows, index_dtype, rows_at
from mha_multi.keras._written_lengths import WRITTEN_LENGTHS, WrittenLengths
from mha_multi.keras.sharding import head_vmap

__all__ = [
    "BACKEND",
    "DTYPES",
    "FACTS",
    "KerasFacts",
    "WRITTEN_LENGTHS",
    "WrittenLengths",
    "as_numpy",
    "checked_lens",
    "device_description",
    "device_of",
    "device_scope",
    "enable_float64",
    "exact_float32",
    "floating_array",
    "gpu_available",
    "host_array",
    "is_tensor",
    "lens_to_native",
    "scalar_gradient",
    "shortest_known",
    "sync",
    "to_native",
    "to_numpy",
    "values_exact",
    "values_readable",
]

#: The dtypes the layer runs in on every Keras backend, by Keras' names.
DTYPES: tuple[str, ...] = ("float64", "float32", "bfloat16", "float16")

Tensor = Any


# -- conversions -------------------------------------------------------------------


def to_native(x: np.ndarray, device: str = "cpu", dtype: str = "float32") -> Tensor:
    """``x`` as a tensor of ``dtype`` on ``device`` (a copy: ``x`` stays the caller's)."""
    with device_scope(device):
        return keras.ops.cast(keras.ops.convert_to_tensor(np.array(x, copy=True)), dtype)


def lens_to_native(valid_lens: Any, device: str = "cpu") -> Any:
    """Numeric numpy ``valid_lens`` as a tensor on ``device``, keeping their dtype.

    Anything else is returned as it is, for the layer's own checks to answer;
    so is a dtype the backend has no tensors of (uint64 on PyTorch), which
    the layer takes as numpy.
    """
    if not (isinstance(valid_lens, np.ndarray) and valid_lens.dtype.kind in "iuf"):
        return valid_lens
    try:
        with device_scope(device):
            return keras.ops.convert_to_tensor(np.array(valid_lens, copy=True))
    except (TypeError, ValueError):
        return np.array(valid_lens, copy=True)


def as_numpy(x: Any) -> np.ndarray:
    """A tensor or variable as a new numpy array of its dtype (bfloat16 as ml_dtypes')."""
    with warnings.catch_warnings():
        # Keras converts with np.array(x), and the __array__ of TensorFlow
        # variables and PyTorch tensors predates numpy 2's copy keyword.
        warnings.filterwarnings(
            "ignore", "__array__ implementation doesn't accept a copy keyword", DeprecationWarning
        )
        return np.array(keras.ops.convert_to_numpy(x), copy=True)


def host_array(x: Any) -> np.ndarray:
    """A tensor or variable as numpy, floats in their own dtype.

    bfloat16 comes back as float32, which holds every bfloat16 value exactly
    (ml_dtypes' bfloat16 is no numpy float: its kind is ``'V'``).
    """
    array = as_numpy(x)
    return array if array.dtype.kind != "V" else array.astype(np.float32)


def to_numpy(x: Any) -> np.ndarray:
    """A tensor of any dtype (bfloat16 included), on any device, as float64 numpy."""
    return as_numpy(x).astype(np.float64)


# -- the call's arguments ----------------------------------------------------------------


def is_tensor(x: Any) -> bool:
    """Whether ``x`` is a tensor of the active backend or a symbolic ``keras.KerasTensor``."""
    return keras.ops.is_tensor(x) or isinstance(x, keras.KerasTensor)


def checked_lens(valid_lens: Any) -> Any:
    """``valid_lens`` as a tensor or a numeric numpy array (``TypeError`` otherwise).

    Integer arrays are converted to the backend's integer type by clipping:
    Keras' JAX backend without ``jax_enable_x64`` would wrap ``2**62`` to 0
    and hide every key. Tensors are within their backend's range already,
    but for uint64 ones, made int64 by clipping too: TensorFlow compares
    them wrapped (``2**63 + 5`` hid key 5) and PyTorch compares none.
    """
    if valid_lens is None:
        return None
    if is_tensor(valid_lens):
        if dtype_name(valid_lens.dtype) != "uint64":
            return valid_lens
        # The cast wraps lengths >= 2**63 to negative numbers, which no unsigned
        # length is: they are the ones to clip.
        signed = keras.ops.cast(valid_lens, "int64")
        return keras.ops.where(signed < 0, np.iinfo(np.int64).max, signed)
    index = index_dtype()
    # (Only Keras on JAX without x64 counts in 32 bits, and it holds no float64 either.)
    return spec.lens_as_numpy(valid_lens, index, "float32" if index == "int32" else None)


def values_exact(q: Any, k: Any, v: Any, head_dim: int) -> bool | None:
    """Whether the fused kernel gives the spec's numbers for these values.

    The kernels differ from the spec where values are extreme: PyTorch's
    SDPA turns a NaN query row into zeros, and any additive mask lets a
    hidden key's ``+inf`` score through as NaN where the spec replaces it.
    So the fused path needs every projected element finite and every score
    bounded by :data:`~mha_multi.spec.FUSED_SCORE_LIMIT`, which
    ``sqrt(head_dim) * max|q| * max|k|`` bounds from above (Cauchy-Schwarz,
    per element). That costs a few reductions over ``(B, T, D)`` and one
    read of a boolean: nothing next to the ``(B, H, Q, K)`` attention.

    Args:
        q: projected queries ``(B, Q, num_heads * head_dim)``; k, v
            ``(B, K, num_kv_heads * head_dim)``.
        head_dim: the size of each head.

    Returns:
        ``True`` where the fused path is exact for these values, ``None``
        where they cannot be read (a traced graph: ``tf.function``,
        ``jax.jit``, ``torch.compile``; there the generic path, exact for
        every value, is taken).
    """
    if not values_readable(q):
        return None
    # (bool of an eager scalar reads it on every backend, without numpy's conversion.)
    return bool(values_within(q, k, v, spec.magnitude_limit(head_dim)))


def shortest_known(valid_lens: Any) -> float | None:
    """The shortest of ``valid_lens`` where its values are on the host without a read:
    numpy lengths, or the lengths an eager cached call returned
    (:data:`WRITTEN_LENGTHS`); ``None`` otherwise, or for none. (A NaN length is the
    shortest: the plan keeps it as it is.)"""
    if valid_lens is None:
        return None
    held = valid_lens if isinstance(valid_lens, np.ndarray) else WRITTEN_LENGTHS.known(valid_lens)
    if held is None or held.size == 0:
        return None
    return held.min().item()


def _host(x: Any) -> np.ndarray | None:
    return x if x is None or isinstance(x, np.ndarray) else as_numpy(x)


# -- the call's facts ----------------------------------------------------------------------


def _torch_compiling() -> Callable[[], bool]:
    """``torch.compiler.is_compiling``, on Keras' PyTorch backend."""
    import torch

    return torch.compiler.is_compiling


def floating_array(name: str, x: np.ndarray) -> np.ndarray:
    """``x``, a numpy input of the call, where it is floating (Keras would cast another
    to the layer's dtype without a word); raises ``TypeError`` naming ``name`` else."""
    if x.dtype.kind != "f":
        raise TypeError(f"{name} must be a floating-point array; got {x.dtype}")
    return x


class KerasFacts(call.Facts):
    """What a call of the Keras layer asks of Keras (:class:`mha_multi.call.Facts`).

    Inputs are not converted here: Keras' ``Layer.__call__`` has made
    tensors of arrays, and the layer casts them to its compute dtype when it
    projects them. Lengths and caches may still be numpy arrays
    (``stateless_call`` passes no ``__call__``): lengths stay numpy, clipped
    (:func:`checked_lens`), a cache's arrays become tensors (:meth:`as_cache`).
    """

    kernel = DOT_PRODUCT_ATTENTION
    attends_filled = True
    # (Eigen's vectorized and scalar cosines differ by an ulp.)
    rows_of_one_table = BACKEND != "tensorflow"
    # torch.compile must see a call's checks run; TensorFlow's and JAX's traces run
    # Python as it is.
    tracing = staticmethod(_torch_compiling()) if BACKEND == "torch" else None

    @property
    def vmap(self) -> Callable[..., Any]:  # type: ignore[override]
        """``jax.vmap``: only Keras' JAX backend splits heads over devices."""
        return head_vmap()

    def ops(self, like: Tensor) -> Any:
        return OPS

    def dtype_kind(self, dtype: Any) -> str:
        return dtype_kind(dtype)

    def check_input(self, name: str, x: Any, *, like: Tensor | None, dtype: Any) -> Tensor:
        """A floating tensor (of any floating dtype: the projections cast it); a floating
        numpy array made one (``stateless_call`` passes no ``__call__``, which makes it
        one)."""
        if isinstance(x, np.ndarray):
            x = keras.ops.convert_to_tensor(floating_array(name, x))
        if not is_tensor(x):
            raise TypeError(f"{name} must be a tensor or a numpy array; got {type(x).__name__}")
        if dtype_kind(x.dtype) != "f":
            raise TypeError(f"{name} must be a floating-point tensor; got {x.dtype}")
        return x

    def as_lens(self, valid_lens: Any, like: Tensor) -> Any:
        lens = checked_lens(valid_lens)
        if lens is not None:
            spec.check_valid_lens_dtype(dtype_kind(lens.dtype))
        return lens

    def as_cache(self, cache: Any, like: Tensor | None) -> spec.KVCache:
        """A ``KVCache`` of tensors, numpy arrays converted (the layer's ``__call__`` too)."""
        fields = []
        for name, x in zip(spec.KVCache._fields, spec.as_kv_cache(cache), strict=True):
            if isinstance(x, np.ndarray):
                x = keras.ops.convert_to_tensor(x)
            elif not is_tensor(x):
                raise TypeError(f"cache.{name} must be a tensor; got {type(x).__name__}")
            fields.append(x)
        fields[2] = active().cache_lengths(fields[2])
        return spec.KVCache(*fields)

    def as_positions(self, positions: Any, like: Tensor | None) -> Any:
        """A tensor as it is; numpy arrays and sequences as integer tensors."""
        if is_tensor(positions):
            return positions
        return keras.ops.convert_to_tensor(spec.positions_on_host(positions, index_dtype()))

    def as_bias(self, bias: Any, like: Tensor | None) -> Any:
        """A tensor or a numpy array, as it is (the scores cast it to their dtype)."""
        if not (is_tensor(bias) or isinstance(bias, np.ndarray)):
            raise TypeError(
                f"bias must be a floating-point tensor or numpy array {call.BIAS_SHAPE}; "
                f"got {type(bias).__name__}"
            )
        return bias

    def as_gates(self, head_mask: Any, like: Tensor | None) -> Any:
        """A tensor or a numpy array, as it is (the gating casts it to the context's dtype)."""
        if not (is_tensor(head_mask) or isinstance(head_mask, np.ndarray)):
            raise TypeError(
                f"head_mask must be a tensor or a numpy array; got {type(head_mask).__name__}"
            )
        return head_mask

    def read(self, *arrays: Any) -> list[np.ndarray | None] | None:
        """The arrays as numpy, nothing where a graph is traced.

        Lengths an eager cached call returned are known on the host already
        (:class:`WrittenLengths`): a decoding step reads nothing for them.
        32 and 64-bit signed integer tensors (``cache.lengths`` and a cached
        call's lengths) come back from the device in one read; other integer
        types are read on their own rather than cast (a uint32 beyond int32
        would wrap), numpy arrays are taken as they are.
        """
        if not all(values_readable(x) for x in arrays if x is not None):
            return None
        known = [WRITTEN_LENGTHS.known(x) for x in arrays]
        rest = [x if held is None else None for x, held in zip(arrays, known, strict=True)]
        together = [x for x in rest if is_tensor(x) and OPS.dtype(x) in ("int32", "int64")]
        if len(together) < 2:
            read = call.read_all(rest, _host)
        else:
            dtype = "int64" if any(OPS.dtype(x) == "int64" for x in together) else "int32"
            flat = [keras.ops.reshape(keras.ops.cast(x, dtype), (-1,)) for x in together]
            sizes = [math.prod(x.shape) for x in together]
            parts = np.split(as_numpy(keras.ops.concatenate(flat)), np.cumsum(sizes)[:-1])
            by_id = {
                id(x): part.reshape(tuple(x.shape)) for x, part in zip(together, parts, strict=True)
            }
            read = [by_id[id(x)] if id(x) in by_id else _host(x) for x in rest]
        return [x if held is None else held for x, held in zip(read, known, strict=True)]

    kernel_serves = staticmethod(serves)
    fused_attention = staticmethod(fused_attention)
    constants_key = staticmethod(constants_key)
    first_rows = staticmethod(first_rows)
    rows_at = staticmethod(rows_at)

    def kernel_takes_grouped(self, q: Any, num_queries: Any, head_dim: int) -> bool:
        return active().kernel_takes_grouped(q, num_queries, head_dim)

    def kernel_takes_mask(self, q: Any, num_queries: Any, num_keys: Any) -> bool:
        return active().kernel_takes_mask(q, num_queries, num_keys)

    def batch_pieces(self, q: Tensor, example_bytes: int) -> int:
        """:meth:`mha_multi.call.Facts.batch_pieces`: more than 1 only for a program on
        JAX's CPU (the framework's ``batch_pieces``)."""
        return active().batch_pieces(q, example_bytes)

    def map_pieces(self, function: Callable[[Any], Any], stacked: Any) -> Any:  # type: ignore[override]
        """:attr:`mha_multi.call.Facts.map_pieces`: the framework's loop over the pieces
        (on JAX, ``lax.map`` of a checkpointed piece)."""
        return active().map_pieces(function, stacked)

    # -- the cache ------------------------------------------------------------

    def write_cache(
        self,
        ops: Any,
        cache: spec.KVCache,
        k: Tensor | None,
        v: Tensor | None,
        valid_lens: Any,
        *,
        head_dim: int,
        causal: bool,
        fill: spec.CacheFill | None,
    ) -> tuple[spec.KVCache, Tensor]:
        """The new rows written as one slice where every example appends them at one position.

        An eager call whose lengths were read (``fill``) and whose examples
        all hold the same length and append all ``T`` positions writes the
        rows with ``keras.ops.slice_update``, the spec's numbers without its
        gather and ``where`` over all ``max_length`` positions. On Keras'
        PyTorch backend, where no gradient is recorded through the cache
        (``torch.no_grad()``, as PyTorch's own layer), the rows are copied
        into the cache's own tensors: the returned cache shares ``keys`` and
        ``values`` with the given one (docs: "Generating with a cache").
        A traced call is written as its backend says
        (:attr:`~mha_multi.keras._frameworks._Framework.traced_write`): under
        ``torch.compile``, recording no gradient through the cache, into the
        cache's own tensors, as PyTorch's layer does; on JAX by one scatter
        (:func:`mha_multi.spec.update_cache`'s ``scatter``: under ``jit`` the
        spec's gather would recompute their rotation at every position).
        An eager call of examples at different lengths (or appending different
        counts) on Keras' PyTorch backend, recording no gradient, writes each
        example's rows where it is into the cache's own tensors (PyTorch's
        layer's compiled write, whose result is the spec's update for any
        lengths). Anything else (such a call elsewhere, or recording gradients,
        another traced call) gets the spec's functional update. The lengths an
        eager call returns are remembered either way (:data:`WRITTEN_LENGTHS`),
        so the next step reads none.
        """
        num_new = 0 if k is None else k.shape[1]
        traced_write = active().traced_write
        if traced_write is not None and k is not None:
            written = traced_write(ops, cache, k, v, valid_lens, head_dim=head_dim, causal=causal)
            if written is not None:
                return written
        first = None if fill is None or not num_new else fill.uniform_start(num_new)
        if first is None or not values_readable(k):
            in_place = None
            if num_new and values_readable(k):
                # Examples at different lengths, written where each is (PyTorch's
                # backend, recording no gradient through the cache).
                in_place = active().write_in_place(
                    ops, cache, k, v, valid_lens, head_dim=head_dim, causal=causal
                )
            written, visible = in_place or super().write_cache(
                ops, cache, k, v, valid_lens, head_dim=head_dim, causal=causal, fill=fill
            )
            if fill is not None and values_readable(written.lengths):
                WRITTEN_LENGTHS.remember(written.lengths, fill.held)
            return written, visible
        backend = active()
        in_place = backend.writes_in_place(k, v, cache.keys, cache.values)
        keys, values = (
            backend.write_rows(
                held,
                ops.permute(ops.split_axis(x, 2, (-1, head_dim)), (0, 2, 1, 3)),
                first,
                in_place=in_place,
            )
            for held, x in ((cache.keys, k), (cache.values, v))
        )
        new = spec.appended(ops, cache.lengths, None, num_new)
        lengths = cache.lengths + new
        WRITTEN_LENGTHS.remember(lengths, fill.lengths + num_new)
        # One new position sees what the lengths say, causal or not (CacheFill.visibility).
        visible = (
            spec.cached_visibility(ops, cache.lengths, new, num_new, causal=True)
            if causal and num_new > 1
            else lengths
        )
        return spec.KVCache(keys, values, lengths), visible

    def cache_prefix(
        self, keys: Tensor, values: Tensor, span: int, first: int = 0
    ) -> tuple[Tensor, Tensor]:
        return keys[:, :, first:span], values[:, :, first:span]

    def finite_past(self, keys: Tensor, values: Tensor, span: int) -> bool:
        """Read on the host, one sum; not known on a GPU, where the read would wait."""
        if not values_readable(values) or device_of(values) != "cpu":
            return False
        return bool(all_finite(values[:, :, span:]))  # (values_exact's read)

    def span_bucket_of(self, keys: Tensor) -> int:
        """1 where the backend's eager kernels take any length at no cost (PyTorch's
        CPU); the spec's bucket on TensorFlow, which keeps memory for each new shape,
        on JAX, whose eager operations compile for each new shape, and on PyTorch's
        GPU (as :class:`mha_multi.torch._facts.TorchFacts`)."""
        return active().span_bucket(keys)

    def plan_values(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        valid_lens: Any,
        heads: spec.Heads,
        *,
        hides_keys: bool = True,
    ) -> tuple[bool | None, float | None]:
        """:func:`values_exact`, and the shortest length where the lengths are known on
        the host (:func:`shortest_known`): lengths that hide no key need no mask, and
        lengths > 0 leave no row fully hidden. Lengths on a device are not read (the
        kernel takes none, so they may hide keys at any call); the scores' bound is
        read whatever ``hides_keys`` says."""
        return values_exact(q, k, v, heads.head_dim), shortest_known(valid_lens)

    def reads_values(
        self, q: Tensor, num_queries: Any, num_keys: Any, *, total_scores: int | None
    ) -> bool:
        """Never on the host for one query per example (a decoding step, a one-token
        call): the read passes over the keys and values once more than the attention
        of one query does (a step's are the cache's filled positions), so the generic
        path, which reads nothing, runs faster for a batch and within a few percent
        for one example (docs: "Fast paths"); otherwise the spec's rule (on a GPU, a
        long call's read pays)."""
        if num_queries == 1 and self.on_host(q):
            return False
        return super().reads_values(q, num_queries, num_keys, total_scores=total_scores)

    def on_host(self, q: Tensor) -> bool:
        # A traced tensor is read nowhere (values_exact answers None).
        return not values_readable(q) or device_of(q) == "cpu"

    def records_gradient(self, q: Tensor) -> bool:
        return active().records_gradient(q)


#: The facts every Keras layer's call is driven with.
FACTS = KerasFacts()

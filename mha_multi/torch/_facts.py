"""PyTorch's facts, once: dtypes, devices, precision settings, conversions, checks, reads.

What the layer needs of PyTorch sits here, below it (docs: "Architecture"):
how a device name maps to a ``torch.device``, which process-wide settings
give exact float32 products, how tensors leave for numpy, and
:class:`TorchFacts`, what the call flow of :mod:`mha_multi.call` asks of
PyTorch: how inputs, lengths, caches and gates are checked, and what can be
read on the host before the plan. The fused kernel
(``scaled_dot_product_attention``) is :mod:`mha_multi.torch._kernel`; a
cache's writes in place :mod:`mha_multi.torch._cache_writes`, and what they
carry from call to call :mod:`mha_multi.torch._cache`. This module imports
no layer; the parity harness builds and drives layers (docs: "Architecture").
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from mha_multi import call, spec
from mha_multi.torch._cache import CacheCheck, from_host, writes_in_place
from mha_multi.torch._cache_writes import CacheWrites
from mha_multi.torch._guard import GuardedKernel
from mha_multi.torch._kernel import BIAS_LIMIT, SDPA, fused_attention
from mha_multi.torch._ops import (
    TorchOps,
    dtype_kind,
    masks_few_keys_slowly,
    ops_on,
    repeats_grouped_heads,
    softmax,
)
from mha_multi.torch._plain import PlainRoute
from mha_multi.torch._reads import extremes, finite_sum, larger, magnitude_of, read_together

__all__ = [
    *call.FACTS_MODULE_NAMES,
    "FACTS",
    "TorchFacts",
    "device",
    "masks_few_keys_slowly",
    "repeats_grouped_heads",
    "softmax",
    "writes_in_place",
]

# ``repeats_grouped_heads``, ``masks_few_keys_slowly`` and ``writes_in_place`` are
# PyTorch's own rules for grouped heads in SDPA, for its masks over few keys and for
# writing a cache in place, and ``softmax`` its generic path's softmax (on a CPU,
# short rows of many scores by the formula, floored), which Keras on PyTorch follows
# too: it reaches PyTorch through this module (and the finiteness reads,
# mha_multi.torch._reads) rather than the package's other private modules (docs:
# "Fast paths", "Generating with a cache").

#: dtype name -> torch dtype.
DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


# -- devices and precision -----------------------------------------------------


def device(name: str) -> torch.device:
    """The ``torch.device`` of a device name.

    Args:
        name: ``"cpu"`` or ``"gpu"`` (the first CUDA device).
    """
    return torch.device("cuda" if name == "gpu" else "cpu")


# Parameters named ``device`` shadow the function above inside the functions below.
_device = device


def gpu_available() -> bool:
    """Whether a CUDA device can run here."""
    return torch.cuda.is_available()


def device_description(name: str) -> str:
    """The device as reports name it: the GPU's model, or ``"cpu"``."""
    return torch.cuda.get_device_name() if name == "gpu" else "cpu"


def exact_float32() -> None:
    """IEEE float32 products, and 16-bit ones accumulated in float32 (docs: "Architecture").

    TF32 off for float32 parity. cuBLAS may add up split-K partial sums of
    16-bit GEMMs in 16 bits unless told not to; the layer leaves these
    process-wide settings to its caller, and the parity runner and the
    benchmark ask for the products accumulated in float32 and rounded once.
    """
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False


def sync(value: Any) -> None:
    """Waits until ``value`` (a tensor, or anything else) is computed on its device."""
    if isinstance(value, torch.Tensor) and value.is_cuda:
        torch.cuda.synchronize()


# -- conversions -----------------------------------------------------------------


def to_native(x: np.ndarray, device: str = "cpu", dtype: str = "float32") -> torch.Tensor:
    """``x`` as a tensor of ``dtype`` on ``device`` (a copy: ``x`` stays the caller's)."""
    return torch.from_numpy(np.array(x, copy=True)).to(_device(device), DTYPES[dtype])


def host_array(value: Any) -> Any:
    """A tensor as a numpy array on the host, in its own dtype; anything else as it is.

    numpy has no bfloat16: bfloat16 tensors come back as float32, which
    holds every bfloat16 value exactly.
    """
    if not isinstance(value, torch.Tensor):
        return value
    value = value.detach().cpu()
    if value.dtype == torch.bfloat16:
        value = value.float()
    return value.numpy().copy()


def to_numpy(x: torch.Tensor) -> np.ndarray:
    """A tensor of any dtype (bfloat16 included), on any device, as float64 numpy."""
    return np.asarray(host_array(x), dtype=np.float64)


def lens_to_native(valid_lens: Any, device: str = "cpu") -> Any:
    """Numeric numpy ``valid_lens`` as a tensor on ``device``, keeping their dtype.

    Anything else is returned as it is, for the layer's own checks to answer.
    """
    if isinstance(valid_lens, np.ndarray) and valid_lens.dtype.kind in "iuf":
        return torch.from_numpy(np.array(valid_lens, copy=True)).to(_device(device))
    return valid_lens


# -- the call's facts ----------------------------------------------------------------


def _tensor_beside(name: str, x: Any, like: torch.Tensor, shape: str) -> torch.Tensor:
    """``x``, a tensor of any dtype, on ``like``'s device; ``shape`` words the TypeError."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(
            f"{name} must be a floating-point torch.Tensor {shape}; got {type(x).__name__}"
        )
    return x.to(like.device)


class TorchFacts(GuardedKernel, PlainRoute, CacheWrites, call.Facts):
    """What a call of the PyTorch layer asks of PyTorch (:class:`mha_multi.call.Facts`).

    Plain self-attention's fast route is
    :class:`~mha_multi.torch._plain.PlainRoute`'s, a cache's writes in place
    :class:`~mha_multi.torch._cache_writes.CacheWrites`', the compiled
    graph's guard :class:`~mha_multi.torch._guard.GuardedKernel`'s, and the
    kernel's call :func:`mha_multi.torch._kernel.fused_attention`.
    """

    kernel = SDPA
    passes_options = True
    attends_filled = True
    # (Elementwise cosines and sines: a table's row is its position's, as the plain
    # route's plans take them too.)
    rows_of_one_table = True
    # (torch.compile must see a call's checks run: it would guard on the table.)
    tracing = staticmethod(torch.compiler.is_compiling)
    fused_attention = staticmethod(fused_attention)

    def kernel_takes_grouped(self, q: torch.Tensor, num_queries: Any, head_dim: int) -> bool:
        return not repeats_grouped_heads(q, num_queries, head_dim)

    def kernel_takes_mask(self, q: torch.Tensor, num_queries: Any, num_keys: Any) -> bool:
        return not masks_few_keys_slowly(q, num_queries, num_keys)

    def span_bucket_of(self, keys: torch.Tensor) -> int:
        """1 on the CPU, whose eager kernels take any length at no cost; on a GPU the spec's bucket.

        CUDA's cuDNN attention (PyTorch's choice for 16-bit SDPA on Hopper)
        builds a plan for each new key length: 33-47 ms a length, measured on
        an H100, which a step that attends one more position each time pays
        at every step.
        """
        return 1 if keys.device.type == "cpu" else spec.SPAN_BUCKET

    def __init__(self) -> None:
        CacheWrites.__init__(self)
        PlainRoute.__init__(self)

    def ops(self, like: torch.Tensor) -> Any:
        if torch.compiler.is_compiling():
            return TorchOps(like.device)  # the tracer warns about lru_cache
        return ops_on(like.device)

    def dtype_kind(self, dtype: torch.dtype) -> str:
        return dtype_kind(dtype)

    def check_input(
        self, name: str, x: Any, *, like: torch.Tensor | None, dtype: torch.dtype | None
    ) -> torch.Tensor:
        """A floating tensor of the parameters' ``dtype`` (autocast's inputs: any floating)."""
        # (The type and the dtype's flag asked without a function call where they can
        # be: every call checks its inputs.)
        if type(x) is not torch.Tensor and not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(x).__name__}")
        if not x.dtype.is_floating_point:
            raise TypeError(f"{name} must be a floating-point tensor; got {x.dtype}")
        if dtype is not None and x.dtype != dtype and not torch.is_autocast_enabled(x.device.type):
            raise TypeError(
                f"{name} dtype {x.dtype} differs from the layer's parameter dtype "
                f"{dtype}; convert one of them (e.g. layer.to({x.dtype}))"
            )
        return x

    def as_lens(self, valid_lens: Any, like: torch.Tensor) -> torch.Tensor | None:
        """``valid_lens`` as a tensor on ``like``'s device; integer lengths as int64.

        int64 holds every key count, so clipping wider (uint64) lengths into
        it keeps their meaning (``>= K`` hides nothing), and narrower ones
        widened never wrap the key positions they are compared with.
        """
        if valid_lens is None:
            return None
        if isinstance(valid_lens, torch.Tensor):
            spec.check_valid_lens_dtype(dtype_kind(valid_lens.dtype))
            if valid_lens.is_floating_point():
                return valid_lens.to(like.device)
            lens = valid_lens.to(like.device, torch.int64)
            if valid_lens.dtype == torch.uint64:
                # The conversion wraps lengths >= 2**63 to negative numbers,
                # which no unsigned length is: they are the ones to clip.
                lens = torch.where(lens < 0, torch.iinfo(torch.int64).max, lens)
            return lens
        array = spec.lens_as_numpy(valid_lens, np.int64)
        return torch.from_numpy(np.array(array, copy=True)).to(like.device)

    def as_cache(self, cache: Any, like: torch.Tensor) -> spec.KVCache:
        cache = spec.as_kv_cache(cache)
        for name, tensor in zip(cache._fields, cache, strict=True):
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"cache.{name} must be a torch.Tensor; got {type(tensor).__name__}")
            if tensor.device != like.device:
                raise ValueError(
                    f"cache.{name} is on {tensor.device}, the queries on {like.device}; "
                    "make the cache with layer.init_cache"
                )
        return cache

    def as_positions(self, positions: Any, like: torch.Tensor) -> torch.Tensor:
        """On the queries' device; integer tensors as int64 (what the angles are computed from)."""
        if not isinstance(positions, torch.Tensor):
            positions = torch.from_numpy(np.array(spec.positions_on_host(positions), copy=True))
        if positions.is_floating_point() or positions.dtype == torch.bool:
            return positions.to(like.device)  # refused by the spec's check, named
        return positions.to(like.device, torch.int64)

    def as_bias(self, bias: Any, like: torch.Tensor) -> torch.Tensor:
        """On the queries' device; its dtype kept (the scores cast it), so gradients reach it."""
        return _tensor_beside("bias", bias, like, call.BIAS_SHAPE)

    def as_gates(self, head_mask: Any, like: torch.Tensor) -> torch.Tensor:
        """On the queries' device; its dtype kept (the gating casts, so gradients keep it)."""
        return _tensor_beside("head_mask", head_mask, like, call.GATES_SHAPE)

    def read(self, *arrays: torch.Tensor | None) -> list[np.ndarray | None] | None:
        """One transfer for integer tensors; nothing under ``torch.compile``, nor of
        a tensor ``torch.vmap`` batches (the call then does what compiled code does).

        A cache's lengths as an eager call wrote them are known on the host
        already (:class:`CacheCheck`): a decoding step reads nothing for them.
        """
        if torch.compiler.is_compiling():
            return None
        if torch._C._are_functorch_transforms_active() and any(
            x is not None and torch._C._functorch.is_functorch_wrapped_tensor(x) for x in arrays
        ):
            return None
        known = [None if x is None else CacheCheck.host_lengths(x) for x in arrays]
        rest = [x if held is None else None for x, held in zip(arrays, known, strict=True)]
        if not any(x is not None for x in rest):
            return known
        given = [x for x in rest if x is not None]
        if given and all(not x.is_floating_point() for x in given):
            flat = torch.cat([x.reshape(-1).long() for x in given]).cpu().numpy()
            parts = iter(np.split(flat, np.cumsum([x.numel() for x in given])[:-1]))
            read = [None if x is None else next(parts).reshape(tuple(x.shape)) for x in rest]
        else:
            read = call.read_all(rest, host_array)
        return [read_ if held is None else held for read_, held in zip(read, known, strict=True)]

    def on_host(self, q: torch.Tensor) -> bool:
        return q.is_cpu

    def constants_key(self, like: torch.Tensor) -> tuple | None:
        """The host, and whether inference mode is on (its tensors serve no autograd), for
        an eager call there: a call's rotary tables at the default positions are kept
        (:mod:`mha_multi.call.rotary_tables`). ``None`` on a GPU, where a cached call's
        positions made on the host would be a copy that waits for the device, under
        ``torch.compile`` (traced) and under ``torch.func``'s transforms."""
        if (
            not self.on_host(like)
            or torch.compiler.is_compiling()
            or torch._C._are_functorch_transforms_active()
        ):
            return None
        return ("host", torch.is_inference_mode_enabled())

    def first_rows(self, x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        return x.narrow(0, start, stop - start)

    def rows_at(self, x: torch.Tensor, index: np.ndarray) -> torch.Tensor:
        return x[from_host(index, x.device, torch.int64)]

    def records_gradient(self, q: torch.Tensor) -> bool:
        return q.requires_grad

    def plan_signature(self, q: torch.Tensor) -> tuple | None:
        """The tensor type, dtype and device (what :meth:`kernel_takes_grouped` and
        :meth:`kernel_takes_mask` read besides the shape); ``None`` under
        ``torch.compile``, whose tracer plans once anyway."""
        if torch.compiler.is_compiling():
            return None
        return (type(q), q.dtype, q.device)

    def plan_values(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        valid_lens: torch.Tensor | None,
        heads: spec.Heads,
        bias: torch.Tensor | None = None,
        *,
        hides_keys: bool = True,
    ) -> tuple[bool | None, float | None]:
        """Whether every projection is finite and every score within bounds, and the
        shortest length: one synchronisation.

        The spec *replaces* a hidden score by -1e6, which a visible score
        below it would fall under, where SDPA's added ``-inf`` would not: so
        where a key may be hidden (``hides_keys``, or lengths not known to
        hide none) ``max|q| * max|k|`` must keep every score within
        :data:`~mha_multi.spec.FUSED_SCORE_LIMIT`
        (:func:`mha_multi.spec.scores_within_limit`), and a ``bias`` must be
        finite and within ``BIAS_LIMIT``. A cache written in place knows the
        largest key below its ``key_upto`` (:class:`CacheCheck`): only the
        attended keys past it are read.

        SDPA's CPU kernel turns a NaN query row into zeros, and its added
        ``-inf`` mask lets a hidden key's non-finite score reach the weights
        (the check is O(N * d), next to O(N^2 * d) attention); lengths that
        hide nothing need no mask, which lets flash kernels run, and lengths
        > 0 leave no row fully hidden. Under ``torch.compile`` nothing is
        read: the graph chooses on the device (:meth:`guarded`). On a GPU
        the plan asks only where a head's scores are many
        (:func:`mha_multi.spec.reads_values`); a call it does not ask leaves
        the rows it wrote pending, and the next write sums them on the
        device (:meth:`CacheCheck.settled`) for a later call that reads.
        """
        if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
            # (torch.func's transforms wrap values no read may take, torch.vmap's batches.)
            return None, None
        # The keys and values a call attends over count, hidden ones too: SDPA
        # adds -inf to a hidden key's score.
        written = self._take_written(k, v, valid_lens)
        check = None if written is None else written.check
        shortest = None if written is None else written.shortest
        num_keys = k.shape[2 if k.ndim == 4 else 1]
        # (The cache position of k's first: the check counts from 0, k from there.)
        first = 0 if written is None else written.first
        if not hides_keys and valid_lens is not None and shortest is None and self.on_host(q):
            # On the host a read waits for nothing: the lengths first, so that
            # lengths that hide no key need no magnitudes read.
            shortest = valid_lens.min().item()
        # Only a hidden key makes SDPA's added mask differ from the spec's replaced
        # one (a NaN length hides every key).
        bounded = hides_keys or (
            valid_lens is not None and (shortest is None or not shortest >= num_keys)
        )
        keys_read = k  # (the keys whose largest magnitude is read)
        if check is None:
            total = finite_sum(q, k, v, eager=True)
        else:
            # A cache written in place this call: its check stands for the
            # positions below ``upto``; the rows written are read with the
            # queries, and the rest of the span on its own.
            total = finite_sum(q, *check.take_pending(), eager=True)
            if check.upto < first + num_keys:
                rest = (x[:, :, check.upto - first :] for x in (k, v))
                total = total + finite_sum(*rest, eager=True)
                check.upto = first + num_keys
            if check.poison is not None:
                total = total + check.poison
            keys_read = k[:, :, min(max(check.key_upto - first, 0), num_keys) :]
        reads = [total]
        if bounded:
            reads += [*extremes(q), *extremes(keys_read)]
        if bias is not None:
            reads.append(bias.detach().abs().max())  # a NaN max fails the limit too
        if valid_lens is not None and shortest is None:
            reads.append(valid_lens.detach().min())
        read = read_together(reads)  # (one transfer)
        finite = math.isfinite(read[0])
        if check is not None:
            # What the next call of this cache trusts: everything below
            # ``upto`` finite, or (a non-finite query too) not known to be.
            check.poison = None if finite else total * 0.0
        if bounded:
            largest_key = magnitude_of(read[3], read[4])
            if check is not None:
                # And the largest key below the attended positions (where none before
                # them is left unread: those before the window are not attended over).
                if check.key_upto < first + num_keys:
                    largest_key = larger(check.key_max, largest_key)
                    if check.key_upto >= first:
                        check.key_max, check.key_upto = largest_key, first + num_keys
                else:
                    largest_key = check.key_max
            largest_query = magnitude_of(read[1], read[2])
            finite = finite and spec.scores_within_limit(largest_query, largest_key, heads.head_dim)
        if bias is not None:
            finite = finite and read[5 if bounded else 1] <= BIAS_LIMIT
        if valid_lens is None:
            return finite, None
        return finite, read[-1] if shortest is None else shortest


#: The facts every PyTorch layer's call is driven with.
FACTS = TorchFacts()

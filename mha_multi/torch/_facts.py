"""PyTorch's facts, once: dtypes, devices, precision settings, conversions, checks, the kernel.

What the layer needs of PyTorch sits here, below it (docs: "Architecture"):
how a device name maps to a ``torch.device``, which process-wide settings
give exact float32 products, how tensors leave for numpy, and
:class:`TorchFacts`, what the call flow of :mod:`mha_multi.call` asks of
PyTorch: how inputs, lengths, caches and gates are checked, what can be read
on the host, and the fused kernel (``scaled_dot_product_attention``). What
a cache written in place carries from call to call is in
:mod:`mha_multi.torch._cache`. This module imports no layer; what builds
and drives layers is in :mod:`mha_multi.parity.harness.torch`.
"""

from __future__ import annotations

import math
import re
import threading
from typing import Any

import numpy as np
import torch

from mha_multi import call, spec
from mha_multi.torch._cache import (
    CacheCheck,
    Written,
    extremes,
    finite_sum,
    from_host,
    larger,
    magnitude_of,
    read_together,
    versioned,
    writes_in_place,
)
from mha_multi.torch._guard import BIAS_LIMIT, GuardedKernel
from mha_multi.torch._ops import (
    SIXTEEN_BIT,
    TorchOps,
    accumulates_in_float32,
    autocast_off,
    dtype_kind,
    ops_on,
    repeats_grouped_heads,
)
from mha_multi.torch._plain import PlainRoute

__all__ = [
    "DTYPES",
    "FACTS",
    "SDPA",
    "TorchFacts",
    "device",
    "device_description",
    "exact_float32",
    "gpu_available",
    "host_array",
    "lens_to_native",
    "sync",
    "to_native",
    "to_numpy",
]

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

#: PyTorch's fused kernel: it applies dropout itself and adds ``-inf`` where
#: keys are hidden, so it runs only on values read as finite. Its
#: ``enable_gqa`` (PyTorch 2.5 and later) takes grouped key/value heads; a
#: float ``attn_mask`` is an additive bias.
SDPA = spec.FusedKernel(
    "scaled_dot_product_attention",
    takes_dropout=True,
    takes_bias=True,
    takes_grouped_heads=tuple(int(n) for n in re.findall(r"\d+", str(torch.__version__))[:2])
    >= (2, 5),
)


def _tensor_beside(name: str, x: Any, like: torch.Tensor, shape: str) -> torch.Tensor:
    """``x``, a tensor of any dtype, on ``like``'s device; ``shape`` words the TypeError."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(
            f"{name} must be a floating-point torch.Tensor {shape}; got {type(x).__name__}"
        )
    return x.to(like.device)


class TorchFacts(GuardedKernel, PlainRoute, call.Facts):
    """What a call of the PyTorch layer asks of PyTorch (:class:`mha_multi.call.Facts`);
    plain self-attention's fast route is :class:`~mha_multi.torch._plain.PlainRoute`'s."""

    kernel = SDPA
    passes_options = True
    attends_filled = True

    def kernel_takes_grouped(self, q: torch.Tensor, num_queries: Any, head_dim: int) -> bool:
        return not repeats_grouped_heads(q, num_queries, head_dim)

    def span_bucket_of(self, keys: torch.Tensor) -> int:
        """1 on the CPU, whose eager kernels take any length at no cost; on a GPU the spec's bucket.

        CUDA's cuDNN attention (PyTorch's choice for 16-bit SDPA on Hopper)
        builds a plan for each new key length: 33-47 ms a length, measured on
        an H100, which a step that attends one more position each time pays
        at every step.
        """
        return 1 if keys.device.type == "cpu" else spec.SPAN_BUCKET

    def __init__(self) -> None:
        # The check of the cache a call wrote in place, from write_cache to
        # plan_values of the same call (one per thread).
        self._written = threading.local()
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
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(x).__name__}")
        if not x.is_floating_point():
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
        if not isinstance(cache, tuple) or len(cache) != 3:
            raise TypeError(
                f"cache must be a KVCache(keys, values, lengths), as layer.init_cache makes; "
                f"got {type(cache).__name__}"
            )
        cache = spec.KVCache(*cache)
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
            array = np.asarray(positions)
            if array.dtype.kind not in "iuf":
                raise TypeError(
                    f"positions must be an integer tensor or array; got {type(positions).__name__}"
                )
            positions = torch.from_numpy(np.array(array, copy=True))
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
        """One transfer for integer tensors; nothing under ``torch.compile``.

        A cache's lengths as an eager call wrote them are known on the host
        already (:class:`CacheCheck`): a decoding step reads nothing for them.
        """
        if torch.compiler.is_compiling():
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

    def write_cache(
        self,
        ops: Any,
        cache: spec.KVCache,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        valid_lens: torch.Tensor | None,
        *,
        head_dim: int,
        causal: bool,
        fill: spec.CacheFill | None,
    ) -> tuple[spec.KVCache, torch.Tensor]:
        """The new rows written into the cache's own tensors where no gradient needs the old ones.

        An eager call whose lengths were read (``fill``) and that records no
        gradient through the cache writes each example's rows at its own
        positions in place: the returned cache shares ``keys`` and
        ``values`` with the given one (docs: "Generating with a cache").
        Anything else (``torch.compile``, a cache or projections that
        require gradients, an inference tensor outside inference mode) gets
        the spec's functional update.
        """
        in_place = (
            fill is not None
            and k is not None
            and not torch.compiler.is_compiling()
            and writes_in_place(k, v, cache.keys, cache.values)
        )
        if not in_place or k.shape[1] == 0:
            return super().write_cache(
                ops, cache, k, v, valid_lens, head_dim=head_dim, causal=causal, fill=fill
            )
        # (The driver has checked the cache's dtypes against the projections'.)
        num_new = k.shape[1]
        first = fill.uniform_start(num_new)
        if first is None:
            # Each example's rows at its own positions, one index for both arrays.
            examples, steps = np.nonzero(np.arange(num_new)[None, :] < fill.new[:, None])
            index = [
                from_host(i, k.device, None)
                for i in (examples, steps, fill.lengths[examples] + steps)
            ]
        # Before writing: the versions the lengths' check was made for.
        prior = CacheCheck.of(cache)
        poison, upto = (None, 0) if prior is None else (prior.settled(), prior.upto)
        if first == upto:
            upto = first + num_new  # every example's next rows, checked as written
        for held, x in ((cache.keys, k), (cache.values, v)):
            rows = x.unflatten(-1, (held.shape[1], head_dim))  # (B, T, H_kv, dh)
            if first is not None:
                held.narrow(2, first, num_new).copy_(rows.transpose(1, 2))
            elif index[0].numel():
                # Advanced indices around a slice put the rows' axis first: (N, H_kv, dh).
                held[index[0], :, index[2]] = rows[index[0], index[1]]
        # The lengths are on the host already: the new ones are computed there.
        held = fill.held
        seen = fill.visibility(num_new, causal=causal)
        if first is None or cache.lengths.device.type == "cpu":
            with versioned():
                lengths = from_host(held, cache.lengths.device, cache.lengths.dtype)
            visible = from_host(seen, k.device, None)
        else:
            # Every example appends its rows at one position: the device
            # computes the same numbers from its own lengths, and no copy
            # from the host (which waits for the device) is made.
            new = spec.appended(ops, cache.lengths, None, num_new)
            with versioned():
                lengths = cache.lengths + new
            # The host's shape: (B, T) only where causal and T > 1.
            visible = spec.cached_visibility(
                ops, cache.lengths, new, num_new, causal=seen.ndim == 2
            )
        updated = spec.KVCache(cache.keys, cache.values, lengths)
        # Padding rows are checked too: at worst the generic path.
        check = CacheCheck.attach(updated, poison, upto, held, pending=(k, v))
        if check is not None:
            # (Rows are written from each example's length on, where it appends any.)
            below = int(fill.lengths[fill.new > 0].min(initial=cache.keys.shape[2]))
            check.written_past(prior, below, int(held.max(initial=0)))
        # What the queries see: the lengths held, or causal (B, T) at least as many.
        shortest = fill.least if seen.ndim == 1 else int(seen.min()) if seen.size else None
        self._written.call = Written(check, visible, shortest)
        return updated, visible

    def empty_cache(self, cache: spec.KVCache) -> spec.KVCache:
        """``cache``, all of whose ``lengths`` are 0, carrying that on the host.

        Its first call then reads no lengths back from the device. (Inference
        tensors keep no version counter to trust it by: they carry nothing.)
        """
        check = CacheCheck.attach(
            cache, None, 0, np.zeros(cache.lengths.shape, np.int64), pending=None
        )
        if check is not None:
            check.finite_from = 0  # (zeros)
            check.key_upto = cache.keys.shape[2]  # (zeros: key_max 0)
        return cache

    def cache_prefix(
        self, keys: torch.Tensor, values: torch.Tensor, span: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        prefix = keys.narrow(2, 0, span), values.narrow(2, 0, span)
        written = self._written_into(keys, values)
        if written is not None:
            written.attended = prefix  # what the plan may take the check for
        return prefix

    def finite_past(self, keys: torch.Tensor, values: torch.Tensor, span: int) -> bool:
        """Known where the check of the cache this call wrote in place knows it
        (:attr:`CacheCheck.finite_from`); otherwise read on the host, one sum (and
        then known to the calls after), and not known on a GPU, where the read
        would wait for the device."""
        written = self._written_into(keys, values)
        check = None if written is None else written.check
        if check is not None and check.finite_from is not None and check.finite_from <= span:
            return True
        if torch.compiler.is_compiling() or not self.on_host(values):
            return False
        rest = values.detach().narrow(2, span, values.shape[2] - span)
        if not math.isfinite(rest.sum(dtype=torch.float32).item()):
            return False
        if check is not None:
            check.finite_from = span
        return True

    def on_host(self, q: torch.Tensor) -> bool:
        return q.is_cpu

    def records_gradient(self, q: torch.Tensor) -> bool:
        return q.requires_grad

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
        if torch.compiler.is_compiling():
            return None, None
        # The keys and values a call attends over count, hidden ones too: SDPA
        # adds -inf to a hidden key's score.
        written = self._take_written(k, v, valid_lens)
        check = None if written is None else written.check
        shortest = None if written is None else written.shortest
        num_keys = k.shape[2 if k.dim() == 4 else 1]
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
            total = finite_sum(q, k, v)
        else:
            # A cache written in place this call: its check stands for the
            # positions below ``upto``; the rows written are read with the
            # queries, and the rest of the span on its own.
            total = finite_sum(q, *check.take_pending())
            if check.upto < num_keys:
                total = total + finite_sum(*(x[:, :, check.upto :] for x in (k, v)))
                check.upto = num_keys
            if check.poison is not None:
                total = total + check.poison
            keys_read = k[:, :, min(check.key_upto, num_keys) :]
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
                # And the largest key below the attended positions.
                if check.key_upto < num_keys:
                    largest_key = larger(check.key_max, largest_key)
                    check.key_max, check.key_upto = largest_key, num_keys
                else:
                    largest_key = check.key_max
            largest_query = magnitude_of(read[1], read[2])
            finite = finite and spec.scores_within_limit(largest_query, largest_key, heads.head_dim)
        if bias is not None:
            finite = finite and read[5 if bounded else 1] <= BIAS_LIMIT
        if valid_lens is None:
            return finite, None
        return finite, read[-1] if shortest is None else shortest

    def _written_into(self, keys: torch.Tensor, values: torch.Tensor) -> Written | None:
        """What :meth:`write_cache` of this call knew, where it wrote into ``keys`` and
        ``values`` in place and its check still describes them."""
        written = getattr(self._written, "call", None)
        if written is None or written.check is None:
            return None
        return written if written.check.holds(keys, values) else None

    def _take_written(
        self, k: torch.Tensor, v: torch.Tensor, valid_lens: torch.Tensor | None
    ) -> Written | None:
        """What :meth:`write_cache` of this call knew, where ``k``, ``v`` are that cache.

        ``k`` and ``v`` must be the cache's arrays, or the leading positions
        :meth:`cache_prefix` gave this call; ``valid_lens`` the visibility
        the write returned.
        """
        written = getattr(self._written, "call", None)
        self._written.call = None
        if written is None or valid_lens is not written.visible:
            return None
        check = written.check
        if check is None:
            return written
        attended = written.attended or (check.keys(), check.values())
        return written if k is attended[0] and v is attended[1] else None

    def fused_attention(
        self,
        ops: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        valid_lens: torch.Tensor | None,
        plan: spec.KernelPlan,
        *,
        heads: spec.Heads,
        kv_split: bool,
        dropout_rate: float,
        options: spec.ScoreOptions = spec.NO_OPTIONS,
    ) -> torch.Tensor:
        """``scaled_dot_product_attention`` with the spec's masking semantics.

        The call's bias and ALiBi reach SDPA as a float ``attn_mask``
        (:func:`mha_multi.spec.score_bias`), ``-inf`` where the plan's mask
        hides a key; the window is in the boolean mask.

        Grouped key/value heads reach SDPA as they are, with ``enable_gqa``
        (query head ``h`` reads key/value head ``h // G``, the spec's rule);
        a PyTorch whose SDPA has no ``enable_gqa`` gets them repeated, once,
        on the projected heads (the plan's ``repeat_kv``), and so do float32
        heads on CUDA, whose kernels with ``enable_gqa`` hold every score
        (:meth:`kernel_takes_grouped`).

        Args:
            q: projected queries ``(B, Q, num_heads * head_dim)``.
            k: projected keys ``(B, K, num_kv_heads * head_dim)``, or with
                ``kv_split`` ``(B, num_kv_heads, K, head_dim)``, SDPA's own
                layout (a cache's).
            v: projected values, as ``k``.
            plan: what :func:`mha_multi.call.plan` decided the kernel is given.

        Returns:
            The concatenated heads ``(B, Q, num_heads * head_dim)``.
        """
        num_queries, num_keys = q.shape[1], k.shape[-2]
        dtype = v.dtype
        if dtype in SIXTEEN_BIT and not accumulates_in_float32(q.device):
            # CPU kernels may sum 16-bit products in 16 bits: float32 copies,
            # one rounding at the end.
            q, k, v = q.float(), k.float(), v.float()
        # (B, T, H*dh) -> (B, H, T, dh): the spec's head layout, unflattened.
        q = q.unflatten(-1, (heads.num_heads, heads.head_dim)).transpose(1, 2)
        if not kv_split:
            k, v = (
                x.unflatten(-1, (heads.num_kv_heads, heads.head_dim)).transpose(1, 2)
                for x in (k, v)
            )
        if plan.repeat_kv:
            k, v = (x.repeat_interleave(heads.group_size, dim=1) for x in (k, v))
        grouped = heads.grouped and not plan.repeat_kv
        mask = plan.mask(ops, num_queries, num_keys, valid_lens, options)
        if plan.bias:
            bias = spec.score_bias(ops, options, num_queries, num_keys, q)
            mask = bias if mask is None else torch.where(mask, bias, float("-inf"))
        with autocast_off(q.device):
            output = torch.nn.functional.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=mask,
                dropout_p=dropout_rate,
                is_causal=plan.is_causal,
                # Passed only where needed: PyTorch before 2.5 has no such argument.
                **({"enable_gqa": True} if grouped else {}),
            )
        visible = plan.fix_visibility(ops, num_queries, num_keys, valid_lens, options)
        output = spec.fix_fully_hidden_rows(
            ops, output, v, visible, heads_axis=1, group_size=heads.group_size if grouped else 1
        )
        output = output.transpose(1, 2).flatten(2)
        return output if output.dtype == dtype else output.to(dtype)


#: The facts every PyTorch layer's call is driven with.
FACTS = TorchFacts()

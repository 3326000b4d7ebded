"""How the PyTorch facts write a cache in place, and what the write hands the call's plan.

An eager call whose lengths were read and that records no gradient through
its cache writes each example's new rows into the cache's own tensors
(:meth:`CacheWrites.write_cache`, docs: "Generating with a cache"), and
attaches to the new lengths what it knows of them (:class:`CacheCheck`).
What the write knew reaches the same call's plan through the facts
(:class:`Written`, one per thread), so that a decoding step reads only the
rows it wrote and the positions its span adds. A part of the PyTorch facts
(:class:`mha_multi.torch._facts.TorchFacts`); this module imports nothing
of them.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import numpy as np
import torch

from mha_multi import call, spec
from mha_multi.torch._cache import CacheCheck, Written, from_host, versioned, writes_in_place
from mha_multi.torch._compiled_cache import write_in_place
from mha_multi.torch._compiled_cache import writes_in_place as compiled_writes_in_place

__all__ = ["CacheWrites"]


class CacheWrites(call.Facts):
    """:meth:`mha_multi.call.Facts.write_cache` in place, and what it hands the plan,
    of the PyTorch facts (whose ``on_host`` it reads)."""

    def __init__(self) -> None:
        # The check of the cache a call wrote in place, from write_cache to
        # plan_values of the same call (one per thread).
        self._written = threading.local()

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
        So does a call under ``torch.compile`` that records no gradient
        through the cache, into arrays that are each contiguous, with one
        indexed write per array and no value read
        (:func:`~mha_multi.torch._compiled_cache.writes_in_place`). Anything
        else (a cache or projections that require gradients, an inference
        tensor outside inference mode) gets the spec's functional update.
        """
        compiling = torch.compiler.is_compiling()
        if compiling and k is not None and compiled_writes_in_place(k, v, cache.keys, cache.values):
            # Static shapes, no value read: one indexed write per array (docs:
            # "Errors, and what compiled code does").
            return write_in_place(ops, cache, k, v, valid_lens, head_dim=head_dim, causal=causal)
        in_place = (
            fill is not None
            and k is not None
            and not compiling
            and writes_in_place(k, v, cache.keys, cache.values)
        )
        if not in_place or k.shape[1] == 0:
            return super().write_cache(
                ops, cache, k, v, valid_lens, head_dim=head_dim, causal=causal, fill=fill
            )
        # (The driver has checked the cache's dtypes against the projections'.)
        num_new = k.shape[1]
        first = fill.uniform_start(num_new)
        # Whether every example appends all its num_new rows (a ragged decoding step).
        appends_all = fill.new.size > 0 and int(fill.new.min()) == num_new
        if first is None and appends_all:
            # Rows (B, T) at positions lengths[b] + t: one index of both, no gather of
            # the rows (advanced indices around a slice put their (B, T) axes first).
            steps = np.arange(num_new)
            index = from_host(
                np.stack(
                    np.broadcast_arrays(
                        np.arange(fill.new.size)[:, None], fill.lengths[:, None] + steps
                    )
                ),
                k.device,
                None,
            )
        elif first is None:
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
            elif appends_all:
                held[index[0], :, index[1]] = rows
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
            if appends_all:  # (the lengths' least and most, known: no reductions)
                below, filled = fill.least - num_new, fill.most
            else:
                below = int(fill.lengths[fill.new > 0].min(initial=cache.keys.shape[2]))
                filled = int(held.max(initial=0))
            check.written_past(prior, below, filled)
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
        self, keys: torch.Tensor, values: torch.Tensor, span: int, first: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        prefix = keys.narrow(2, first, span - first), values.narrow(2, first, span - first)
        written = self._written_into(keys, values)
        if written is not None:
            written.attended = prefix  # what the plan may take the check for
        return prefix

    def finite_before(self, keys: torch.Tensor, values: torch.Tensor, first: int) -> bool:
        """Known where the check of the cache this call wrote in place holds every position
        below ``first`` finite (below its ``upto``; this call's own rows, past them, its
        plan reads): read so by the calls before, or, with rows no call read (the
        poison its write summed them into), that poison read on the host (and then
        known to the calls after); not known on a GPU, where the read would wait."""
        written = self._written_into(keys, values)
        check = None if written is None else written.check
        if check is None or check.pending_from is not None or check.upto < first:
            return False
        if check.poison is not None:
            if not self.on_host(values) or not math.isfinite(check.poison.item()):
                return False
            check.poison = None
        return True

    def lengths_from(self, ops: Any, valid_lens: torch.Tensor, first: int) -> torch.Tensor:
        """:meth:`mha_multi.call.Facts.lengths_from`, and what this call's write handed
        its plan counted from there too (:class:`Written`)."""
        shifted = valid_lens - first
        written = getattr(self._written, "call", None)
        if written is not None and written.visible is valid_lens:
            written.visible, written.first = shifted, first
            if written.shortest is not None:
                written.shortest -= first
        return shifted

    def finite_past(self, keys: torch.Tensor, values: torch.Tensor, span: int) -> bool:
        """Known where the check of the cache this call wrote in place knows it
        (:attr:`CacheCheck.finite_from`); otherwise read on the host, one sum (and
        then known to the calls after), and not known on a GPU, where the read
        would wait for the device (nor under ``torch.func``'s transforms, whose values
        no read may take)."""
        written = self._written_into(keys, values)
        check = None if written is None else written.check
        if check is not None and check.finite_from is not None and check.finite_from <= span:
            return True
        if (
            torch.compiler.is_compiling()
            or not self.on_host(values)
            or torch._C._are_functorch_transforms_active()
        ):
            return False
        rest = values.detach().narrow(2, span, values.shape[2] - span)
        if not math.isfinite(rest.sum(dtype=torch.float32).item()):
            return False
        if check is not None:
            check.finite_from = span
        return True

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

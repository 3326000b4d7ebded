"""What an eager PyTorch call knows of a cache it wrote in place.

A cache written in place under ``torch.no_grad()`` carries, beside its lengths
tensor (:data:`CHECKS`), what the call that wrote it knew (:class:`CacheCheck`): the lengths
on the host, and whether every position it attended over and every row it
wrote was finite (one sum, :func:`mha_multi.torch._reads.finite_sum`); the
next call trusts this only for the same tensors unchanged since (docs:
"Generating with a cache"). This module sits below the facts
(:mod:`mha_multi.torch._facts`) and imports nothing of them.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any

import numpy as np
import torch

from mha_multi import spec
from mha_multi.torch._compiled_cache import records_gradient
from mha_multi.torch._reads import finite_sum

__all__ = [
    "CHECKS",
    "CacheCheck",
    "Written",
    "carried_check",
    "from_host",
    "poison_of",
    "versioned",
    "writes_in_place",
]


class CacheCheck:
    """What the lengths of a cache written in place carry: what the call knew of it.

    ``poison`` is ``None`` (nothing known yet) or a 0-d float32 on the
    cache's device, never read by the call that makes it: 0 where the
    positions below ``upto``, and every row the calls wrote, are finite, NaN
    otherwise (:func:`poison_of`). ``pending`` are the rows this call wrote,
    until the plan checks them together with the queries (one pass over
    self-attention's stacked projection); after plain steps on a GPU, which
    read nothing, ``()`` and ``pending_from``: the cache's positions from
    there up to ``upto``, which the steps wrote (one pass over all of them,
    when a call reads or a write settles them, :meth:`take_pending`).
    ``finite_from``: every value at that position and past it is known
    finite (``None``: not known), so that a call may attend over fewer
    positions (:meth:`mha_multi.call.Facts.finite_past`): 0 for a new cache,
    and past the rows each call writes. ``key_max`` is ``max|k|`` over
    the keys below ``key_upto`` (NaN where one is not finite), which bounds
    the scores a masked fused kernel may take
    (:func:`mha_multi.spec.scores_within_limit`): all ``max_length`` of a
    new cache's zeros, then below the rows each call writes, and up to the
    attended span once a call has read the rest. ``lengths`` are the new
    lengths on the host (``lengths + added``, added when first asked for: a
    decoding step's check adds 1 to its last one's). The next call trusts
    all this only for the same tensors unchanged since (their version
    counters and addresses), so that a decoding step checks its new rows and the
    positions its span adds instead of the whole cache, and reads no lengths
    back.
    """

    def __init__(
        self,
        cache: spec.KVCache,
        poison: torch.Tensor | None,
        upto: int,
        lengths: np.ndarray,
        pending: tuple[torch.Tensor, torch.Tensor] | None,
        added: int = 0,
    ) -> None:
        self.keys, self.values = weakref.ref(cache.keys), weakref.ref(cache.values)
        self.versions = (cache.keys._version, cache.values._version)
        # (And their addresses: storage swapped in through .data keeps the version counter.)
        self.addresses = (cache.keys.data_ptr(), cache.values.data_ptr())
        self.poison, self.upto = poison, upto
        self.pending: tuple[torch.Tensor, ...] | None = pending
        self.pending_from: int | None = None
        self.finite_from: int | None = None
        self.key_max, self.key_upto = 0.0, 0
        self._held, self._added = lengths, added
        #: How many examples the lengths are for.
        self.examples: int = lengths.size
        self.lengths_version = cache.lengths._version
        self.lengths_address = cache.lengths.data_ptr()
        self._uniform: int | None = -1  # not known yet
        #: What the plain step that wrote the cache decided (``StepRoute.plain_step``):
        #: ``(layer, key, plan)``, for the next step of that layer and key.
        self.step: tuple[Any, tuple, Any] | None = None
        #: The lengths tensor that carries this check, weakly, and its id, the check's key
        #: in :data:`CHECKS` (:func:`carried_check`).
        self.carrier: weakref.ref[torch.Tensor] = weakref.ref(cache.lengths)
        self.key = id(cache.lengths)
        #: The lengths of the plain steps to come (:func:`next_lengths`), from the step
        #: whose first example's length is ``bank_from``.
        self.bank: list[torch.Tensor | None] | None = None
        self.bank_from = 0
        #: The arrays in the layouts a step's products take (:meth:`attended`); ``()``
        #: where they are no views.
        self._flat: tuple[torch.Tensor, ...] | None = None
        #: The last positions :meth:`attended` viewed, ``(first, count, views)``.
        self._attended: tuple[int, int, tuple[torch.Tensor, torch.Tensor]] | None = None

    @property
    def lengths(self) -> np.ndarray:
        """``cache.lengths`` on the host, while the tensor keeps ``lengths_version``."""
        if self._added:
            self._held, self._added = self._held + self._added, 0
        return self._held

    @property
    def uniform(self) -> int | None:
        """The length every example has, or ``None`` where they differ (or there are none)."""
        if self._uniform == -1:
            held = self.lengths
            first = int(held[0]) if held.ndim == 1 and held.size else None
            self._uniform = first if first is not None and (held == first).all() else None
        return self._uniform

    def stepped(
        self,
        updated: spec.KVCache,
        filled: int,
        step: tuple[Any, tuple, Any] | None,
        previous: torch.Tensor,
        *,
        poison: torch.Tensor | None = None,
        pending: tuple[torch.Tensor, ...] | None = None,
    ) -> CacheCheck:
        """This check moved on to ``updated``, which a plain step made from its cache (of
        lengths ``previous``) by writing one row at every example's length into the same
        arrays, and carried by its new lengths (a tensor made outside inference mode,
        :func:`versioned`).

        :meth:`attach` and :meth:`written_past` in one, made at every plain decoding
        step in place: the arrays are this check's, so their weak references and sizes
        are kept, and none of them is an inference tensor (this check holds them). The
        write moved the arrays' versions, so the check no longer held for ``previous``,
        which it leaves: a call given those lengths again reads them, as it reads a
        cache's that carries no check.
        """
        # (Every field a step changes, set here: written_past's inline, a step's cost is
        # such work.)
        finite_from, key_upto = self.finite_from, self.key_upto
        if key_upto >= filled:
            key_upto = filled - 1
        lengths = updated.lengths
        self.versions = (updated.keys._version, updated.values._version)
        self.poison, self.upto, self.pending, self.pending_from = poison, filled, pending, None
        self._added += 1
        self.lengths_version, self._uniform, self.step = lengths._version, filled, step
        self.lengths_address = lengths.data_ptr()
        # (max and min: builtins' calls, spelled out: a step's cost is such work.)
        if finite_from is not None and finite_from < filled:
            self.finite_from = filled
        self.key_upto = key_upto
        if not key_upto:
            self.key_max = 0.0  # (a bound of nothing)
        # (_carry's, inline: every step moves its check.)
        CHECKS.pop(self.key, None)  # (previous's)
        self.key = key = id(lengths)
        CHECKS[key] = self
        self.carrier = weakref.ref(lengths, lambda _: CHECKS.pop(key, None))
        return self

    def ragged_stepped(
        self,
        updated: spec.KVCache,
        held: np.ndarray,
        step: tuple[Any, tuple, Any] | None,
        previous: torch.Tensor,
        *,
        upto: int,
        finite_from: int | None,
        key_upto: int,
        key_max: float,
        poison: torch.Tensor | None,
        pending: tuple[torch.Tensor, ...] | None,
    ) -> CacheCheck:
        """This check moved on to ``updated``, which a ragged step made from its cache (of
        lengths ``previous``, which it leaves: :meth:`stepped`) by writing one row at
        each example's own length (``held``: the lengths now), with
        what the generic flow's write and plan leave in the check they make for such a
        step (:meth:`attach`, :meth:`written_past`,
        :meth:`mha_multi.torch._facts.TorchFacts.plan_values`): the positions below
        ``upto`` and the rows written finite (NaN ``poison`` where not), those from
        ``finite_from`` on finite, the keys below ``key_upto`` at most ``key_max``, and
        the rows left ``pending`` (a step that reads nothing), as
        :func:`mha_multi.torch._ragged.ragged_step` says."""
        # A plain step's check (of no one length: 0) but for its lengths and what it
        # knows of the positions.
        check = self.stepped(updated, 0, step, previous, poison=poison, pending=pending)
        check.__dict__.update(
            _held=held,
            _added=0,
            _uniform=None,  # (one added to lengths that differ)
            upto=upto,
            finite_from=finite_from,
            key_upto=key_upto,
            key_max=key_max,
        )
        return check

    @classmethod
    def attach(
        cls, cache: spec.KVCache, *state: Any, uniform: int | None = -1, **named: Any
    ) -> CacheCheck | None:
        """A new check carried by ``cache.lengths`` (``state``, ``named``: the
        constructor's other arguments; ``uniform`` where known), or ``None`` where one
        of the cache's tensors is an inference tensor: those keep no version counter
        to trust a check by."""
        if cache.keys.is_inference() or cache.values.is_inference() or cache.lengths.is_inference():
            return None
        check = cls(cache, *state, **named)
        check._uniform = uniform
        _carry(check, cache.lengths)
        return check

    def written_past(self, prior: CacheCheck | None, first: int, filled: int) -> None:
        """What ``prior``, the check of the cache before a write of positions from
        ``first`` to below ``filled``, knew of the positions the write left alone:
        from ``filled`` on (:attr:`finite_from`) and below ``first`` (:attr:`key_max`)."""
        if prior is None:
            return
        if prior.finite_from is not None:
            self.finite_from = max(prior.finite_from, filled)
        self.key_upto = min(prior.key_upto, first)
        self.key_max = prior.key_max if self.key_upto else 0.0  # (a bound of nothing)

    def holds(self, keys: torch.Tensor, values: torch.Tensor) -> bool:
        """Whether this check describes ``keys`` and ``values`` as they are."""
        return (
            keys is self.keys()
            and values is self.values()
            and (keys._version, values._version) == self.versions
            and (keys.data_ptr(), values.data_ptr()) == self.addresses
        )

    @staticmethod
    def of(cache: spec.KVCache) -> CacheCheck | None:
        """The check ``cache``'s lengths carry, where it still describes its arrays."""
        check = carried_check(cache.lengths)
        keys, values = cache.keys, cache.values
        # Inference tensors keep no version counter: nothing would tell an edit.
        if check is None or keys.is_inference() or values.is_inference():
            return None
        return check if check.holds(keys, values) else None

    def add(self, poison: torch.Tensor) -> None:
        self.poison = poison if self.poison is None else self.poison + poison

    def settled(self) -> torch.Tensor | None:
        """The poison with the pending rows checked (where no plan checked them)."""
        if self.pending is not None:
            self.add(poison_of(*self.take_pending()))
        return self.poison

    def take_pending(self) -> tuple[torch.Tensor, ...]:
        """The pending rows (none: ``()``), which the caller checks: those plain steps
        left (``pending_from`` on, up to ``upto``) made views of only now."""
        pending, start = self.pending or (), self.pending_from
        self.pending = self.pending_from = None
        if start is None:
            return pending
        keys, values, count = self.keys(), self.values(), self.upto - start
        return keys.narrow(2, start, count), values.narrow(2, start, count)

    def attended(self, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The cache's positions ``first`` to ``first + count`` as a step's products take
        them (:func:`mha_multi.torch._steps.step_attention`): the keys ``(B*H_kv, dh,
        count)`` and the values ``(B*H_kv, count, dh)``.

        Views of views of the arrays made once for this check (a step's host time is
        counted in operations: docs, "Results"), which the check holds while it
        lives; the last positions' views are kept, which the steps of one span (a
        GPU's, rounded up to its bucket) share. Arrays whose examples and heads do
        not lie as one dimension (each head's examples together) have no such
        views: their positions are copied at each call instead.
        """
        last = self._attended
        if last is not None and last[0] == first and last[1] == count:
            return last[2]
        flat = self._flat
        if flat is None:
            keys, values = self.keys(), self.values()
            try:
                flat = (
                    keys.view(-1, *keys.shape[2:]).transpose(1, 2),
                    values.view(-1, *values.shape[2:]),
                )
            except RuntimeError:  # (view's refusal: no view of those strides)
                flat = ()
            self._flat = flat
        if not flat:
            keys, values = self.keys(), self.values()
            return (
                keys.narrow(2, first, count).flatten(0, 1).transpose(1, 2),
                values.narrow(2, first, count).flatten(0, 1),
            )
        views = flat[0].narrow(2, first, count), flat[1].narrow(1, first, count)
        self._attended = (first, count, views)
        return views

    @staticmethod
    def host_lengths(lengths: torch.Tensor) -> np.ndarray | None:
        """``lengths`` as the call that made it left them, where it is unchanged since."""
        check = carried_check(lengths)
        if (
            check is None
            or lengths.is_inference()
            or lengths._version != check.lengths_version
            or lengths.data_ptr() != check.lengths_address
        ):
            return None
        return check.lengths.copy()


class Written:
    """What a call's in-place cache write tells the same call's plan.

    ``check`` is the check the new lengths carry (``None`` for inference
    tensors); ``visible`` the visibility the write returned, and
    ``shortest`` its smallest entry as known on the host; ``attended`` the
    cache's positions the call attends over (:meth:`TorchFacts.cache_prefix`),
    ``None`` while it attends over the whole cache, and ``first`` the first
    of them (where the call leaves out the positions before its window,
    ``visible`` and ``shortest`` count from there:
    :meth:`TorchFacts.lengths_from`).
    """

    __slots__ = ("_attended", "_check", "first", "shortest", "visible")

    def __init__(
        self, check: CacheCheck | None, visible: torch.Tensor, shortest: int | None
    ) -> None:
        # The check and the positions held weakly: a call whose plan took none of this
        # leaves it to the next write, and a cache its caller drops must go at once.
        self._check = None if check is None else weakref.ref(check)
        self.visible, self.shortest = visible, shortest
        self._attended: tuple[weakref.ref, weakref.ref] | None = None
        self.first = 0

    @property
    def check(self) -> CacheCheck | None:
        return None if self._check is None else self._check()

    @property
    def attended(self) -> tuple[torch.Tensor | None, torch.Tensor | None] | None:
        attended = self._attended
        return None if attended is None else (attended[0](), attended[1]())

    @attended.setter
    def attended(self, prefix: tuple[torch.Tensor, torch.Tensor]) -> None:
        self._attended = weakref.ref(prefix[0]), weakref.ref(prefix[1])


#: numpy's dtype of the integer torch dtypes lengths may have.
_NUMPY_INTEGERS = {torch.int32: np.int32, torch.int64: np.int64}


def from_host(array: np.ndarray, device: torch.device, dtype: torch.dtype | None) -> torch.Tensor:
    """A numpy array as a tensor on ``device`` (of ``dtype``), converted on the host.

    To a CUDA device the copy goes through pinned memory, without waiting
    for the device: a copy from pageable memory waits for it.
    """
    if dtype in _NUMPY_INTEGERS:
        array = array.astype(_NUMPY_INTEGERS[dtype], copy=False)
    tensor = torch.from_numpy(array)
    if dtype is not None and tensor.dtype != dtype:
        tensor = tensor.to(dtype)
    if device.type == "cuda":
        # The pinned block stays the caching host allocator's until the copy is done.
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor if device.type == "cpu" else tensor.to(device)


#: The checks lengths tensors carry: ``id(lengths)`` -> its check, whose ``carrier`` is
#: that tensor, weakly (:func:`carried_check`). A table rather than an attribute of the
#: tensor: a tensor pickles its attributes (``torch.save``), and a check holds weak
#: references, which no pickle takes. (Keras' ``WrittenLengths`` keeps such a table.)
CHECKS: dict[int, CacheCheck] = {}


def carried_check(lengths: torch.Tensor) -> CacheCheck | None:
    """The check ``lengths`` carries, if any (:data:`CHECKS`)."""
    check = CHECKS.get(id(lengths))
    return check if check is not None and check.carrier() is lengths else None


def _carry(check: CacheCheck, lengths: torch.Tensor) -> None:
    """``check`` carried by ``lengths`` from now on (:data:`CHECKS`): its entry goes with
    the tensor, before the id can name another."""
    check.key = key = id(lengths)
    CHECKS[key] = check
    check.carrier = weakref.ref(lengths, lambda _: CHECKS.pop(key, None))


#: A context manager that does nothing (reusable: it holds no state).
_NOTHING = contextlib.nullcontext()


def versioned() -> contextlib.AbstractContextManager[Any]:
    """Where the arrays of a cache are made: outside ``torch.inference_mode``.

    Tensors made in inference mode keep no version counter, which a
    :class:`CacheCheck` is trusted by; ordinary tensors written in place in
    inference mode still count their versions. So a cache, and the lengths
    of each call's cache, are ordinary tensors, and a decode run entirely
    under ``torch.inference_mode()`` keeps its checks.
    """
    return torch.inference_mode(False) if torch.is_inference_mode_enabled() else _NOTHING


def writes_in_place(
    k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
) -> bool:
    """Whether an eager call may copy its new rows ``k``, ``v`` into a cache's ``keys``,
    ``values``: no gradient recorded through any of them, no inference tensor
    written outside inference mode, no ``torch.func`` transform active (under
    ``torch.vmap`` each example's rows make its own cache), and no two of the cache's
    elements in the same memory (:func:`_apart`) (docs: "Generating with a cache")."""
    if records_gradient(k, v, keys, values) or torch._C._are_functorch_transforms_active():
        return False
    if not torch.is_inference_mode_enabled() and (keys.is_inference() or values.is_inference()):
        return False
    return _apart(keys, values)


def _apart(keys: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether no element of a cache's arrays shares memory with another: a row written
    in place then changes no other. An expanded view's examples share theirs, and one
    array given as both keys and values shares all (docs: "Generating with a cache").

    Sufficient, not necessary: each array's dimensions, by stride, each step past
    all the smaller ones reach, and the two arrays' memory ranges apart (arrays
    interleaved in one buffer are taken for overlapping, and written as new ones).
    """
    ranges = []
    for array in (keys, values):
        reach = 0  # (the farthest element the smaller strides reach, in elements)
        for stride, size in sorted(zip(array.stride(), array.shape, strict=True)):
            if size == 0:
                return True  # (no element at all)
            if size > 1:
                if stride <= reach:
                    return False
                reach += stride * (size - 1)
        start = array.data_ptr()
        ranges.append((start, start + (reach + 1) * array.element_size()))
    (keys_start, keys_end), (values_start, values_end) = ranges
    return keys_end <= values_start or values_end <= keys_start


#: How many plain steps' lengths :func:`next_lengths` makes at once. (Each is an object
#: Python's garbage collector tracks, alive until its step: made by the hundred, as many
#: as 1024 at once, they set off the collector's passes, whose full ones walk every
#: object of the process, tens of milliseconds beside PyTorch, within a decoding loop.)
_BANKED = 64


def next_lengths(
    check: CacheCheck, lengths: torch.Tensor, filled: int, held: np.ndarray | None = None
) -> torch.Tensor:
    """A new lengths tensor like ``lengths`` (the cache's, whose check is ``check``),
    ``filled`` for every example: the lengths of a plain step's cache; with ``held``,
    the new lengths of a ragged step (:func:`mha_multi.torch._ragged.ragged_step`),
    whose first is ``filled``.

    A row of :attr:`CacheCheck.bank`, the lengths of the next :data:`_BANKED`
    steps made at once where the lengths live (no copy from the host for a plain
    step's), outside inference mode (:func:`versioned`): a view made in
    inference mode of such a tensor is no inference tensor, so each step's
    lengths keep a version counter (the bank's, which an edit of any step's
    lengths moves: the steps after it then check their caches again). Each step
    adds one to every example's length, so a step's row is found by its first;
    each row is handed out once, so that a cache's lengths are its own memory.
    """
    # A row handed out leaves the bank: the check it carries then holds no reference to
    # it, and a cache its caller drops goes at once, with no cycle for the collector.
    bank = check.bank
    if bank is not None:
        row = filled - check.bank_from
        if 0 <= row < _BANKED:
            taken = bank[row]
            if taken is not None:
                bank[row] = None
                return taken
    with versioned():
        if held is None:
            steps = torch.arange(
                filled, filled + _BANKED, dtype=lengths.dtype, device=lengths.device
            )
            # (The rows as views made at once: a step takes one with no operation.)
            bank = steps.unsqueeze(1).repeat(1, lengths.shape[0]).unbind(0)
        else:
            steps = torch.arange(_BANKED, dtype=lengths.dtype, device=lengths.device)
            bank = (from_host(held, lengths.device, lengths.dtype) + steps.unsqueeze(1)).unbind(0)
    check.bank, check.bank_from = [None, *bank[1:]], filled
    return bank[0]


def poison_of(*tensors: torch.Tensor) -> torch.Tensor:
    """0 where every element of ``tensors`` is finite, else NaN: poisons add up."""
    return finite_sum(*tensors) * 0.0

"""Pure checks and plans computed once per arguments: a call's verdicts as lookups.

A call's checks and plan depend on shapes and flags alone, so every call of a
layer after the first with the same shapes can be a lookup: a small call's
fixed cost is mostly such Python work. A tracer that must see the function
run (``torch.compile``'s warns about every ``functools.lru_cache`` it passes
through) is named by the framework's facts, never looked for here
(:func:`skip_while`): the spec knows no framework.

What a call's signature decides beyond such a verdict (a framework's route
plan, a compiled program, a kernel decision, rotary tables) is kept in a
:class:`Kept` table, the one kind of table every framework's plans live in
(docs: "Fast paths"): a table of a layer's own in :class:`KeptBy`.
"""

from __future__ import annotations

import functools
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

__all__ = ["Kept", "KeptBy", "decided_once", "skip_while"]

V = TypeVar("V")


class Kept(OrderedDict[Hashable, V]):
    """What calls of one signature share, made by the first and kept: at most ``size``
    signatures, the oldest kept dropped first.

    A table is a dict: a lookup (``get``, ``in``) is a dict's and nothing
    more, since every call asks. A key that cannot be hashed (a setting
    holding an array) raises ``TypeError`` there as in any dict: what the
    caller makes for such a signature is made each time, never kept. A
    caller that moves what it finds to the end (``move_to_end``) drops the
    least recently used first. ``made_for``: what the table's values were
    made for besides their keys (:meth:`KeptBy.of`).
    """

    def __init__(self, size: int, *, made_for: Any = None) -> None:
        super().__init__()
        self.size = size
        self.made_for = made_for

    def keep(self, key: Hashable, value: V) -> V:
        """Keeps ``value`` for ``key``, dropping the oldest where the table is full, and
        returns it."""
        if key not in self and len(self) >= self.size:
            self.popitem(last=False)
        self[key] = value
        return value


class KeptBy(weakref.WeakKeyDictionary):
    """A :class:`Kept` table for each owner (a layer), which goes with its owner."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size

    def of(self, owner: Any, made_for: Any = None) -> Kept:
        """``owner``'s table: a new one where it has none, or where its table was made
        for another ``made_for`` (compared by identity: a layer's options, set anew)."""
        # (The weak dictionary's own table: every call of a route asks.)
        table = self.data.get(weakref.ref(owner))
        if table is None or table.made_for is not made_for:
            table = self[owner] = Kept(self.size, made_for=made_for)
        return table


#: Predicates, each supplied by a framework's facts, true while its tracer runs.
_TRACING: tuple[Callable[[], bool], ...] = ()


def skip_while(tracing: Callable[[], bool]) -> None:
    """Computes :func:`decided_once` functions anew while ``tracing()`` is true.

    Called once by a framework's facts when imported; the same predicate
    given twice is kept once.
    """
    global _TRACING
    if tracing not in _TRACING:
        _TRACING = (*_TRACING, tracing)


def decided_once(
    function: Callable[..., Any] | None = None,
    *,
    canonical: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
) -> Any:
    """``function`` (pure), computed once per arguments where they can be hashed.

    A call that raises is not remembered (it raises again); ``typed`` keeps
    ``True`` and ``1`` apart. Arguments that cannot be hashed (arrays, some
    traced sizes) are worked out each time. ``canonical`` maps the keyword
    arguments to ones with the same result, fewer in kind (a decoding step's
    growing sizes to how they compare), so that more calls are lookups.
    """
    if function is None:
        return functools.partial(decided_once, canonical=canonical)
    once = functools.lru_cache(maxsize=4096, typed=True)(function)

    @functools.wraps(function)
    def decided(*args: Any, **kwargs: Any) -> Any:
        for tracing in _TRACING:
            if tracing():
                return function(*args, **kwargs)  # a graph is traced once anyway
        if canonical is not None:
            kwargs = canonical(kwargs)
        try:
            return once(*args, **kwargs)
        except Exception:
            # Unhashable arguments (TypeError, or MXNet arrays'
            # NotImplementedError), or the function's own error: computed
            # again outside this handler, it raises that error on its own
            # (nothing failing is remembered).
            pass
        return function(*args, **kwargs)

    return decided

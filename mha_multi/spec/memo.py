"""The one kind of table a call's decisions live in: what its signature decided, kept.

The spec's checks and plans are pure functions, computed anew at every call
of theirs. What a call's signature decides (the checks' verdicts and the
kernel plan, :mod:`mha_multi.call.decisions`; a framework's route plan, a
compiled program, rotary tables) the layers above keep in a :class:`Kept`
table (docs: "Fast paths"): a table of a layer's own in :class:`KeptBy`.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Hashable
from typing import Any, TypeVar

__all__ = ["MISSING", "Kept", "KeptBy"]

V = TypeVar("V")

#: What a table's ``get(key, MISSING)`` gives where it keeps nothing for ``key``: a kept
#: value may be ``None`` (a route's answer that it takes no such call), so one lookup
#: tells the two apart.
MISSING: Any = object()


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

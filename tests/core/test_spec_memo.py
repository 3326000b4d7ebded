"""The tables a call's per-signature decisions are kept in (mha_multi.spec.memo)."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from mha_multi.spec.memo import Kept, KeptBy


def test_kept_drops_the_oldest_once_full() -> None:
    table: Kept[str] = Kept(2)
    assert table.keep("a", "A") == "A"
    table.keep("b", "B")
    table.keep("a", "A again")  # (a key kept already drops nothing)
    assert dict(table) == {"a": "A again", "b": "B"}
    table.keep("c", "C")
    assert list(table) == ["b", "c"]


def test_kept_drops_the_least_recently_used_where_found_moves_to_the_end() -> None:
    table: Kept[int] = Kept(2)
    table.keep("a", 1)
    table.keep("b", 2)
    table.move_to_end("a")  # found again
    table.keep("c", 3)
    assert list(table) == ["a", "c"]


def test_kept_refuses_a_key_that_cannot_be_hashed_as_a_dict_does() -> None:
    table: Kept[int] = Kept(4)
    with pytest.raises(TypeError):
        table.get((np.zeros(2),))
    with pytest.raises(TypeError):
        table.keep((np.zeros(2),), 1)
    assert len(table) == 0


def test_kept_by_owner_goes_with_it_and_starts_anew_for_another_setting() -> None:
    class Owner:
        pass

    tables = KeptBy(3)
    owner, setting = Owner(), object()
    first = tables.of(owner, made_for=setting)
    first.keep("key", 1)
    assert tables.of(owner, made_for=setting) is first
    renewed = tables.of(owner, made_for=object())  # (compared by identity)
    assert renewed is not first and len(renewed) == 0 and renewed.size == 3
    assert tables.of(Owner()) is not renewed
    del owner
    gc.collect()
    assert len(tables) == 0

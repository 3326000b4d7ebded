"""The benchmark's command line: which kinds of row ``run --only`` takes."""

from __future__ import annotations

import argparse

import pytest

from mha_multi.bench.__main__ import kinds_of_rows, main


def test_only_takes_several_kinds_of_row():
    assert kinds_of_rows("timing,generation") == ("timing", "generation")
    assert kinds_of_rows("small-calls,") == ("small-calls",)
    assert kinds_of_rows("host,calls") == ("host", "calls")
    for text in ("timing,typo", "", ","):
        with pytest.raises(argparse.ArgumentTypeError, match="small-calls"):
            kinds_of_rows(text)


def test_an_unknown_kind_of_row_is_refused_before_anything_runs(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["run", "--out", str(tmp_path), "--only", "timing,typo", "torch"])
    assert "expected kinds of row among" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_the_packed_rows_batch_leaves_most_padded_positions_empty():
    from mha_multi.bench.packed import PackedBatch, long_tailed_lengths, pack

    lengths = long_tailed_lengths(32, 512)
    assert len(lengths) == 32 and max(lengths) == 512 and min(lengths) >= 1
    batch = PackedBatch(tuple(lengths), 512)
    assert batch.empty_share >= 0.5
    rows = batch.rows
    assert sorted(n for row in rows for n in row) == sorted(lengths)
    assert all(sum(row) <= 512 for row in rows) and len(rows) < len(lengths) / 2
    assert pack([3, 2, 2, 1], 4) == [[3, 1], [2, 2]]
    ids = batch.segment_ids()
    assert ids.shape == (len(rows), 512) and (ids >= 0).sum() == sum(lengths)


def test_executions_choose_the_generation_rows_the_framework_has():
    from mha_multi.bench.driver import _chosen

    class Framework:
        @staticmethod
        def label(execution):
            return "keras-jax" if execution is None else f"keras-jax ({execution})"

    assert _chosen(Framework, ("eager", "compiled"), ["compiled"]) == ["compiled"]
    assert _chosen(Framework, (None, "imperative"), ["imperative", "default"]) == [
        None,
        "imperative",
    ]
    with pytest.raises(ValueError, match=r"expected some of \['compiled', 'eager'\]"):
        _chosen(Framework, ("eager", "compiled"), ["hybridized"])

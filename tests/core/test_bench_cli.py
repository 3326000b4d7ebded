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

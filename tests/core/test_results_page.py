"""The results page: its tables made from result files, kept there, and checked against them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from mha_multi.bench import page
from mha_multi.bench.__main__ import main
from mha_multi.parity.provenance import command_line, describe_machine

ROOT = Path(__file__).parents[2]
MACHINE = {"cpu": "Test CPU", "cpu_count": 2, "platform": "Linux-6.1-x86_64", "python": "3.11.7"}
BENCH_COMMAND = "python -m mha_multi.bench run --out bench-report/results torch"


def measurement(implementation, mode, length, *, batch=8, kv=None, **values):
    """One row as ``python -m mha_multi.bench run`` writes it."""
    shape = {"batch": batch, "length": length, "num_hiddens": 512, "num_heads": 8}
    return {
        "backend": "torch",
        "implementation": implementation,
        "mode": mode,
        "device": "cpu",
        "dtype": "float32",
        "length": length,
        "seconds": None,
        "gflops": None,
        "peak_mib": None,
        "tokens_per_s": None,
        "note": "",
        "shape": {**shape, "num_kv_heads": kv},
        **values,
    }


def bench_file(rows, date="2026-11-01T10:00:00Z", command=BENCH_COMMAND):
    return [
        {
            "backend": "torch",
            "device": "cpu",
            "versions": {"torch": "2.13.0"},
            "measurements": rows,
            "date": date,
            "machine": MACHINE,
            "command": command,
        }
    ]


def generation(implementation, mode, **values):
    row = measurement(implementation, mode, 512, kv=2, **values)
    row["shape"]["prompt"] = 256
    return row


def llama(implementation, **values):
    """A generation row of the Llama-shaped layer: rotary positions, 8/2 heads."""
    row = generation(implementation, "generate", **values)
    row["shape"]["rotary"] = {"theta": 10000.0}
    return row


def tiny(implementation, mode, route="cpu", *, plain=False, **values):
    """A host or Python-calls row of the tiny rotary layer (16 hiddens, 2/1 heads), or
    where ``plain`` of the tiny plain one (2/2 heads, no option)."""
    row = measurement(implementation, mode, 1, batch=1, kv=None if plain else 1, **values)
    rotary = None if plain else {"theta": 10000.0}
    row["shape"] |= {"num_hiddens": 16, "num_heads": 2, "rotary": rotary}
    return {**row, "shape": {**row["shape"], "route": route}}


BENCH = bench_file(
    [
        measurement("ours", "forward", 128, seconds=0.020),
        measurement("native", "forward", 128, seconds=0.025),
        measurement("ours", "forward", 2048, note="too large (~12 GiB)"),
        measurement("native", "forward", 2048, seconds=0.9),
        measurement("ours", "forward", 1, batch=1, seconds=0.0005),
        measurement("native", "forward", 1, batch=1, seconds=0.0004),
        generation("cached", "generate", tokens_per_s=1000.0),
        generation("hand-written", "generate", tokens_per_s=2000.0),
        generation("cached", "generate memory", peak_mib=5.4),
        llama("cached", tokens_per_s=900.0),
        llama(
            "hand-written", tokens_per_s=1000.0, note="prefill 5 ms; max |this - cached| 3.0e-08"
        ),
        tiny("ours", "host: decoding step", seconds=300e-6),
        tiny("hand-written", "host: decoding step", seconds=200e-6),
        tiny("ours", "host: one token", "gpu", seconds=150e-6),
        tiny("hand-written", "host: one token", "gpu", seconds=100e-6),
        tiny("ours", "host: decoding step", plain=True, seconds=120e-6),
        tiny("hand-written", "host: decoding step", plain=True, seconds=100e-6),
        tiny("ours", "python calls: decoding step", calls=60.05),
        tiny("hand-written", "python calls: decoding step", calls=40.05),
        measurement("ours", "peak memory", 1024, peak_mib=83.2),
        measurement("native", "peak memory", 1024, peak_mib=99.0),
    ]
)

CHECK = {"max_abs": 2.5e-7, "max_rel": 3.7e-7, "tolerance": 5e-6}
GRADIENT = {"max_abs": 1.3e-6, "max_rel": 6.1e-7, "tolerance": 5e-5}
PARITY = {
    "passed": True,
    "cells": [
        {
            "backend": "torch",
            "device": "cpu",
            "dtype": "float32",
            "cases": 30,
            "forward": CHECK,
            "gradient": GRADIENT,
            "failures": [],
            "passed": True,
        }
    ],
    "pairwise": [
        {"a": "jax", "b": "torch", "device": "cpu", "dtype": "float32", "max_abs": 1.5e-7},
        {"a": "jax", "b": "torch", "device": "cpu", "dtype": "float64", "max_abs": 0.5},
    ],
    "cases": ["book"],
    "date": "2026-11-02T09:00:00Z",
    "machine": MACHINE,
    "command": "python -m mha_multi.parity report --results parity-report/results",
}

SOURCE = f"Measured 2026-11-01 on Test CPU (2 cores), Linux, Python 3.11.7: `{BENCH_COMMAND}`."
EXPECTED = {
    "parity": [
        "| backend | device | dtype | cases | forward | gradients | tolerance | result |",
        "|---|---|---|---|---|---|---|---|",
        "| torch | cpu | float32 | 30 | 2.50e-07 / 3.7e-07 | 1.30e-06 / 6.1e-07 | 5e-06 / 5e-05 "
        "| pass |",
        "",
        "Every row passed. Backend against backend, float32 outputs differ by 1.50e-07 at most.",
        "",
        "Measured 2026-11-02 on Test CPU (2 cores), Linux, Python 3.11.7: "
        "`python -m mha_multi.parity report --results parity-report/results`.",
    ],
    "speed": [
        "| backend | dtype | mode | N = 128 | N = 2048 |",
        "|---|---|---|---|---|",
        "| torch | float32 | forward | 0.80x (20.0 ms) | too large (~12 GiB) |",
        "",
        SOURCE,
    ],
    "small-calls": [
        "| backend | dtype | mode | N = 1 |",
        "|---|---|---|---|",
        "| torch | float32 | forward | 1.25x (0.5 ms) |",
        "",
        SOURCE,
    ],
    "decoding": [
        "| backend | dtype | heads (q/kv) | ours (tokens/s) | hand-written (tokens/s) "
        "| ours / hand-written | peak memory (the cache) |",
        "|---|---|---|---|---|---|---|",
        # The cache: keys and values, 8 examples x 512 positions x 2 heads x 64 x 4 bytes.
        "| torch | float32 | 8/2 | 1000 | 2000 | 0.50x | 5 MiB (4.0 MiB) |",
        "",
        SOURCE,
    ],
    # The rotary rows: a table of their own, the difference read from the note.
    "llama-decoding": [
        "| backend | dtype | heads (q/kv) | ours (tokens/s) | hand-written (tokens/s) "
        "| ours / hand-written | max difference |",
        "|---|---|---|---|---|---|---|",
        "| torch | float32 | 8/2 | 900 | 1000 | 0.90x | 3.0e-08 |",
        "",
        SOURCE,
    ],
    # Microseconds per call; the route a GPU takes after the CPU's.
    "host": [
        "| backend | layer | route | call | ours (us) | hand-written (us) | ours / hand-written |",
        "|---|---|---|---|---|---|---|",
        "| torch | rotary, 2/1 heads | CPU's | decoding step | 300 | 200 | 1.50x |",
        "| torch | rotary, 2/1 heads | a GPU's, on the CPU | one token | 150 | 100 | 1.50x |",
        "| torch | plain, 2/2 heads | CPU's | decoding step | 120 | 100 | 1.20x |",
        "",
        SOURCE,
    ],
    "calls": [
        "| backend | call | plain: ours | plain: hand-written | rotary: ours "
        "| rotary: hand-written |",
        "|---|---|---|---|---|---|",
        "| torch | decoding step | - | - | 60 | 40 |",
        "",
        SOURCE,
    ],
    "memory": [
        "| backend | layer | N = 1024 |",
        "|---|---|---|",
        "| torch | native | 99 |",
        "| torch | ours | 83 |",
        "",
        SOURCE,
    ],
}

PAGE = """# Results

Prose the generator leaves alone: 0.80x.

{blocks}
The end.
"""


def blank_page(names=(*EXPECTED, "gpu")) -> str:
    blocks = "\n".join(
        f"{page.BEGIN.format(name=name)}\nold text\n{page.END.format(name=name)}\n"
        for name in names
    )
    return PAGE.format(blocks=blocks)


@pytest.fixture
def results(tmp_path) -> Path:
    folder = tmp_path / "results"
    folder.mkdir()
    (folder / "bench-torch-cpu-20261101T100000Z.json").write_text(json.dumps(BENCH))
    (folder / "parity-cpu-20261102T090000Z.json").write_text(json.dumps(PARITY))
    return folder


def test_blocks_are_the_tables_of_the_files(results):
    blocks = page.blocks(page.load(results))
    for name, lines in EXPECTED.items():
        assert blocks[name] == lines, name
    # No GPU rows: the GPU block says so rather than showing an empty table.
    assert "No parity report in the results holds these rows yet." in blocks["gpu"]


def test_render_writes_between_the_markers_only(results):
    generated = page.blocks(page.load(results))
    written = page.render(blank_page(), generated)
    assert "old text" not in written
    assert written.startswith("# Results\n\nProse the generator leaves alone: 0.80x.\n")
    assert written.endswith("The end.\n")
    assert "| torch | float32 | forward | 0.80x (20.0 ms) | too large (~12 GiB) |" in written
    assert page.stale(written, generated) == []
    assert page.render(written, generated) == written


def test_the_check_fails_on_one_number_changed(results, tmp_path):
    path = tmp_path / "results.md"
    path.write_text(page.render(blank_page(), page.blocks(page.load(results))))
    arguments = ["page", "--check", "--results", str(results), "--page", str(path)]
    assert main(arguments) == 0
    text = path.read_text()
    path.write_text(text.replace("| 1000 | 2000 | 0.50x |", "| 1000 | 2000 | 0.51x |"))
    assert page.stale(path.read_text(), page.blocks(page.load(results))) == ["decoding"]
    assert main(arguments) == 1
    # Writing the tables again mends the page.
    assert main(["page", "--results", str(results), "--page", str(path)]) == 0
    assert path.read_text() == text


def test_a_page_without_a_block_is_refused(results):
    generated = page.blocks(page.load(results))
    lacking = blank_page(names=("parity", "speed"))
    # The two it has hold old text; the seven it lacks are named too.
    assert page.stale(lacking, generated) == [
        "calls",
        "decoding",
        "gpu",
        "host",
        "llama-decoding",
        "memory",
        "parity",
        "small-calls",
        "speed",
    ]
    with pytest.raises(ValueError, match="lacks blocks"):
        page.render(lacking, generated)
    with pytest.raises(ValueError, match="without ending"):
        page.render(page.BEGIN.format(name="speed") + "\n", generated)


def test_a_newer_row_replaces_an_older_one_and_its_file_goes(results, tmp_path):
    newer = bench_file(
        [
            measurement("ours", "forward", 128, seconds=0.030),
            measurement("native", "forward", 128, seconds=0.025),
        ],
        date="2026-11-03T08:00:00Z",
        command="python -m mha_multi.bench run --only timing --out new torch",
    )
    made = tmp_path / "made"
    made.mkdir()
    (made / "torch.json").write_text(json.dumps(newer))
    written = page.take([made], results)
    assert [path.name for path in written] == ["bench-torch-cpu-20261103T080000Z.json"]
    speed = page.blocks(page.load(results))["speed"]
    assert speed[2] == "| torch | float32 | forward | 1.20x (30.0 ms) | too large (~12 GiB) |"
    # Rows of two runs: each run is named under the table.
    assert speed[-2:] == [
        SOURCE,
        "Measured 2026-11-03 on Test CPU (2 cores), Linux, Python 3.11.7: "
        "`python -m mha_multi.bench run --only timing --out new torch`.",
    ]
    # The older file still gives the other rows, so it stays.
    assert (results / "bench-torch-cpu-20261101T100000Z.json").exists()
    # A run that measures every row again leaves the older file nothing to give.
    everything = bench_file(BENCH[0]["measurements"], date="2026-11-04T08:00:00Z")
    (made / "torch.json").write_text(json.dumps(everything))
    page.take([made], results)
    assert [path.name for path in results.glob("bench-*.json")] == [
        "bench-torch-cpu-20261104T080000Z.json"
    ]


def test_take_keeps_the_newest_parity_report_per_device(results, tmp_path):
    report = tmp_path / "report.json"
    gpu = {
        **PARITY,
        "cells": [{**PARITY["cells"][0], "device": "gpu"}],
        "date": "2026-11-05T00:00:00Z",
    }
    report.write_text(json.dumps(gpu))
    page.take([report], results)
    assert sorted(path.name for path in results.glob("parity-*.json")) == [
        "parity-cpu-20261102T090000Z.json",
        "parity-gpu-20261105T000000Z.json",
    ]
    report.write_text(json.dumps({**PARITY, "date": "2026-11-06T00:00:00Z"}))
    page.take([report], results)
    assert sorted(path.name for path in results.glob("parity-*.json")) == [
        "parity-cpu-20261106T000000Z.json",
        "parity-gpu-20261105T000000Z.json",
    ]
    undated = {key: value for key, value in PARITY.items() if key != "date"}
    report.write_text(json.dumps(undated))
    with pytest.raises(ValueError, match="records no date"):
        page.take([report], results)


def test_a_transcribed_source_says_so(tmp_path):
    folder = tmp_path / "results"
    folder.mkdir()
    gpu_rows = [{**row, "device": "gpu"} for row in BENCH[0]["measurements"][6:8]]
    result = {
        **bench_file(gpu_rows, date="2026-11-27")[0],
        "machine": {"gpus": ["Test GPU"], "gpu_driver": "1.0"},
        "transcribed_from": "an earlier page",
    }
    (folder / "bench-torch-gpu-20261127.json").write_text(json.dumps([result]))
    gpu = page.blocks(page.load(folder))["gpu"]
    assert "| torch | float32 | 8/2 | 1000 | 2000 | 0.50x | - |" in gpu
    assert gpu[-1] == (
        f"Measured 2026-11-27 on Test GPU, driver 1.0: `{BENCH_COMMAND}`. "
        "Transcribed from an earlier page."
    )
    # A later run on another GPU replaces those rows, and the transcribed file goes.
    later = [{**row, "tokens_per_s": 3000.0} for row in gpu_rows]
    run = {**bench_file(later, date="2026-12-01T00:00:00Z")[0], "device": "Other GPU"}
    made = tmp_path / "torch.json"
    made.write_text(json.dumps([{**run, "machine": {"gpus": ["Other GPU"]}}]))
    page.take([made], folder)
    gpu = page.blocks(page.load(folder))["gpu"]
    assert "| torch | float32 | 8/2 | 3000 | 3000 | 1.00x | - |" in gpu
    assert gpu[-1] == f"Measured 2026-12-01 on Other GPU: `{BENCH_COMMAND}`."
    assert [path.name for path in folder.iterdir()] == ["bench-torch-gpu-20261201T000000Z.json"]


def test_the_repository_page_matches_its_files_and_a_tampered_copy_does_not(tmp_path):
    shutil.copytree(ROOT / "docs" / "results", tmp_path / "results")
    copy = tmp_path / "results.md"
    text = (ROOT / "docs" / "results.md").read_text()
    copy.write_text(text)
    arguments = ["page", "--check", "--results", str(tmp_path / "results"), "--page", str(copy)]
    assert main(arguments) == 0
    # One figure of a generated table changed: a digit of its first "x" ratio.
    begin = text.index(page.BEGIN.format(name="gpu"))
    at = text.index("x |", begin) - 1
    digit = "1" if text[at] != "1" else "2"
    copy.write_text(text[:at] + digit + text[at + 1 :])
    assert main(arguments) == 1


def test_runs_of_one_day_that_differ_in_their_backend_are_named_once(tmp_path):
    folder = tmp_path / "results"
    folder.mkdir()
    for backend in ("torch", "jax"):
        rows = [{**row, "backend": backend} for row in BENCH[0]["measurements"][:2]]
        command = f"python -m mha_multi.bench run --out r {backend}"
        result = bench_file(rows, command=command)
        (folder / f"bench-{backend}-cpu-20261101T100000Z.json").write_text(json.dumps(result))
    speed = page.blocks(page.load(folder))["speed"]
    assert speed[-1] == (
        "Measured 2026-11-01 on Test CPU (2 cores), Linux, Python 3.11.7: "
        "`python -m mha_multi.bench run --out r <backend>` for jax, torch."
    )


def test_machine_and_command_as_the_page_prints_them(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    line = command_line("python -m mha_multi.bench", ["run", "--out", str(tmp_path / "a b"), "x"])
    assert line == "python -m mha_multi.bench run --out 'a b' x"
    assert command_line("prog", ["/elsewhere/file"]) == "prog /elsewhere/file"
    assert describe_machine({}) == "an unrecorded machine"
    assert describe_machine({"cpu_count": 16, "gpus": ["G", "G"]}) == "16 CPU cores, 2 x G"

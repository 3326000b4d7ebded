"""``python -m mha_multi convert`` on bad input: one line on stderr, exit status 2."""

from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys

import numpy as np
import pytest

from mha_multi.__main__ import convert
from mha_multi.interop import FORMATS, Format, detect_format, load, save, suffix_formats
from mha_multi.weights import init_weights, load_weights, save_weights

PREFIX = "python -m mha_multi convert: error: "
HELP = " (see python -m mha_multi convert --help)"


def run_convert(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mha_multi", "convert", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def error_line(result: subprocess.CompletedProcess) -> str:
    """The one line a user error prints, after checking how the command failed."""
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert result.stdout == ""
    return lines[0]


@pytest.fixture
def source(tmp_path):
    path = tmp_path / "w.npz"
    save_weights(path, init_weights(8, bias=True))
    return path


@pytest.mark.parametrize("suffix", [".npz", ".safetensors"])
def test_truncated_input(tmp_path, suffix):
    path = tmp_path / f"w{suffix}"
    save_weights(path, init_weights(8, bias=True))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    line = error_line(run_convert(path, tmp_path / "out.npz"))
    assert line.startswith(
        f"{PREFIX}{str(path)!r} is not a valid {suffix} file (truncated or corrupt): "
    )
    assert not (tmp_path / "out.npz").exists()


def test_empty_npz_input(tmp_path):
    path = tmp_path / "empty.npz"
    np.savez(path)
    line = error_line(run_convert(path, tmp_path / "out.npz"))
    assert line == (
        f"{PREFIX}{str(path)!r} holds no arrays; expected canonical weights W_q, W_k, W_v, W_o"
    )


@pytest.mark.parametrize("heads", ["0", "-2"])
def test_non_positive_num_heads_is_an_argument_error(tmp_path, source, heads):
    result = run_convert(source, tmp_path / "out.npz", "--num-heads", heads)
    line = error_line(result)
    assert line == f"{PREFIX}argument --num-heads: must be a positive integer; got {heads}{HELP}"
    assert not (tmp_path / "out.npz").exists()


def test_non_positive_num_heads_in_the_api(tmp_path, source):
    with pytest.raises(ValueError, match=r"^--num-heads must be a positive integer; got 0$"):
        convert(source, tmp_path / "out.npz", num_heads=0)


@pytest.mark.parametrize(
    ("module", "destination", "label", "framework"),
    [
        ("torch", "out.pt", "torch-d2l", "PyTorch"),
        ("mxnet", "out.params", "mxnet-d2l", "MXNet"),
        ("keras", "out.weights.h5", "keras-mha", "Keras"),
    ],
)
def test_format_without_its_framework(tmp_path, source, module, destination, label, framework):
    if importlib.util.find_spec(module) is not None:
        pytest.skip(f"{module} is installed here")
    line = error_line(run_convert(source, tmp_path / destination, "--num-heads", "2"))
    assert line == (
        f"{PREFIX}format {label} needs {framework}, which is not installed "
        f"(No module named '{module}'): pip install 'mha_multi[{module}]'"
    )


def test_reading_a_shared_suffix_without_its_framework_names_every_candidate(tmp_path):
    if importlib.util.find_spec("torch") is not None:
        pytest.skip("torch is installed here")
    checkpoint = tmp_path / "w.pt"
    checkpoint.write_bytes(b"not read: the recogniser needs torch first")
    line = error_line(run_convert(checkpoint, tmp_path / "out.npz"))
    assert line == (
        f"{PREFIX}format torch-mha/torch-d2l needs PyTorch, which is not installed "
        "(No module named 'torch'): pip install 'mha_multi[torch]'"
    )


def test_missing_source_and_destination_directory(tmp_path, source):
    missing = tmp_path / "none.npz"
    line = error_line(run_convert(missing, tmp_path / "out.npz"))
    assert line == f"{PREFIX}[Errno 2] No such file or directory: {str(missing)!r}"
    destination = tmp_path / "none" / "out.npz"
    line = error_line(run_convert(source, destination))
    assert line == (
        f"{PREFIX}no such directory: {str(tmp_path / 'none')!r} (for {str(destination)!r})"
    )


def test_valid_conversion_still_succeeds(tmp_path, source):
    result = run_convert(source, tmp_path / "out.safetensors", "--num-heads", "2")
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert result.stdout.startswith(f"{source} -> {tmp_path / 'out.safetensors'}: W_q (8, 8)")


def test_unknown_format_names_in_the_api(tmp_path, source):
    # "torch" names no format: reading a .pt file detects torch-mha or torch-d2l.
    with pytest.raises(ValueError, match=r"^unknown format 'torch'; expected one of canonical, "):
        convert(source, tmp_path / "out.npz", source_format="torch")
    with pytest.raises(ValueError, match=r"^unknown format 'npz'"):
        convert(source, tmp_path / "out.npz", destination_format="npz")
    with pytest.raises(ValueError, match=r"^unknown format 'torch'"):
        load(source, "torch")


# -- the format registry ------------------------------------------------------------------


def test_registry_records_are_complete():
    assert list(FORMATS) == ["canonical", "torch-mha", "torch-d2l", "mxnet-d2l", "keras-mha"]
    for name, record in FORMATS.items():
        assert isinstance(record, Format) and record.name == name
        assert record.description and record.suffixes
        assert all(s.startswith(".") and s == s.lower() for s in record.suffixes)
        for target in (record.reader, record.writer):
            module, _, function = target.partition(":")
            assert module.startswith("mha_multi.") and function.isidentifier(), target
        assert (record.framework is None) == (record.extra is None)


def test_shared_suffixes_have_one_default_and_one_recogniser():
    owners: dict[str, list[Format]] = {}
    for record in FORMATS.values():
        for suffix in record.suffixes:
            owners.setdefault(suffix, []).append(record)
    shared = {suffix: records for suffix, records in owners.items() if len(records) > 1}
    assert ".pt" in shared
    for suffix, records in shared.items():
        assert sum(r.default for r in records) == 1, suffix
        recognisers = {r.recogniser for r in records}
        assert len(recognisers) == 1 and None not in recognisers, suffix


ALL_SUFFIXES = sorted({s for record in FORMATS.values() for s in record.suffixes})


@pytest.mark.parametrize("suffix", ALL_SUFFIXES + [s.upper() for s in ALL_SUFFIXES])
def test_detection_from_the_suffix_returns_registry_names_only(suffix):
    path = f"some.dir/weights{suffix}"
    names = suffix_formats(path)
    assert names and set(names) <= set(FORMATS)
    written = detect_format(path, reading=False)
    assert written in names and FORMATS[written].default
    if len(names) == 1:
        assert detect_format(path, reading=True) == names[0]


def test_detection_of_names_no_format_claims():
    assert suffix_formats("w.h5") == suffix_formats("w.bin") == suffix_formats("npz") == ()
    assert suffix_formats("w.weights.h5") == ("keras-mha",)  # the longest suffix
    for reading in (False, True):
        with pytest.raises(ValueError, match=r"^cannot tell the format of 'w\.bin' from its name"):
            detect_format("w.bin", reading=reading)


def _available(record: Format) -> bool:
    try:
        importlib.import_module(record.reader.partition(":")[0])
    except ImportError:
        return False
    return True


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("name", list(FORMATS))
def test_every_format_round_trips_where_its_framework_is_installed(tmp_path, name, bias):
    record = FORMATS[name]
    if not _available(record):
        pytest.skip(f"{record.framework} is not installed here")
    weights = init_weights(8, key_size=5, value_size=6, bias=bias, seed=11)
    path = tmp_path / f"weights{record.suffixes[-1]}"
    save(path, weights, name, num_heads=2)
    assert detect_format(path, reading=True) == name
    for back in (load(path, name, num_heads=2), load(path)):
        assert sorted(back) == sorted(weights)
        assert all(back[k].tobytes() == weights[k].tobytes() for k in weights), name
    # The command's function, with formats from the names (and the content).
    source = tmp_path / "source.safetensors"
    save_weights(source, weights)
    written = tmp_path / f"written{record.suffixes[0]}"
    convert(source, written, num_heads=2, destination_format=name)
    restored = tmp_path / "restored.npz"
    assert convert(written, restored, num_heads=2).keys() == weights.keys()
    again = load_weights(restored)
    assert all(again[k].tobytes() == weights[k].tobytes() for k in weights), name


def test_help_lists_every_format():
    result = subprocess.run(
        [sys.executable, "-m", "mha_multi", "convert", "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    listed = result.stdout.split("\nformats:\n", 1)[1]
    for record in FORMATS.values():
        assert f"  {record.name} " in listed and record.suffixes[0] in listed

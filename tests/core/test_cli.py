"""``python -m mha_multi convert`` on bad input: one line on stderr, exit status 2."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import numpy as np
import pytest

from mha_multi.__main__ import convert
from mha_multi.weights import init_weights, save_weights

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

"""``python -m mha_multi convert`` between canonical files and torch checkpoints."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from mha_multi.__main__ import convert, main
from mha_multi.interop import FORMATS, detect_format, load, save
from mha_multi.interop.torch import checkpoint_format
from mha_multi.weights import init_weights, load_weights, save_weights


@pytest.mark.parametrize("kind", ["torch-mha", "torch-d2l"])
@pytest.mark.parametrize("suffix", [".safetensors", ".npz"])
def test_canonical_to_torch_and_back_is_bit_exact(tmp_path, kind, suffix):
    weights = init_weights(8, bias=True, seed=5)
    source = tmp_path / f"weights{suffix}"
    save_weights(source, weights)
    checkpoint = tmp_path / "layer.pt"
    convert(source, checkpoint, destination_format=kind, num_heads=2)
    state = torch.load(checkpoint, weights_only=True)
    assert ("in_proj_weight" in state) == (kind == "torch-mha")
    back = tmp_path / f"back{suffix}"
    convert(checkpoint, back)  # the layout is recognised from the keys
    loaded = load_weights(back)
    assert all(loaded[k].tobytes() == weights[k].tobytes() for k in weights)


def test_native_checkpoint_loads_into_our_layer(tmp_path):
    module = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    torch.save(module.state_dict(), tmp_path / "native.pt")
    assert main(["convert", str(tmp_path / "native.pt"), str(tmp_path / "w.safetensors")]) == 0
    from mha_multi.torch import MultiHeadAttention, set_weights

    layer = set_weights(
        MultiHeadAttention(8, 2, bias=True), load_weights(tmp_path / "w.safetensors")
    )
    x = torch.from_numpy(np.random.default_rng(0).standard_normal((2, 5, 8), dtype=np.float32))
    with torch.no_grad():
        expected, _ = module.eval()(x, x, x, need_weights=False)
        np.testing.assert_allclose(layer.eval()(x, x, x).numpy(), expected.numpy(), atol=5e-6)


def test_clear_errors(tmp_path, capsys):
    save_weights(tmp_path / "w.npz", init_weights(8))
    assert main(["convert", str(tmp_path / "w.npz"), str(tmp_path / "w.bin")]) == 2
    assert "cannot tell the format" in capsys.readouterr().err
    assert (
        main(["convert", str(tmp_path / "w.npz"), str(tmp_path / "o.pt"), "--num-heads", "3"]) == 2
    )
    assert "not divisible by --num-heads (3)" in capsys.readouterr().err
    torch.save({"W_q.weight": torch.zeros(8, 7)}, tmp_path / "bad.pt")
    assert main(["convert", str(tmp_path / "bad.pt"), str(tmp_path / "o.npz")]) == 2
    assert "missing 'W_k'" in capsys.readouterr().err


def test_command_line_entry_point(tmp_path):
    save_weights(tmp_path / "w.safetensors", init_weights(4, bias=True))
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mha_multi",
            "convert",
            str(tmp_path / "w.safetensors"),
            str(tmp_path / "w.pt"),
            "--to",
            "torch-mha",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "W_q (4, 4)" in result.stdout


PREFIX = "python -m mha_multi convert: error: "
NOT_A_CHECKPOINT = "is not a PyTorch checkpoint that torch.load(weights_only=True) reads: "


def test_format_that_does_not_match_the_file(tmp_path):
    source = tmp_path / "w.npz"
    save_weights(source, init_weights(8))
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mha_multi",
            "convert",
            str(source),
            str(tmp_path / "o.npz"),
            "--from",
            "torch-mha",
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.splitlines() == [
        f"{PREFIX}{str(source)!r} {NOT_A_CHECKPOINT}"
        "file in archive is not in a subdirectory: W_q.npy"
    ]


def error_of(capsys, *args) -> str:
    assert main(["convert", *map(str, args)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.endswith("\n"), err
    assert err.startswith(PREFIX)
    return err[len(PREFIX) : -1]


def test_damaged_and_foreign_checkpoints(tmp_path, capsys):
    module = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    native = tmp_path / "native.pt"
    torch.save(module.state_dict(), native)
    data = native.read_bytes()
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(data[: len(data) // 2])
    assert error_of(capsys, truncated, tmp_path / "o.npz") == (
        f"{str(truncated)!r} {NOT_A_CHECKPOINT}"
        "PytorchStreamReader failed reading zip archive: failed finding central directory"
    )
    empty = tmp_path / "empty.pt"
    empty.write_bytes(b"")
    assert error_of(capsys, empty, tmp_path / "o.npz") == (
        f"{str(empty)!r} {NOT_A_CHECKPOINT}EOFError"
    )
    # The layout named by --from is checked against the keys.
    assert error_of(capsys, native, tmp_path / "o.npz", "--from", "torch-d2l") == (
        "unexpected entry 'in_proj_weight' in a d2l MultiHeadAttention state_dict"
    )
    # Objects that weights_only=True refuses to build are reported, not loaded.
    pickled = tmp_path / "numpy.pt"
    torch.save({"W_q.weight": np.zeros((8, 8), np.float32)}, pickled)
    message = error_of(capsys, pickled, tmp_path / "o.npz")
    assert message.startswith(f"{str(pickled)!r} {NOT_A_CHECKPOINT}Unsupported global: ")
    assert not (tmp_path / "o.npz").exists()


def test_destination_in_a_missing_directory(tmp_path, capsys):
    source = tmp_path / "w.npz"
    save_weights(source, init_weights(8))
    destination = tmp_path / "none" / "o.pt"
    assert error_of(capsys, source, destination) == (
        f"no such directory: {str(tmp_path / 'none')!r} (for {str(destination)!r})"
    )


@pytest.mark.parametrize("name", ["torch-mha", "torch-d2l"])
@pytest.mark.parametrize("suffix", [".pt", ".pth", ".PT"])
def test_checkpoints_are_recognised_as_registry_formats(tmp_path, name, suffix):
    weights = init_weights(8, bias=True, seed=1)
    path = tmp_path / f"layer{suffix}"
    save(path, weights, name)
    assert checkpoint_format(path) == name
    assert detect_format(path, reading=True) == name in FORMATS
    assert detect_format(path, reading=False) == "torch-d2l"  # the default for writing
    back = load(path)
    assert all(back[k].tobytes() == weights[k].tobytes() for k in weights)


def test_native_module_checkpoint_is_torch_mha(tmp_path):
    module = torch.nn.MultiheadAttention(8, 2, kdim=5, vdim=3, bias=False)
    torch.save(module.state_dict(), tmp_path / "native.pth")
    assert detect_format(tmp_path / "native.pth", reading=True) == "torch-mha"
    assert load(tmp_path / "native.pth")["W_v"].shape == (3, 8)


def test_checkpoint_that_is_not_a_state_dict(tmp_path, capsys):
    torch.save([torch.zeros(2)], tmp_path / "list.pt")
    assert error_of(capsys, tmp_path / "list.pt", tmp_path / "o.npz") == (
        f"{str(tmp_path / 'list.pt')!r} does not hold a state_dict"
    )
    assert error_of(capsys, tmp_path / "list.pt", tmp_path / "o.npz", "--from", "torch-mha") == (
        f"{str(tmp_path / 'list.pt')!r} does not hold a state_dict"
    )

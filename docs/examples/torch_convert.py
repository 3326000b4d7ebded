"""python -m mha_multi convert: native checkpoints to canonical files and back."""

import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from mha_multi.interop.torch import from_torch_mha
from mha_multi.weights import load_weights


def convert(*args: str) -> str:
    command = [sys.executable, "-m", "mha_multi", "convert", *args]
    return subprocess.run(command, check=True, capture_output=True, text=True).stdout


torch.manual_seed(0)
native = torch.nn.MultiheadAttention(32, num_heads=4, batch_first=True)

with tempfile.TemporaryDirectory() as directory:
    checkpoint = Path(directory) / "native.pt"
    canonical = Path(directory) / "mha.safetensors"
    torch.save(native.state_dict(), checkpoint)

    # The kind of state_dict is recognised from its keys; --num-heads is checked.
    print(convert(str(checkpoint), str(canonical), "--num-heads", "4"))
    weights = load_weights(canonical)
    for name, array in from_torch_mha(native).items():
        np.testing.assert_array_equal(weights[name], array)

    # Canonical -> torch.nn.MultiheadAttention's layout, loaded back natively.
    restored = Path(directory) / "restored.pt"
    convert(str(canonical), str(restored), "--to", "torch-mha")
    again = torch.nn.MultiheadAttention(32, num_heads=4, batch_first=True)
    again.load_state_dict(torch.load(restored, weights_only=True))
    for name, tensor in native.state_dict().items():
        assert torch.equal(again.state_dict()[name], tensor)

    # A heads count that does not divide num_hiddens is refused (exit status 2).
    failed = subprocess.run(
        [
            sys.executable,
            "-m",
            "mha_multi",
            "convert",
            str(checkpoint),
            str(canonical),
            "--num-heads",
            "5",
        ],
        capture_output=True,
        text=True,
    )
    assert failed.returncode == 2 and "not divisible" in failed.stderr

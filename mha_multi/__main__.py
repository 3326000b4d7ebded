"""``python -m mha_multi convert SRC DST``: canonical weight files to and from native checkpoints.

Formats, by file name (or ``--from``/``--to``):

* ``*.npz``, ``*.safetensors``: canonical weights (``.npz`` read with
  ``allow_pickle=False``).
* ``*.pt``, ``*.pth``: a PyTorch ``state_dict`` (read with
  ``weights_only=True``), either ``torch-mha`` (``torch.nn.MultiheadAttention``)
  or ``torch-d2l`` (d2l's layer, also ``mha_multi.torch``'s); on reading, the
  kind is recognised from the keys.
* ``*.params``: ``mxnet-d2l``, Gluon parameters of d2l's MXNet layer (also
  ``mha_multi.mxnet``'s), as ``save_parameters`` writes them.
* ``*.weights.h5``: ``keras-mha``, Keras ``save_weights`` of a model holding
  one ``keras.layers.MultiHeadAttention`` (writing needs ``--num-heads``;
  reading checks it against the file).

A file that cannot be read or does not match its format, a bad argument, or a
format whose framework is not installed ends the command with one line on
stderr, ``python -m mha_multi convert: error: ...``, and exit status 2.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, NoReturn

import numpy as np

from mha_multi.weights import check_weights, load_weights, save_weights

CANONICAL_SUFFIXES = (".npz", ".safetensors")
TORCH_SUFFIXES = (".pt", ".pth")
MXNET_SUFFIXES = (".params",)
KERAS_SUFFIXES = (".weights.h5",)
FORMATS = ("canonical", "torch-mha", "torch-d2l", "mxnet-d2l", "keras-mha")

# Format -> (module of mha_multi.interop, framework, extra that installs it).
_FRAMEWORKS = {
    "torch": ("torch", "PyTorch", "torch"),
    "torch-mha": ("torch", "PyTorch", "torch"),
    "torch-d2l": ("torch", "PyTorch", "torch"),
    "mxnet-d2l": ("mxnet", "MXNet", "mxnet"),
    "keras-mha": ("keras", "Keras", "keras"),
}


def _format_of(path: str, explicit: str | None, reading: bool) -> str:
    if explicit:
        if explicit not in FORMATS:
            raise ValueError(f"unknown format {explicit!r}; expected one of {', '.join(FORMATS)}")
        return explicit
    suffix = Path(path).suffix.lower()
    if path.lower().endswith(KERAS_SUFFIXES):
        return "keras-mha"
    if suffix in CANONICAL_SUFFIXES:
        return "canonical"
    if suffix in TORCH_SUFFIXES:
        return "torch" if reading else "torch-d2l"
    if suffix in MXNET_SUFFIXES:
        return "mxnet-d2l"
    raise ValueError(
        f"cannot tell the format of {path!r} from its name; pass --from/--to "
        f"(one of {', '.join(FORMATS)})"
    )


def _interop(kind: str) -> ModuleType:
    """The ``mha_multi.interop`` module of a format, which imports its framework."""
    module, framework, extra = _FRAMEWORKS[kind]
    try:
        return importlib.import_module(f"mha_multi.interop.{module}")
    except ModuleNotFoundError as error:
        label = "torch-mha/torch-d2l" if kind == "torch" else kind
        raise ImportError(
            f"format {label} needs {framework}, which is not installed ({error}): "
            f"pip install 'mha_multi[{extra}]'"
        ) from error


def _first_sentence(text: str) -> str:
    line = next((line.strip() for line in text.splitlines() if line.strip()), "")
    # torch's C++ checks prefix their message with where they failed.
    line = re.sub(r"^\[enforce fail at [^\]]*\][\s.]*", "", line)
    return line.split(". ", 1)[0].rstrip(".")


def _torch_load(path: str) -> Any:
    import torch

    with open(path, "rb") as file:  # so that a missing file stays a FileNotFoundError
        try:
            return torch.load(file, map_location="cpu", weights_only=True)
        except Exception as error:
            # A damaged or foreign file fails wherever torch's parser stops
            # (RuntimeError, EOFError, UnpicklingError, KeyError, struct.error,
            # ...), and nothing in it ran (weights_only=True): it is a bad input.
            text = str(error)
            if "WeightsUnpickler error:" in text:  # the reason after paragraphs of advice
                text = text.split("WeightsUnpickler error:", 1)[1]
            detail = _first_sentence(text) or type(error).__name__
            raise ValueError(
                f"{path!r} is not a PyTorch checkpoint that torch.load(weights_only=True) "
                f"reads: {detail}"
            ) from error


def read(path: str, kind: str, *, num_heads: int | None = None) -> dict[str, np.ndarray]:
    """Canonical weights from a file of ``kind`` (``torch`` recognises its layout).

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: a file that is damaged or not of ``kind``, or weights that
            do not fit the canonical layer.
        ImportError: the framework that ``kind`` needs is not installed.
    """
    if kind == "canonical":
        return load_weights(path)
    interop = _interop(kind)
    if kind == "mxnet-d2l":
        return interop.load_d2l_params(path)
    if kind == "keras-mha":
        try:
            return interop.read_keras_mha_weights(path, num_heads=num_heads)
        except FileNotFoundError:
            raise
        except OSError as error:  # h5py's error for a file that is not HDF5, or is damaged
            raise ValueError(f"{path!r} is not a readable .weights.h5 file: {error}") from error
    state = _torch_load(path)
    if not isinstance(state, dict):
        raise ValueError(f"{path!r} does not hold a state_dict")
    if kind == "torch":
        kind = "torch-d2l" if any(k.startswith("W_") for k in state) else "torch-mha"
    readers: dict[str, Callable] = {
        "torch-mha": interop.from_torch_mha_state_dict,
        "torch-d2l": interop.from_d2l_state_dict,
    }
    return readers[kind](state)


def write(
    path: str, kind: str, weights: dict[str, np.ndarray], *, num_heads: int | None = None
) -> None:
    if kind == "canonical":
        save_weights(path, weights)
        return
    if kind == "keras-mha":
        if num_heads is None:
            raise ValueError("writing keras-mha needs --num-heads (the kernels are per head)")
        if not path.lower().endswith(KERAS_SUFFIXES):
            raise ValueError(f"Keras weights files must end in .weights.h5; got {path!r}")
    interop = _interop(kind)
    if kind == "mxnet-d2l":
        interop.save_d2l_params(path, weights)
        return
    if kind == "keras-mha":
        interop.write_keras_mha_weights(path, weights, num_heads=num_heads)
        return
    import torch

    writers: dict[str, Callable] = {
        "torch-mha": interop.to_torch_mha_state_dict,
        "torch-d2l": interop.to_d2l_state_dict,
    }
    state = writers[kind](weights)
    with open(path, "wb") as file:  # an unwritable path raises OSError, not torch's RuntimeError
        torch.save(state, file)


def convert(
    source: str | os.PathLike[str],
    destination: str | os.PathLike[str],
    *,
    num_heads: int | None = None,
    source_format: str | None = None,
    destination_format: str | None = None,
) -> dict[str, np.ndarray]:
    """Converts a weights file; returns the canonical weights that were written.

    Raises:
        FileNotFoundError: no ``source``, or no directory for ``destination``.
        ValueError: an unknown format, a file that is damaged or not of its
            format, weights that do not fit the target, or a ``num_heads``
            that is not positive or does not divide ``num_hiddens``.
        ImportError: a format whose framework is not installed.
    """
    if num_heads is not None and num_heads < 1:
        raise ValueError(f"--num-heads must be a positive integer; got {num_heads}")
    source, destination = os.fspath(source), os.fspath(destination)
    source_kind = _format_of(source, source_format, reading=True)
    destination_kind = _format_of(destination, destination_format, reading=False)
    # Checked before reading because the frameworks' writers report a missing
    # directory in their own ways (torch a RuntimeError, MXNet an MXNetError).
    directory = os.path.dirname(os.path.abspath(destination))
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"no such directory: {directory!r} (for {destination!r})")
    weights = read(source, source_kind, num_heads=num_heads)
    _, config = check_weights(weights)
    if num_heads is not None and config.num_hiddens % num_heads:
        raise ValueError(
            f"num_hiddens ({config.num_hiddens}) of {source!r} is not divisible by "
            f"--num-heads ({num_heads})"
        )
    write(destination, destination_kind, weights, num_heads=num_heads)
    return weights


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # One line, like the command's own errors, instead of the usage block
        # (which for convert wraps over several lines).
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer; got {value}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    parser = _Parser(
        prog="python -m mha_multi",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    command = commands.add_parser("convert", help="convert a weights file")
    command.add_argument("source")
    command.add_argument("destination")
    command.add_argument(
        "--num-heads",
        type=_positive_int,
        help="checked against num_hiddens; needed to write keras-mha",
    )
    command.add_argument("--from", dest="source_format", choices=FORMATS)
    command.add_argument("--to", dest="destination_format", choices=FORMATS)
    args = parser.parse_args(argv)
    try:
        weights = convert(
            args.source,
            args.destination,
            num_heads=args.num_heads,
            source_format=args.source_format,
            destination_format=args.destination_format,
        )
    except (ValueError, TypeError, OSError, ImportError) as error:
        # Bad files, arguments and formats, and missing frameworks, are the
        # user's to fix: one line, as argparse reports its own errors. Other
        # exceptions are bugs and keep their traceback.
        message = " ".join(str(error).split()) or type(error).__name__
        print(f"{command.prog}: error: {message}", file=sys.stderr)
        return 2
    shapes = ", ".join(f"{k} {tuple(v.shape)}" for k, v in weights.items())
    print(f"{args.source} -> {args.destination}: {shapes}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

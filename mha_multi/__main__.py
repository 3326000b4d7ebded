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
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from mha_multi.weights import check_weights, load_weights, save_weights

CANONICAL_SUFFIXES = (".npz", ".safetensors")
TORCH_SUFFIXES = (".pt", ".pth")
MXNET_SUFFIXES = (".params",)
KERAS_SUFFIXES = (".weights.h5",)
FORMATS = ("canonical", "torch-mha", "torch-d2l", "mxnet-d2l", "keras-mha")


def _format_of(path: str, explicit: str | None, reading: bool) -> str:
    if explicit:
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


def read(path: str, kind: str, *, num_heads: int | None = None) -> dict[str, np.ndarray]:
    """Canonical weights from a file of ``kind`` (``torch`` recognises its layout)."""
    if kind == "canonical":
        return load_weights(path)
    if kind == "mxnet-d2l":
        from mha_multi.interop import mxnet as mxnet_interop

        return mxnet_interop.load_d2l_params(path)
    if kind == "keras-mha":
        from mha_multi.interop import keras as keras_interop  # imports keras

        return keras_interop.read_keras_mha_weights(path, num_heads=num_heads)
    import torch

    from mha_multi.interop import torch as interop

    state = torch.load(path, map_location="cpu", weights_only=True)
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
    if kind == "mxnet-d2l":
        from mha_multi.interop import mxnet as mxnet_interop

        mxnet_interop.save_d2l_params(path, weights)
        return
    if kind == "keras-mha":
        if num_heads is None:
            raise ValueError("writing keras-mha needs --num-heads (the kernels are per head)")
        if not path.lower().endswith(KERAS_SUFFIXES):
            raise ValueError(f"Keras weights files must end in .weights.h5; got {path!r}")
        from mha_multi.interop import keras as keras_interop  # imports keras

        keras_interop.write_keras_mha_weights(path, weights, num_heads=num_heads)
        return
    import torch

    from mha_multi.interop import torch as interop

    writers: dict[str, Callable] = {
        "torch-mha": interop.to_torch_mha_state_dict,
        "torch-d2l": interop.to_d2l_state_dict,
    }
    torch.save(writers[kind](weights), path)


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
        ValueError: an unknown format, weights that do not fit the target, or
            ``num_hiddens`` not divisible by ``num_heads``.
    """
    source, destination = os.fspath(source), os.fspath(destination)
    weights = read(source, _format_of(source, source_format, reading=True), num_heads=num_heads)
    _, config = check_weights(weights)
    if num_heads is not None and config.num_hiddens % num_heads:
        raise ValueError(
            f"num_hiddens ({config.num_hiddens}) of {source!r} is not divisible by "
            f"--num-heads ({num_heads})"
        )
    write(
        destination,
        _format_of(destination, destination_format, reading=False),
        weights,
        num_heads=num_heads,
    )
    return weights


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mha_multi",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    command = commands.add_parser("convert", help="convert a weights file")
    command.add_argument("source")
    command.add_argument("destination")
    command.add_argument(
        "--num-heads", type=int, help="checked against num_hiddens; needed to write keras-mha"
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
    except (ValueError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    shapes = ", ".join(f"{k} {tuple(v.shape)}" for k, v in weights.items())
    print(f"{args.source} -> {args.destination}: {shapes}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

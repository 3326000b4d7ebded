"""``python -m mha_multi convert SRC DST``: canonical weight files to and from native checkpoints.

The formats, listed below (``mha_multi.interop.FORMATS``), come from the
file names or from ``--from``/``--to``. Where several formats share a name's
ending, a file to read is recognised from its content and a file to write
gets the default one:

* ``.pt``, ``.pth``: ``llama`` (a ``q_proj.weight`` entry, or a fused
  ``qkv_proj.weight``, bare or under a prefix such as ``self_attn.``;
  fused projections are split), ``torch-d2l`` (``W_q.weight``...) or else
  ``torch-mha``; written as ``torch-d2l`` unless ``--to`` says otherwise;
* ``.safetensors``: ``llama`` (as above) or else ``canonical``; written as
  ``canonical``;
* ``.weights.h5``: ``keras-gqa`` (a ``GroupQueryAttention``'s variables) or
  else ``keras-mha``; written as ``keras-mha``.

The head layout (``--num-heads``, ``--num-kv-heads``, ``--head-dim``) is
what weights do not record; any one of the three fixes the others, and those
given are checked against the weights and against the file where it stores
heads (``keras-mha``, ``keras-gqa``). Formats whose kernels are per head
(``keras-mha``, ``keras-gqa``) need one to be written; ``llama``, whose
state dict does not record its heads, needs one to be read and written.
Formats with no grouped key/value heads (``torch-mha``, ``keras-mha``)
refuse grouped weights.

A folder is a transformers checkpoint (``config.json``, one or sharded
``.safetensors`` files): ``convert MODEL_DIR OUT_DIR`` writes each attention
layer's canonical weights (``layer_<index>.safetensors``) and their layers'
arguments (``attention.json``), read from the config; ``--layers 0,5`` picks
layers. ``convert OUT_DIR MODEL_DIR`` writes such a folder's layers back into
the checkpoint's files, in place of their attention entries.

A file that cannot be read or does not match its format, a bad argument, or a
format whose framework is not installed ends the command with one line on
stderr, ``python -m mha_multi convert: error: ...``, and exit status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

import numpy as np

from mha_multi.interop.formats import (
    FORMATS,
    check_heads_given,
    detect_format,
    load,
    resolve_heads,
    save,
    suffix_formats,
)
from mha_multi.interop.formats._registry import _record


def _source_format(path: str, explicit: str | None) -> str | None:
    """The source's format, or ``None`` when its content will decide (several share its suffix)."""
    if explicit is not None:
        return _record(explicit).name
    names = suffix_formats(path)
    # An unclaimed suffix is reported now, before anything is read.
    return detect_format(path, reading=True) if len(names) < 2 else None


def convert(
    source: str | os.PathLike[str],
    destination: str | os.PathLike[str],
    *,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    source_format: str | None = None,
    destination_format: str | None = None,
) -> dict[str, np.ndarray]:
    """Converts a weights file; returns the canonical weights that were written.

    Args:
        source: the file to read.
        destination: the file to write.
        num_heads: the number of query heads.
        num_kv_heads: the number of key/value heads.
        head_dim: the size of each head. Any one of the three fixes the head
            layout (:func:`mha_multi.interop.formats.resolve_heads`); those
            given are checked against the weights, and against the source
            where it stores heads. Formats with per-head kernels need one to
            be written, ``llama`` to be read and written.
        source_format: a name of :data:`mha_multi.interop.formats.FORMATS`; by
            default from the file's name (and content, where several formats
            share the name's ending).
        destination_format: likewise; by default from the file's name.

    Raises:
        FileNotFoundError: no ``source``, or no directory for ``destination``.
        ValueError: an unknown format, a file that is damaged or not of its
            format, weights that do not fit the target (grouped heads for a
            format without them), or a head option that is missing where
            needed, not positive, or does not fit the weights or the file.
        ImportError: a format whose framework is not installed.
    """
    options = {"num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim}
    for name, value in options.items():
        if value is not None and value < 1:
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{flag} must be a positive integer; got {value}")
    source, destination = os.fspath(source), os.fspath(destination)
    source_kind = _source_format(source, source_format)
    if destination_format is not None:
        destination_kind = _record(destination_format).name
    else:
        destination_kind = detect_format(destination, reading=False)
    # Missing head options are reported before anything is read.
    check_heads_given(destination_kind, reading=False, **options)
    if source_kind is not None:
        check_heads_given(source_kind, reading=True, **options)
    # Checked before reading because the frameworks' writers report a missing
    # directory in their own ways (torch a RuntimeError, MXNet an MXNetError).
    directory = os.path.dirname(os.path.abspath(destination))
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"no such directory: {directory!r} (for {destination!r})")
    weights = load(source, source_kind, **options)
    save(destination, weights, destination_kind, **options)
    return weights


def _formats_help() -> str:
    width = max(map(len, FORMATS))
    lines = ["formats:"]
    for record in FORMATS.values():
        suffixes = ", ".join(f"*{s}" for s in record.suffixes)
        needs = f"; needs {record.framework}" if record.framework else ""
        lines.append(f"  {record.name:<{width}}  {suffixes}: {record.description}{needs}")
    return "\n".join(lines)


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


def _layer_list(text: str) -> list[int]:
    try:
        layers = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of layer indices: {text!r}") from None
    if any(index < 0 for index in layers):
        raise argparse.ArgumentTypeError(f"layer indices are not negative; got {text!r}")
    return layers


def _convert_folder(args: argparse.Namespace) -> str:
    """A checkpoint folder's conversion (either way), in words; its options checked first."""
    given = [name for name in ("num_heads", "num_kv_heads", "head_dim") if getattr(args, name)]
    given += [name for name in ("source_format", "destination_format") if getattr(args, name)]
    if given:
        raise ValueError(
            f"--{given[0].replace('_', '-')} is for files: a checkpoint folder's "
            "layers are read from its config.json"
        )
    from mha_multi.interop.checkpoint_conversion import convert_folder

    return convert_folder(args.source, args.destination, layers=args.layers)


def main(argv: Sequence[str] | None = None) -> int:
    parser = _Parser(
        prog="python -m mha_multi",
        description=__doc__,
        epilog=_formats_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    command = commands.add_parser(
        "convert",
        help="convert a weights file",
        description=__doc__,
        epilog=_formats_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    command.add_argument("source")
    command.add_argument("destination")
    read = [name for name, record in FORMATS.items() if record.heads == "required"]
    written = [name for name, record in FORMATS.items() if record.heads is not None]
    command.add_argument(
        "--num-heads",
        type=_positive_int,
        help="the number of query heads. Any one of --num-heads, --num-kv-heads and "
        "--head-dim fixes the head layout, the weights' widths giving the rest; those "
        "given are checked against the weights (and the file, where it stores heads). "
        f"One is needed to read {', '.join(read)} and to write {', '.join(written)}",
    )
    command.add_argument("--num-kv-heads", type=_positive_int, help="the number of key/value heads")
    command.add_argument("--head-dim", type=_positive_int, help="the size of each head")
    command.add_argument("--from", dest="source_format", choices=FORMATS)
    command.add_argument("--to", dest="destination_format", choices=FORMATS)
    command.add_argument(
        "--layers",
        type=_layer_list,
        help="a checkpoint folder's layers to convert, as 0,5 (all by default)",
    )
    args = parser.parse_args(argv)
    options = {
        "num_heads": args.num_heads,
        "num_kv_heads": args.num_kv_heads,
        "head_dim": args.head_dim,
    }
    try:
        if os.path.isdir(args.source):
            print(_convert_folder(args))
            return 0
        if args.layers is not None:
            raise ValueError("--layers is for a checkpoint folder; the source is a file")
        weights = convert(
            args.source,
            args.destination,
            source_format=args.source_format,
            destination_format=args.destination_format,
            **options,
        )
        heads = resolve_heads(weights, **options)
    except (ValueError, TypeError, OSError, ImportError) as error:
        # Bad files, arguments and formats, and missing frameworks, are the
        # user's to fix: one line, as argparse reports its own errors. Other
        # exceptions are bugs and keep their traceback.
        message = " ".join(str(error).split()) or type(error).__name__
        print(f"{command.prog}: error: {message}", file=sys.stderr)
        return 2
    shapes = ", ".join(f"{k} {tuple(v.shape)}" for k, v in weights.items())
    layout = (
        ""
        if heads is None
        else f"; num_heads {heads.num_heads}, num_kv_heads {heads.num_kv_heads}, "
        f"head_dim {heads.head_dim}"
    )
    print(f"{args.source} -> {args.destination}: {shapes}{layout}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

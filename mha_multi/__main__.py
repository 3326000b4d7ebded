"""``python -m mha_multi convert SRC DST``: canonical weight files to and from native checkpoints.

The formats, listed below (``mha_multi.interop.FORMATS``), come from the
file names or from ``--from``/``--to``. A ``.pt`` file to read is recognised
as ``torch-mha`` or ``torch-d2l`` from its keys; one to write is
``torch-d2l`` unless ``--to torch-mha``. Formats that store heads
separately (``keras-mha``) need ``--num-heads`` to be written; elsewhere it
is checked against ``num_hiddens`` (and against the file, where it stores
heads).

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

from mha_multi.interop.formats import FORMATS, detect_format, load, save, suffix_formats
from mha_multi.weights import check_weights


def _source_format(path: str, explicit: str | None) -> str | None:
    """The source's format, or ``None`` when its content will decide (several share its suffix)."""
    if explicit is not None:
        _check_format(explicit)
        return explicit
    names = suffix_formats(path)
    # An unclaimed suffix is reported now, before anything is read.
    return detect_format(path, reading=True) if len(names) < 2 else None


def _check_format(name: str) -> None:
    if name not in FORMATS:
        raise ValueError(f"unknown format {name!r}; expected one of {', '.join(FORMATS)}")


def convert(
    source: str | os.PathLike[str],
    destination: str | os.PathLike[str],
    *,
    num_heads: int | None = None,
    source_format: str | None = None,
    destination_format: str | None = None,
) -> dict[str, np.ndarray]:
    """Converts a weights file; returns the canonical weights that were written.

    Args:
        source: the file to read.
        destination: the file to write.
        num_heads: checked against ``num_hiddens``; needed to write formats
            that store heads separately.
        source_format: a name of :data:`mha_multi.interop.formats.FORMATS`; by
            default from the file's name (and content, for ``.pt``).
        destination_format: likewise; by default from the file's name.

    Raises:
        FileNotFoundError: no ``source``, or no directory for ``destination``.
        ValueError: an unknown format, a file that is damaged or not of its
            format, weights that do not fit the target, or a ``num_heads``
            that is missing where needed, not positive, or does not divide
            ``num_hiddens``.
        ImportError: a format whose framework is not installed.
    """
    if num_heads is not None and num_heads < 1:
        raise ValueError(f"--num-heads must be a positive integer; got {num_heads}")
    source, destination = os.fspath(source), os.fspath(destination)
    source_kind = _source_format(source, source_format)
    if destination_format is not None:
        _check_format(destination_format)
        destination_kind = destination_format
    else:
        destination_kind = detect_format(destination, reading=False)
    if FORMATS[destination_kind].num_heads and num_heads is None:
        raise ValueError(f"writing {destination_kind} needs --num-heads (the kernels are per head)")
    # Checked before reading because the frameworks' writers report a missing
    # directory in their own ways (torch a RuntimeError, MXNet an MXNetError).
    directory = os.path.dirname(os.path.abspath(destination))
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"no such directory: {directory!r} (for {destination!r})")
    weights = load(source, source_kind, num_heads=num_heads)
    _, config = check_weights(weights)
    if num_heads is not None and config.num_hiddens % num_heads:
        raise ValueError(
            f"num_hiddens ({config.num_hiddens}) of {source!r} is not divisible by "
            f"--num-heads ({num_heads})"
        )
    save(destination, weights, destination_kind, num_heads=num_heads)
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
    command.add_argument(
        "--num-heads",
        type=_positive_int,
        help="checked against num_hiddens; needed to write "
        + ", ".join(name for name, record in FORMATS.items() if record.num_heads),
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

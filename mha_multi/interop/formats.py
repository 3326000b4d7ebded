"""The weight-file formats: one registry, read and written by name.

:data:`FORMATS` maps each format's name (what ``python -m mha_multi convert
--from/--to`` takes) to a :class:`Format` record: what it is, the file names
that mean it, the framework it needs, what it does with the head layout, and
where its reader and writer live. Readers, writers and recognisers are named
by import path and imported on first use, so importing this module imports
no framework.

A file name ending shared by several formats (``.pt``: ``torch-mha``,
``torch-d2l`` and ``llama``; ``.safetensors``: ``canonical`` and ``llama``;
``.weights.h5``: ``keras-mha`` and ``keras-gqa``) is resolved by the file's
content when reading (the ending's recogniser in :data:`RECOGNISERS`) and by
the one ``default`` format among them when writing.

The head layout (``num_heads``, ``num_kv_heads``, ``head_dim``; see
:class:`mha_multi.spec.Heads`) is what canonical weights do not record: their
widths are ``num_heads * head_dim`` (``W_q``) and ``num_kv_heads * head_dim``
(``W_k``, ``W_v``), so any one of the three fixes the other two
(:func:`resolve_heads`). A format either records no layout, or stores it
(Keras' per-head kernels), or is defined by one that it does not record
(a Llama state dict): :attr:`Format.heads`.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal

import numpy as np

from mha_multi import spec
from mha_multi.weights import check_weights

__all__ = [
    "FORMATS",
    "RECOGNISERS",
    "Format",
    "check_heads_given",
    "check_stored_heads",
    "detect_format",
    "llama_prefixes",
    "load",
    "resolve_heads",
    "safetensors_format",
    "save",
    "suffix_formats",
]


@dataclass(frozen=True)
class Format:
    """A weight-file format of the registry.

    Attributes:
        name: the registry key, as ``--from``/``--to`` take it (``torch-mha``).
        description: one line saying what the file holds.
        suffixes: lower-case endings of the file names that mean this format.
        reader: ``"module:function"``; the function takes ``(path)`` (and, when
            :attr:`heads`, ``num_heads=``, ``num_kv_heads=`` and
            ``head_dim=``, each ``None`` where not given) and returns
            canonical weights.
        writer: ``"module:function"``; the function takes ``(path, weights)``
            (and, when :attr:`heads`, the three keywords, resolved against the
            weights: all ints).
        framework: what the reader and writer import, as users know it
            (``"PyTorch"``); ``None`` for numpy alone.
        extra: the ``mha_multi[...]`` extra that installs the framework.
        heads: what the file does with the head layout. ``None``: it records
            none (the weights' widths are all it says; a layout given is
            checked against them). ``"stored"``: it stores the layout (kernels
            per head): the reader checks the keywords given against it, the
            writer needs it. ``"required"``: its shapes follow a layout that it
            does not record (a Llama state dict): the reader and the writer
            both need it.
        default: written for a file name that several formats share.
    """

    name: str
    description: str
    suffixes: tuple[str, ...]
    reader: str
    writer: str
    framework: str | None = None
    extra: str | None = None
    heads: Literal["stored", "required"] | None = None
    default: bool = True


#: Module of :mod:`mha_multi.interop` -> the framework it imports, as users
#: know it, and the ``mha_multi[...]`` extra that installs that framework.
_FRAMEWORKS = {
    "torch": ("PyTorch", "torch"),
    "llama": ("PyTorch", "torch"),
    "mxnet": ("MXNet", "mxnet"),
    "keras": ("Keras", "keras"),
}


def _interop_format(
    name: str,
    module: str,
    description: str,
    suffixes: tuple[str, ...],
    *,
    heads: Literal["stored", "required"] | None = None,
    default: bool = True,
) -> Format:
    """The record of a format that ``mha_multi.interop.<module>`` reads and writes.

    The reader and writer are that module's ``load_<format>`` and
    ``save_<format>`` (``-`` in ``name`` written ``_``), the names every
    interop module gives them.
    """
    framework, extra = _FRAMEWORKS[module]
    function = name.replace("-", "_")
    return Format(
        name=name,
        description=description,
        suffixes=suffixes,
        reader=f"mha_multi.interop.{module}:load_{function}",
        writer=f"mha_multi.interop.{module}:save_{function}",
        framework=framework,
        extra=extra,
        heads=heads,
        default=default,
    )


#: Format name -> record, in the order help and error messages list them.
FORMATS: Mapping[str, Format] = MappingProxyType(
    {
        record.name: record
        for record in (
            Format(
                name="canonical",
                description="canonical weights (.npz read with allow_pickle=False)",
                suffixes=(".npz", ".safetensors"),
                reader="mha_multi.weights:load_weights",
                writer="mha_multi.weights:save_weights",
            ),
            _interop_format(
                "torch-mha",
                "torch",
                "state_dict of torch.nn.MultiheadAttention",
                (".pt", ".pth"),
                default=False,
            ),
            _interop_format(
                "torch-d2l",
                "torch",
                "state_dict of d2l's torch MultiHeadAttention (also mha_multi.torch's)",
                (".pt", ".pth"),
            ),
            _interop_format(
                "llama",
                "llama",
                "state_dict of a Llama-style attention (q_proj, k_proj, v_proj, o_proj; "
                "transformers' LlamaAttention), by torch.save or safetensors",
                (".pt", ".pth", ".bin", ".safetensors"),
                heads="required",
                default=False,
            ),
            _interop_format(
                "mxnet-d2l",
                "mxnet",
                "Gluon parameters of d2l's MXNet MultiHeadAttention "
                "(also mha_multi.mxnet's), as save_parameters writes them",
                (".params",),
            ),
            _interop_format(
                "keras-mha",
                "keras",
                "Keras save_weights of a model holding one keras.layers.MultiHeadAttention",
                (".weights.h5",),
                heads="stored",
            ),
            _interop_format(
                "keras-gqa",
                "keras",
                "Keras save_weights of a model holding one keras.layers.GroupQueryAttention",
                (".weights.h5",),
                heads="stored",
                default=False,
            ),
        )
    }
)

#: File name ending shared by several formats -> ``"module:function"`` telling,
#: from the content of such a file, which of them it is (``function(path) ->
#: name``). A recogniser imports what reading the file needs, no more: a
#: ``.safetensors`` file is told apart by its header alone, without PyTorch.
RECOGNISERS: Mapping[str, str] = MappingProxyType(
    {
        ".safetensors": "mha_multi.interop.formats:safetensors_format",
        ".pt": "mha_multi.interop.torch:checkpoint_format",
        ".pth": "mha_multi.interop.torch:checkpoint_format",
        ".weights.h5": "mha_multi.interop.keras:weights_file_format",
    }
)

#: The command line's name of each head option, which messages use.
_FLAGS = {"num_heads": "--num-heads", "num_kv_heads": "--num-kv-heads", "head_dim": "--head-dim"}

#: The last entry name of a Llama-style attention block that every such block has.
_LLAMA_QUERY = "q_proj.weight"


def _record(name: str) -> Format:
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown format {name!r}; expected one of {', '.join(FORMATS)}") from None


def _suffix(path: str | os.PathLike[str]) -> str | None:
    """The longest registered suffix that ends ``path``'s name (any case), or ``None``."""
    name = os.fspath(path).lower()
    matches = [s for record in FORMATS.values() for s in record.suffixes if name.endswith(s)]
    return max(matches, key=len, default=None)


def suffix_formats(path: str | os.PathLike[str]) -> tuple[str, ...]:
    """The names of the formats whose suffixes end ``path``'s name.

    Case does not matter; the longest matching suffix wins (``w.weights.h5``
    is ``keras-mha`` or ``keras-gqa`` even if a format claimed ``.h5``).

    Returns:
        Registry names, in registry order; empty when no suffix matches.
    """
    suffix = _suffix(path)
    return tuple(name for name, record in FORMATS.items() if suffix in record.suffixes)


def _function(target: str, label: str, record: Format | None) -> Callable[..., Any]:
    """The function at ``"module:function"``, importing ``record``'s framework.

    A missing framework is reported for ``label`` as ``record`` names it;
    with no ``record``, or one of no framework, the import error stays as it is.
    """
    module_name, _, attribute = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if record is None or record.framework is None:
            raise
        raise ImportError(
            f"format {label} needs {record.framework}, which is not installed ({error}): "
            f"pip install 'mha_multi[{record.extra}]'"
        ) from error
    return getattr(module, attribute)


def detect_format(path: str | os.PathLike[str], *, reading: bool) -> str:
    """The registry name of the format of the file at ``path``.

    Args:
        path: the file.
        reading: ``True`` for an existing file to read: where several formats
            share its suffix, its content decides (the suffix's recogniser in
            :data:`RECOGNISERS`, which may import a framework and reads the
            file); ``False`` for a file to write, which gets the default
            format of its suffix.

    Raises:
        FileNotFoundError: reading, no file at ``path`` (where the content decides).
        ValueError: no format claims the suffix (or, reading, the content
            matches none of the formats that share it).
        ImportError: reading needs a framework that is not installed.
    """
    suffix = _suffix(path)
    if suffix is None:
        raise ValueError(
            f"cannot tell the format of {os.fspath(path)!r} from its name; pass --from/--to "
            f"(one of {', '.join(FORMATS)})"
        )
    names = suffix_formats(path)
    if len(names) == 1:
        return names[0]
    records = [FORMATS[n] for n in names]
    if not reading:
        return next(r.name for r in records if r.default)
    # A missing framework is named after every candidate: the one they share.
    shared = records[0] if len({r.framework for r in records}) == 1 else None
    recognise = _function(RECOGNISERS[suffix], "/".join(names), shared)
    name = recognise(os.fspath(path))
    if name not in names:
        raise ValueError(f"{os.fspath(path)!r} is none of the formats {', '.join(names)}")
    return name


# --------------------------------------------------------------------------
# The head layout
# --------------------------------------------------------------------------


def _check_options(options: Mapping[str, Any]) -> dict[str, int]:
    """The head options that were given, checked to be positive ints."""
    given = {}
    for name, value in options.items():
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise ValueError(f"{_FLAGS[name]} must be a positive integer; got {value!r}")
        if value < 1:
            raise ValueError(f"{_FLAGS[name]} must be a positive integer; got {value}")
        given[name] = int(value)
    return given


def resolve_heads(
    weights: Mapping[str, Any],
    *,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    source: str | os.PathLike[str] | None = None,
) -> spec.Heads | None:
    """The head layout of canonical weights that the options given fix.

    ``W_q`` has ``num_heads * head_dim`` columns and ``W_k`` ``num_kv_heads *
    head_dim``, so any one option fixes the layout: ``head_dim`` comes from
    ``num_heads`` if given, else from ``head_dim``, else from
    ``num_kv_heads``; the others given are checked against it. Messages name
    the options as the command line does (``--num-heads``).

    Args:
        weights: canonical weights.
        num_heads, num_kv_heads, head_dim: the options; ``None`` where not given.
        source: the file the weights come from, for messages.

    Returns:
        The layout, or ``None`` when no option is given.

    Raises:
        ValueError: an option that is not a positive integer, that does not
            divide the width it counts, or that disagrees with another; or
            invalid weights.
    """
    given = _check_options(
        {"num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim}
    )
    if not given:
        return None
    _, config = check_weights(weights)
    where = "" if source is None else f" of {os.fspath(source)!r}"
    query, kv, hidden = config.query_features, config.kv_features, config.num_hiddens
    assert query is not None and kv is not None  # check_weights reads them from the kernels
    if num_heads is not None:
        if query % num_heads:
            if query == hidden:  # d2l's layout: the message the command has always given
                raise ValueError(
                    f"num_hiddens ({hidden}){where} is not divisible by --num-heads ({num_heads})"
                )
            raise ValueError(
                f"the query projection{where} has {query} features (num_heads * head_dim), "
                f"which --num-heads ({num_heads}) does not divide"
            )
        dim, basis = query // num_heads, f"--num-heads {num_heads}"
    elif head_dim is not None:
        dim, basis = head_dim, f"--head-dim {head_dim}"
    else:
        assert num_kv_heads is not None
        if kv % num_kv_heads:
            raise ValueError(
                f"the key and value projections{where} have {kv} features (num_kv_heads * "
                f"head_dim), which --num-kv-heads ({num_kv_heads}) does not divide"
            )
        dim, basis = kv // num_kv_heads, f"--num-kv-heads {num_kv_heads}"
    for projection, features in (
        ("query projection has", query),
        ("key and value projections have", kv),
    ):
        if features % dim:
            noun, verb = projection.rsplit(" ", 1)
            raise ValueError(
                f"the {noun}{where} {verb} {features} features, no whole number of heads of "
                f"head_dim {dim} (given {basis})"
            )
    layout = {"num_heads": query // dim, "num_kv_heads": kv // dim, "head_dim": dim}
    for name, value in given.items():
        if value != layout[name]:
            raise ValueError(
                f"{_FLAGS[name]} {value} does not match the weights{where}: given {basis}, "
                f"their query projection ({query} features) holds {layout['num_heads']} heads "
                f"of head_dim {dim} and their key and value projections ({kv} features) "
                f"{layout['num_kv_heads']} key/value heads"
            )
    try:
        return spec.check_heads(
            hidden, layout["num_heads"], num_kv_heads=layout["num_kv_heads"], head_dim=dim
        )
    except ValueError as error:
        raise ValueError(
            f"the weights{where} have no head layout given {basis}: {error}"
        ) from error


def check_stored_heads(
    stored: spec.Heads,
    path: str | os.PathLike[str],
    *,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    detail: str = "",
) -> None:
    """Checks the head options given against the layout a file stores.

    Args:
        stored: the file's layout.
        path: the file, for messages.
        num_heads, num_kv_heads, head_dim: the options; ``None`` where not given.
        detail: appended to the message (`` (query kernel shape ...)``).

    Raises:
        ValueError: an option that is not a positive integer or differs from
            the file's, named as the command line names it.
    """
    given = _check_options(
        {"num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim}
    )
    stored_as = {
        "num_heads": f"the {stored.num_heads} heads",
        "num_kv_heads": f"the {stored.num_kv_heads} key/value heads",
        "head_dim": f"the head_dim {stored.head_dim}",
    }
    for name, value in given.items():
        if value != getattr(stored, name):
            raise ValueError(
                f"{_FLAGS[name]} {value} does not match {stored_as[name]} stored in "
                f"{os.fspath(path)!r}{detail}"
            )


def check_heads_given(
    name: str,
    *,
    reading: bool,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
) -> None:
    """Raises ``ValueError`` when format ``name`` needs a head layout and no option gives one.

    Args:
        name: a registry name.
        reading: whether the file is read (``False``: written).
        num_heads, num_kv_heads, head_dim: the options; ``None`` where not given.
    """
    record = _record(name)
    needed = record.heads == "required" or (record.heads == "stored" and not reading)
    if not needed or any(v is not None for v in (num_heads, num_kv_heads, head_dim)):
        return
    why = (
        "the kernels are per head"
        if record.heads == "stored"
        else f"a {name} file does not record its head layout, which its shapes must fit"
    )
    action = "reading" if reading else "writing"
    raise ValueError(f"{action} {name} needs --num-heads (or --num-kv-heads or --head-dim): {why}")


# --------------------------------------------------------------------------
# Content recognisers that need no framework
# --------------------------------------------------------------------------


def llama_prefixes(names: Iterable[str]) -> list[str]:
    """The prefixes under which ``names`` hold a Llama-style attention block.

    A block is recognised by its ``q_proj.weight``, bare or under a prefix
    ending in ``.`` (``self_attn.``, ``model.layers.0.self_attn.``).

    Returns:
        The prefixes, sorted; empty when ``names`` hold no such block.
    """
    prefixes = set()
    for name in map(str, names):
        if name.endswith(_LLAMA_QUERY):
            prefix = name[: -len(_LLAMA_QUERY)]
            if prefix == "" or prefix.endswith("."):
                prefixes.add(prefix)
    return sorted(prefixes)


def safetensors_format(path: str | os.PathLike[str]) -> str:
    """Which format a ``.safetensors`` file holds: ``"llama"`` or ``"canonical"``.

    Only the header is read (tensor names), with no framework. A Llama-style
    attention block's names (:func:`llama_prefixes`) mean ``llama``; anything
    else, a damaged file included, is taken for ``canonical``, whose reader
    then checks it and says what is wrong.

    Raises:
        OSError: the file cannot be opened (``FileNotFoundError`` when there is none).
    """
    from safetensors import SafetensorError, safe_open

    path = os.fspath(path)
    with open(path, "rb"):  # a missing or unreadable file keeps its usual OSError
        pass
    try:
        with safe_open(path, framework="numpy") as file:
            names = list(file.keys())
    except SafetensorError:
        return "canonical"
    return "llama" if llama_prefixes(names) else "canonical"


# --------------------------------------------------------------------------
# Reading and writing
# --------------------------------------------------------------------------


def load(
    path: str | os.PathLike[str],
    format: str | None = None,
    *,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
) -> dict[str, np.ndarray]:
    """Canonical weights from a file of any registered format.

    Args:
        path: the file.
        format: a registry name; by default detected (:func:`detect_format`).
        num_heads, num_kv_heads, head_dim: the head layout, where known
            (:func:`resolve_heads`): checked against the file where it stores
            one, needed where it follows one it does not record (``llama``),
            and otherwise checked against the weights' widths.

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: an unknown format, a file that is damaged or not of its
            format, weights that do not fit the canonical layer, or head
            options that are missing where needed or do not fit the file.
        ImportError: the format's framework is not installed.
    """
    options = {"num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim}
    _check_options(options)
    name = detect_format(path, reading=True) if format is None else _record(format).name
    record = FORMATS[name]
    check_heads_given(name, reading=True, **options)
    reader = _function(record.reader, name, record)
    if record.heads is not None:
        return reader(os.fspath(path), **options)
    weights = reader(os.fspath(path))
    resolve_heads(weights, source=path, **options)
    return weights


def save(
    path: str | os.PathLike[str],
    weights: Mapping[str, Any],
    format: str | None = None,
    *,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
) -> None:
    """Writes canonical weights as a file of any registered format.

    Args:
        path: the destination.
        weights: canonical weights.
        format: a registry name; by default detected (:func:`detect_format`).
        num_heads, num_kv_heads, head_dim: the head layout (any one fixes it,
            :func:`resolve_heads`); needed by formats with a layout, and
            checked against the weights' widths.

    Raises:
        ValueError: an unknown format, invalid weights, weights the format
            cannot express, or head options that are missing where needed or
            do not fit the weights.
        ImportError: the format's framework is not installed.
        OSError: the file cannot be written.
    """
    options = {"num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim}
    name = detect_format(path, reading=False) if format is None else _record(format).name
    record = FORMATS[name]
    _check_options(options)
    check_heads_given(name, reading=False, **options)
    heads = resolve_heads(weights, **options)
    writer = _function(record.writer, name, record)
    if record.heads is None:
        writer(os.fspath(path), weights)
        return
    assert heads is not None  # check_heads_given
    writer(
        os.fspath(path),
        weights,
        num_heads=heads.num_heads,
        num_kv_heads=heads.num_kv_heads,
        head_dim=heads.head_dim,
    )

"""The weight-file formats: one registry, read and written by name.

:data:`FORMATS` maps each format's name (what ``python -m mha_multi convert
--from/--to`` takes) to a :class:`Format` record: what it is, the file names
that mean it, the framework it needs, what it does with the head layout, and
where its reader and writer live. Readers, writers and recognisers are named
by import path and imported on first use, so importing this package imports
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

from collections.abc import Mapping

from mha_multi.interop.formats import _registry
from mha_multi.interop.formats._files import detect_format, load, save, suffix_formats
from mha_multi.interop.formats._head_layout import (
    check_heads_given,
    check_stored_heads,
    resolve_heads,
)
from mha_multi.interop.formats._recognisers import llama_prefixes, safetensors_format
from mha_multi.interop.formats._registry import Format

# The registry's tables are bound here, with their descriptions, because the
# API page reads the descriptions of data from the module it documents.

#: Format name -> record, in the order help and error messages list them.
FORMATS: Mapping[str, Format] = _registry.FORMATS
#: File name ending shared by several formats -> ``"module:function"`` telling,
#: from the content of such a file, which of them it is (``function(path) ->
#: name``). A recogniser imports what reading the file needs, no more: a
#: ``.safetensors`` file is told apart by its header alone, without PyTorch.
RECOGNISERS: Mapping[str, str] = _registry.RECOGNISERS

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

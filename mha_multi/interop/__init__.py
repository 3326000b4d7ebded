"""Canonical weights to and from other layers: each framework's native attention and d2l's.

One module per framework, imported only when used: ``mha_multi.interop.torch``
(``torch.nn.MultiheadAttention``, d2l's torch layer), ``mha_multi.interop.llama``
(transformers' Llama-style attention, on PyTorch; its state dicts read with
numpy alone in ``mha_multi.interop.llama_state``, fused projections split by
``mha_multi.interop.fused_projections``; whole causal LMs run with the layer
by ``mha_multi.interop.transformers_models``; every attention layer of a
checkpoint folder read, with numpy alone, by ``mha_multi.interop.transformers``
and written to a folder and back by ``mha_multi.interop.checkpoint_conversion``),
``mha_multi.interop.mxnet`` (d2l's Gluon layer), ``mha_multi.interop.keras``
(``keras.layers.MultiHeadAttention``, ``keras.layers.GroupQueryAttention``,
d2l's Keras layer) and
``mha_multi.interop.jax`` (Flax attention modules, d2l's JAX layer). Every
converter is strict: what the canonical layer cannot express raises a
``ValueError`` that says so.

Every module names its functions after the format they convert, ``<format>``
being ``torch_mha``, ``torch_d2l``, ``llama``, ``mxnet_d2l``, ``keras_mha``,
``keras_gqa``, ``keras_d2l``, ``flax_nnx``, ``flax_linen`` or ``jax_d2l``
(the registry's names with ``_`` for ``-``):

* ``from_<format>(native)``: canonical weights from the native object (a
  layer, or the variables of a Linen module);
* ``to_<format>(weights, ...)``: the native object holding canonical
  weights (for d2l's layers, which this package does not define, the layer
  to load them into is passed and returned);
* ``from_<format>_state(state)`` / ``to_<format>_state(weights, ...)``: the
  same with the plain mapping of arrays the framework stores (a torch
  ``state_dict``, Gluon parameters, Keras' variables, Flax's tree);
* ``load_<format>(path, ...)`` / ``save_<format>(path, weights, ...)``: files.

:data:`~mha_multi.interop.formats.FORMATS` registers the file formats;
:func:`~mha_multi.interop.formats.load` and :func:`~mha_multi.interop.formats.save`
read and write any of them by name or file suffix, importing the format's
framework only then (importing this package imports none).
"""

from mha_multi.interop.formats import FORMATS, Format, detect_format, load, save, suffix_formats

__all__ = ["FORMATS", "Format", "detect_format", "load", "save", "suffix_formats"]

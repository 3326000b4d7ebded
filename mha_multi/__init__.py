"""One multi-head attention layer, four frameworks, one spec.

Import a backend for the layer (``mha_multi.torch``, ``mha_multi.jax``,
``mha_multi.keras``, ``mha_multi.mxnet``); this package itself imports no
framework.
"""

__version__ = "0.1.0"

"""Canonical weights to and from other layers: each framework's native attention and d2l's.

One module per framework, imported only when used: ``mha_multi.interop.torch``
(``torch.nn.MultiheadAttention``, d2l's torch layer), ``mha_multi.interop.mxnet``
(d2l's Gluon layer), ``mha_multi.interop.keras`` (``keras.layers.MultiHeadAttention``,
d2l's Keras layer) and ``mha_multi.interop.jax`` (Flax attention modules, d2l's
JAX layer). Every converter is strict: what the canonical layer cannot express
raises a ``ValueError`` that says so.
"""

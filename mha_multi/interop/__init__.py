"""Canonical weights to and from other layers: each framework's native attention and d2l's.

One module per framework, imported only when used:
``mha_multi.interop.torch``. Every converter is strict: what the canonical
layer cannot express raises a ``ValueError`` that says so.
"""

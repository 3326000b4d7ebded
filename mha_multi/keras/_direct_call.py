"""When an eager call of the Keras layer may go straight to its ``call``, past ``Layer.__call__``.

Keras' ``Layer.__call__`` converts arrays, binds the call's 13 arguments to
its signature (on TensorFlow a slow ``is_tensor`` of each ``None`` and
``False``), opens name scopes, resolves ``training`` from an outer layer's
call and sets up mixed precision's autocasting: 900 to 1100 Python calls
per call, as many as the layer's own work on a one-token call or decoding
step (docs: "Fast paths"). For a call in which none of that applies, which
:func:`skips_keras_call` recognises, it would hand ``call`` the arguments
as they are: the layer then calls ``call`` itself. Anything else, the first
call included, takes Keras' way.

What it reads of Keras' state (the current call context, the autocast
scope, whether the layer was called) has no public accessor: it is read
from ``keras.src`` as the Keras versions in :data:`CHECKED_KERAS` keep it
(the project pins one of them). Under any other Keras every call takes
Keras' way: slower, never wrong.
"""

from __future__ import annotations

from typing import Any

import keras

from mha_multi.keras._frameworks import active, values_readable

try:
    from keras.src.backend.common import global_state
except ImportError:  # (another Keras' layout)
    global_state = None

__all__ = ["CHECKED_KERAS", "keras_state_is_plain", "skips_keras_call"]

#: The Keras versions whose ``Layer.__call__`` and state :func:`skips_keras_call` was
#: checked against (prefixes of ``keras.__version__``).
CHECKED_KERAS = ("3.15.",)
#: Whether this Keras is one of them.
_CHECKED = global_state is not None and keras.__version__.startswith(CHECKED_KERAS)


def _concrete(x: Any) -> bool:
    """Whether ``x`` is an argument ``Layer.__call__`` would pass on unchanged:
    ``None``, a bool or number, or an eager backend tensor (a tuple of them:
    a cache) without a Keras mask."""
    if x is None or isinstance(x, (bool, int, float)):
        return True
    if isinstance(x, tuple):
        return all(_concrete(item) for item in x)
    return keras.ops.is_tensor(x) and getattr(x, "_keras_mask", None) is None and values_readable(x)


def keras_state_is_plain(layer: keras.layers.Layer, *, traced: bool = False) -> bool:
    """Whether nothing of Keras' state changes what ``layer``'s ``call`` computes: no
    autocast scope or distribution, a dtype policy that is not mixed, and no
    quantization, rematerialization, activity regularizer or framework hooks.

    ``traced``: for a call traced into a program of its own
    (:mod:`mha_multi.keras._call_plan`), which reads the variables' values
    once, outside it: no stateless scope either (whose values the program
    would not see). Under a Keras other than :data:`CHECKED_KERAS`, never.
    """
    if not _CHECKED:
        return False
    if (
        global_state.get_global_attribute("autocast_scope") is not None
        or keras.distribution.distribution() is not None
        or (traced and global_state.get_global_attribute("stateless_scope") is not None)
    ):
        return False
    return not (
        layer.compute_dtype != layer.variable_dtype
        or layer.activity_regularizer is not None
        or getattr(layer, "_remat_mode", None) is not None
        or layer.dtype_policy.quantization_mode is not None
        or active().has_call_hooks(layer)
    )


def skips_keras_call(layer: keras.layers.Layer, args: tuple, kwargs: dict[str, Any]) -> bool:
    """Whether ``layer(*args, **kwargs)`` may be ``layer.call(*args, **kwargs)``.

    Where ``Layer.__call__`` would do nothing but pass the arguments on: the
    layer is built and called before (so nothing is built or first-called
    now), runs eagerly on tensors of the backend (no symbolic call, no trace:
    ``tf.function``, ``jax.jit`` and ``torch.compile`` take Keras' way), is
    called from no other layer's call (whose ``training`` it would inherit),
    Keras' state is plain (:func:`keras_state_is_plain`) and its
    ``training`` is given or cannot matter (no dropout).
    """
    if not (_CHECKED and layer.built and layer._called):
        return False
    if kwargs.get("training") is None and layer.dropout > 0:
        return False
    if global_state.get_global_attribute("current_call_ctx") is not None:
        return False
    if not keras_state_is_plain(layer):
        return False
    return all(_concrete(x) for x in args) and all(_concrete(x) for x in kwargs.values())

"""Keras' boolean ``attention_mask`` that hides what the spec's ``valid_lens`` and ``causal`` hide.

Part of :mod:`mha_multi.interop.keras`, whose notes say how Keras' masks
differ from the spec's.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mha_multi import spec

__all__ = ["attention_mask"]


def attention_mask(
    valid_lens: Any, num_queries: int, num_keys: int, *, causal: bool = False
) -> np.ndarray:
    """Keras' boolean ``attention_mask`` equivalent to the spec's masking.

    Args:
        valid_lens: ``None``, ``(B,)`` or ``(B, Q)``; with ``None``, pass
            ``causal=True`` (otherwise nothing is hidden and no mask is needed).
        num_queries: ``Q``.
        num_keys: ``K``.
        causal: the spec's bottom-right aligned causal rule.

    Returns:
        ``(B, Q, K)`` (or ``(1, Q, K)`` without lengths), ``True`` where a key
        is visible (Keras' polarity).

    Raises:
        TypeError: lengths that are neither integer nor floating.
        ValueError: neither lengths nor ``causal``, or lengths of another shape.
    """
    if valid_lens is None and not causal:
        raise ValueError("nothing is hidden without valid_lens or causal=True: pass no mask")
    lens = None if valid_lens is None else np.asarray(valid_lens)
    if lens is not None:  # (their dtype: spec.visibility checks it)
        spec.check_valid_lens_shape(lens.shape, lens.shape[0] if lens.ndim else 1, num_queries)
    visible = spec.visibility(spec.NumpyOps(), num_queries, num_keys, lens, causal=causal)
    batch = 1 if lens is None else lens.shape[0]
    return np.broadcast_to(visible, (batch, 1, num_queries, num_keys))[:, 0].copy()

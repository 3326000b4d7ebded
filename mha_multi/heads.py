"""Pruning heads from canonical weights, and what every backend's head importance
shares (numpy only; docs: "Heads").

A pruned layer is a smaller layer: the heads' columns of ``W_q`` (and of
``W_k``/``W_v`` where a key/value head goes with them) and rows of ``W_o``
are removed, so it computes exactly what the full layer computes with those
heads' ``head_mask`` entries at 0, in every framework, with fewer FLOPs.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from mha_multi import spec
from mha_multi.weights import check_weights

__all__ = [
    "LayerConfig",
    "Pruned",
    "check_loss",
    "importance",
    "importance_over",
    "prune_heads",
]


@dataclasses.dataclass(frozen=True)
class LayerConfig:
    """The configuration of a layer holding some canonical weights.

    ``kwargs()`` is what every backend's ``MultiHeadAttention`` constructor
    takes: ``MultiHeadAttention(**config.kwargs())``.
    """

    num_hiddens: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    bias: bool
    query_size: int
    key_size: int
    value_size: int
    #: The heads have sink logits (the canonical ``sinks``; docs: "Positions and biases").
    sinks: bool = False

    def kwargs(self) -> dict[str, Any]:
        """The constructor's keyword arguments."""
        return dataclasses.asdict(self)


class Pruned(NamedTuple):
    """What :func:`prune_heads` returns."""

    weights: dict[str, np.ndarray]
    config: LayerConfig


def _head_columns(head: int, head_dim: int) -> np.ndarray:
    return np.arange(head * head_dim, (head + 1) * head_dim)


def prune_heads(
    weights: Mapping[str, Any],
    heads: Iterable[int],
    *,
    num_heads: int,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
) -> Pruned:
    """The canonical weights and configuration of the layer without query heads ``heads``.

    Query head ``h`` loses its ``W_q``/``b_q`` columns and its ``W_o`` rows.
    In multi-head attention its key/value head goes with it (``W_k``,
    ``b_k``, ``W_v``, ``b_v`` columns). With grouped heads a key/value head
    serves a group of ``num_heads // num_kv_heads`` query heads, so only
    whole groups may go, and then their key/value head too. A layer with sinks
    keeps the kept heads' entries of ``sinks``. ``b_o`` and the input sizes
    are unchanged, and so is ``head_dim``: the pruned layer has
    ``num_heads * head_dim != num_hiddens``, which its configuration states.
    The ``(head_dim,)`` weights of a per-head ``qk_norm`` stay as they are
    (the pruned layer takes the same ``qk_norm``); a norm of the whole
    projection spans every head, and is refused. ALiBi's slopes depend on
    each head's place among all heads: a layer with ``alibi=True`` pruned
    would not compute what its gated heads do (docs: "Heads").

    Args:
        weights: canonical weights of the full layer.
        heads: indices of the query heads to remove, in ``[0, num_heads)``.
        num_heads: the full layer's query heads.
        num_kv_heads: its key/value heads (``None``: read from the weights).
        head_dim: its head size (``None``: ``W_q``'s width over ``num_heads``);
            checked against the weights when given.

    Returns:
        ``(weights, config)``: the pruned weights (new arrays) and the
        configuration to build the pruned layer with.

    Raises:
        TypeError: ``heads`` that are not an iterable of ints.
        ValueError: an index out of range or repeated, every head removed,
            part of a group of grouped heads, weights that do not fit the
            head layout, or the weights of a ``qk_norm`` of scope ``"whole"``.
    """
    arrays, config = check_weights(weights, qk_norm=None, sinks=None)
    layout = spec.heads_of_weights(arrays, num_heads, num_kv_heads=num_kv_heads)
    norms = {name: arrays[name] for name in spec.QK_NORM_NAMES if name in arrays}
    if norms and norms["q_norm"].shape != (layout.head_dim,):
        spec.refuse_whole_norm(spec.QKNorm(scope="whole"), "pruning heads")
    spec.sink_logits_of(arrays, config.sinks, layout.num_heads)  # (num_heads,), checked
    if head_dim is not None and head_dim != layout.head_dim:
        raise ValueError(
            f"head_dim ({head_dim}) does not fit W_q: {arrays['W_q'].shape[1]} columns "
            f"for {num_heads} heads make head_dim {layout.head_dim}"
        )
    removed = _checked_heads(heads, layout.num_heads)
    if len(removed) == layout.num_heads:
        raise ValueError(f"cannot prune every head: heads {sorted(removed)} are all {num_heads}")
    group = layout.group_size
    kv_removed = set()
    for kv_head in range(layout.num_kv_heads):
        members = set(range(kv_head * group, (kv_head + 1) * group))
        if members <= removed:
            kv_removed.add(kv_head)
        elif members & removed:
            raise ValueError(
                f"query heads {sorted(members)} share key/value head {kv_head} "
                f"(num_kv_heads={layout.num_kv_heads}): prune all of them or none; "
                f"got {sorted(members & removed)}"
            )
    dh = layout.head_dim
    keep_q = np.concatenate(
        [_head_columns(h, dh) for h in range(layout.num_heads) if h not in removed]
    )
    keep_kv = np.concatenate(
        [_head_columns(j, dh) for j in range(layout.num_kv_heads) if j not in kv_removed]
    )
    pruned = {
        "W_q": arrays["W_q"][:, keep_q],
        "W_k": arrays["W_k"][:, keep_kv],
        "W_v": arrays["W_v"][:, keep_kv],
        "W_o": arrays["W_o"][keep_q, :],
    }
    if config.bias:
        pruned |= {
            "b_q": arrays["b_q"][keep_q],
            "b_k": arrays["b_k"][keep_kv],
            "b_v": arrays["b_v"][keep_kv],
            "b_o": arrays["b_o"].copy(),
        }
    # A per-head norm's (head_dim,) weights serve every head that stays.
    pruned |= {name: norm.copy() for name, norm in norms.items()}
    if config.sinks:
        pruned["sinks"] = arrays["sinks"][[h for h in range(layout.num_heads) if h not in removed]]
    pruned_config = LayerConfig(
        num_hiddens=config.num_hiddens,
        num_heads=layout.num_heads - len(removed),
        num_kv_heads=layout.num_kv_heads - len(kv_removed),
        head_dim=dh,
        bias=config.bias,
        query_size=config.query_size,
        key_size=config.key_size,
        value_size=config.value_size,
        sinks=config.sinks,
    )
    return Pruned({name: np.ascontiguousarray(a) for name, a in pruned.items()}, pruned_config)


def _checked_heads(heads: Iterable[int], num_heads: int) -> set[int]:
    # (A string or a mapping iterates too, but holds no head indices.)
    if isinstance(heads, (str, bytes, Mapping)) or not isinstance(heads, Iterable):
        raise TypeError(f"heads must be an iterable of ints; got {type(heads).__name__}")
    indices = list(heads)
    for index in indices:
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)):
            raise TypeError(f"heads must be ints; got {index!r}")
        if not 0 <= index < num_heads:
            raise ValueError(f"head {index} is out of range for num_heads={num_heads}")
    if len(set(indices)) != len(indices):
        raise ValueError(f"heads must not repeat; got {indices}")
    return {int(index) for index in indices}


def importance(gradients: Sequence[np.ndarray], *, normalize: bool = True) -> np.ndarray:
    """Head importance from the gates' gradients of each batch (docs: "Heads").

    ``I_h = mean over batches of |dL/dξ_h|``, divided by its L2 norm over the
    heads when ``normalize`` (Michel, Levy & Neubig 2019); all zero stays zero,
    and a NaN makes every normalized importance NaN (the norm is NaN).
    """
    grads = np.stack([np.abs(np.asarray(g, np.float64)) for g in gradients])
    scores = grads.mean(axis=0)
    norm = float(np.linalg.norm(scores))
    # (NaN > 0 is false: a NaN norm divides too, as it does every score.)
    return scores / norm if normalize and not norm <= 0 else scores


def importance_over(
    batch_gradient: Callable[[Any], Any], batches: Iterable[Any], *, normalize: bool = True
) -> np.ndarray:
    """:func:`importance` of the gates' gradients of every batch: what each backend's
    ``head_importance`` computes, given how its framework takes one batch's gradient.

    Args:
        batch_gradient: one batch ``(queries, keys, values, valid_lens)`` ->
            ``dL/dξ`` at ``ξ = 1`` as numpy ``(num_heads,)``.
        batches: the batches.
        normalize: divide by the L2 norm over the heads.

    Raises:
        ValueError: ``batches`` yields nothing, or a batch of other than four items.
        TypeError: a batch that is no tuple or list.
    """
    gradients = [
        batch_gradient(_checked_batch(batch, index)) for index, batch in enumerate(batches)
    ]
    if not gradients:
        raise ValueError("batches yielded no batch: head importance needs at least one")
    return importance(gradients, normalize=normalize)


def _checked_batch(batch: Any, index: int) -> tuple[Any, Any, Any, Any]:
    expected = "each batch must be (queries, keys, values, valid_lens), valid_lens None for none"
    if not isinstance(batch, (tuple, list)):
        raise TypeError(f"{expected}; batch {index} is a {type(batch).__name__}")
    if len(batch) != 4:
        raise ValueError(f"{expected}; batch {index} has {len(batch)} items")
    return tuple(batch)  # type: ignore[return-value]


def check_loss(value: Any, is_tensor: Callable[[Any], bool]) -> bool:
    """Checks what a ``head_importance`` ``loss_fn`` returned: one number, as a tensor
    of the framework (``is_tensor``) or as a Python or numpy number.

    Every backend refuses the same losses with the same message; a number that
    is no tensor of the framework does not depend on the output, and its
    gradient is zero.

    Returns:
        Whether ``value`` is a tensor of the framework (else a number, of zero gradient).

    Raises:
        TypeError: ``value`` is neither (``None``, a string, a list, a bool).
        ValueError: it holds other than one number.
    """
    if is_tensor(value):
        shape = tuple(value.shape)
        if math.prod(shape) != 1:
            raise ValueError(f"loss_fn must return a scalar; got shape {shape}")
        return True
    if isinstance(value, (np.ndarray, np.generic)) and value.dtype.kind in "iuf":
        if value.size != 1:
            raise ValueError(f"loss_fn must return a scalar; got shape {value.shape}")
        return False
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return False
    raise TypeError(
        "loss_fn must return a scalar (a tensor of one element, or a number); "
        f"got {type(value).__name__}"
    )

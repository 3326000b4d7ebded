"""PyTorch's fused kernel, ``scaled_dot_product_attention``: what it takes, and its call.

:data:`SDPA` says what the kernel takes (dropout, a float bias, grouped
key/value heads from PyTorch 2.5 on); :func:`fused_attention` calls it on
the projected heads with the spec's masking semantics, fully hidden rows
included (docs: "Fast paths"). :class:`mha_multi.torch._facts.TorchFacts`
plans with :data:`SDPA` and calls :func:`fused_attention`; under
``torch.compile`` it runs behind a guard on the device
(:mod:`mha_multi.torch._guard`). This module imports nothing of the facts.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from mha_multi import spec
from mha_multi.torch._ops import SIXTEEN_BIT, accumulates_in_float32, autocast_off

__all__ = ["BIAS_LIMIT", "SDPA", "folded_mask", "folds_groups", "fused_attention"]

#: PyTorch's fused kernel: it applies dropout itself and adds ``-inf`` where
#: keys are hidden, so it runs only on values read as finite. Its
#: ``enable_gqa`` (PyTorch 2.5 and later) takes grouped key/value heads; a
#: float ``attn_mask`` is an additive bias.
SDPA = spec.FusedKernel(
    "scaled_dot_product_attention",
    takes_dropout=True,
    takes_bias=True,
    takes_grouped_heads=tuple(int(n) for n in re.findall(r"\d+", str(torch.__version__))[:2])
    >= (2, 5),
)


#: The largest ``|bias|`` the fused path takes
#: (:meth:`mha_multi.torch._facts.TorchFacts.plan_values`,
#: :meth:`mha_multi.torch._guard.GuardedKernel.guarded`).
BIAS_LIMIT = 1e5


def folds_groups(
    num_heads: int,
    num_kv_heads: int,
    num_queries: int,
    *,
    is_causal: bool,
    dropout_rate: float = 0.0,
) -> bool:
    """Whether SDPA takes one query's grouped heads as the queries of their key/value head.

    A call of one query (a decoding step) with grouped heads: its ``(B, H, 1, dh)``
    queries are ``(B, H_kv, G, dh)``, the ``G`` query heads of each key/value head
    its queries, since each attends over the same keys (head ``h`` reads key/value
    head ``h // G``, the spec's rule), so SDPA needs no ``enable_gqa``. On the CPU
    its attention over a cache of 400 positions took 136 against 244 us (8
    examples, 8 query heads of 64, 2 key/value heads; docs: "Fast paths"). Not
    with SDPA's causal flag (top-left, which would hide keys from all but the
    first of them) nor dropout, which draws its randomness by the kernel's rows.
    """
    return num_kv_heads != num_heads and num_queries == 1 and not is_causal and not dropout_rate


def folded_mask(
    mask: torch.Tensor | None, num_kv_heads: int, group_size: int
) -> torch.Tensor | None:
    """SDPA's ``attn_mask`` of one query's heads, ``(..., H, 1, K)``, as that of the
    queries :func:`folds_groups` makes of them, ``(..., H_kv, G, K)`` (a view); a mask
    the same for every head, as it is."""
    if mask is None or mask.dim() < 3 or mask.shape[-3] == 1:
        return mask
    return mask.view(*mask.shape[:-3], num_kv_heads, group_size, mask.shape[-1])


def fused_attention(
    ops: Any,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    valid_lens: torch.Tensor | None,
    plan: spec.KernelPlan,
    *,
    heads: spec.Heads,
    kv_split: bool,
    dropout_rate: float,
    options: spec.ScoreOptions = spec.NO_OPTIONS,
) -> torch.Tensor:
    """``scaled_dot_product_attention`` with the spec's masking semantics.

    The call's bias and ALiBi reach SDPA as a float ``attn_mask``
    (:func:`mha_multi.spec.score_bias`), ``-inf`` where the plan's mask
    hides a key; the window is in the boolean mask.

    Grouped key/value heads reach SDPA as they are, with ``enable_gqa``
    (query head ``h`` reads key/value head ``h // G``, the spec's rule);
    a PyTorch whose SDPA has no ``enable_gqa`` gets them repeated, once,
    on the projected heads (the plan's ``repeat_kv``), and so do float32
    heads on CUDA, whose kernels with ``enable_gqa`` hold every score
    (:meth:`mha_multi.torch._facts.TorchFacts.kernel_takes_grouped`). One
    query's grouped heads are the queries of their key/value head instead
    (:func:`folds_groups`).

    Args:
        q: projected queries ``(B, Q, num_heads * head_dim)``.
        k: projected keys ``(B, K, num_kv_heads * head_dim)``, or with
            ``kv_split`` ``(B, num_kv_heads, K, head_dim)``, SDPA's own
            layout (a cache's).
        v: projected values, as ``k``.
        plan: what :func:`mha_multi.call.plan` decided the kernel is given.

    Returns:
        The concatenated heads ``(B, Q, num_heads * head_dim)``.
    """
    num_queries, num_keys = q.shape[1], k.shape[-2]
    dtype = v.dtype
    if dtype in SIXTEEN_BIT and not accumulates_in_float32(q.device):
        # CPU kernels may sum 16-bit products in 16 bits: float32 copies,
        # one rounding at the end.
        q, k, v = q.float(), k.float(), v.float()
    # (B, T, H*dh) -> (B, H, T, dh): the spec's head layout, unflattened.
    # (view, not unflatten: a Python function around it; spelled out, not a generator.)
    q = q.view(*q.shape[:-1], heads.num_heads, heads.head_dim).transpose(1, 2)
    if not kv_split:
        kv_heads = (*k.shape[:-1], heads.num_kv_heads, heads.head_dim)
        k, v = k.view(kv_heads).transpose(1, 2), v.view(kv_heads).transpose(1, 2)
    if plan.repeat_kv:
        k, v = (x.repeat_interleave(heads.group_size, dim=1) for x in (k, v))
    grouped = heads.grouped and not plan.repeat_kv
    # (The plan's flags asked before its methods: a call that needs no mask, and fixes no
    # row, makes no function call for them.)
    mask = plan.mask(ops, num_queries, num_keys, valid_lens, options) if plan.needs_mask else None
    if plan.bias:
        bias = spec.score_bias(ops, options, num_queries, num_keys, q)
        if bias.dim() < 2:  # (SDPA's mask has a query and a key axis: (K,), (1,), () broadcast)
            bias = bias.reshape(1, -1)
        mask = bias if mask is None else torch.where(mask, bias, float("-inf"))
    folded = grouped and folds_groups(
        heads.num_heads,
        heads.num_kv_heads,
        num_queries,
        is_causal=plan.is_causal,
        dropout_rate=dropout_rate,
    )
    if folded:
        q, mask = (
            q.view(q.shape[0], heads.num_kv_heads, heads.group_size, -1),
            folded_mask(mask, heads.num_kv_heads, heads.group_size),
        )
    arguments = {"attn_mask": mask, "dropout_p": dropout_rate, "is_causal": plan.is_causal}
    if grouped and not folded:
        arguments["enable_gqa"] = True  # (only where needed: PyTorch before 2.5 has none)
    if torch.is_autocast_enabled(q.device.type):
        with autocast_off(q.device):
            output = torch.nn.functional.scaled_dot_product_attention(q, k, v, **arguments)
    else:
        output = torch.nn.functional.scaled_dot_product_attention(q, k, v, **arguments)
    if folded:
        output = output.reshape(output.shape[0], heads.num_heads, 1, heads.head_dim)
    if plan.fix_rows:
        visible = plan.fix_visibility(ops, num_queries, num_keys, valid_lens, options)
        output = spec.fix_fully_hidden_rows(
            ops, output, v, visible, heads_axis=1, group_size=heads.group_size if grouped else 1
        )
    output = output.transpose(1, 2).flatten(2)
    return output if output.dtype == dtype else output.to(dtype)

"""Parity cases: seeded inputs, canonical weights and the float64 reference.

A case is generated once (``write_cases``) and read by every environment from
``.npz`` files, so that backends on different numpy versions see the very
same bits.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mha_multi import spec
from mha_multi.parity.decode import full_reference
from mha_multi.weights import init_weights, save_weights

__all__ = [
    "CACHED_CASES",
    "HEAD_MASK_CASES",
    "OPTION_CASES",
    "CASES",
    "WEIGHTS_FILE",
    "Case",
    "CaseConfig",
    "build_case",
    "load_case",
    "load_cases",
    "write_cases",
]

INPUT_NAMES = ("queries", "keys", "values")


@dataclass(frozen=True)
class CaseConfig:
    """What a case is: sizes, flags and how its ``valid_lens`` look."""

    name: str
    num_hiddens: int = 16
    num_heads: int = 4
    #: Grouped key/value heads (``None``: ``num_heads``) and an explicit head size.
    num_kv_heads: int | None = None
    head_dim: int | None = None
    batch: int = 3
    num_queries: int = 5
    num_keys: int = 7
    query_size: int | None = None
    key_size: int | None = None
    value_size: int | None = None
    bias: bool = False
    causal: bool = False
    #: ``None``, or explicit lengths: a list (1-D) or a list of lists (2-D).
    valid_lens: Any = None
    lens_dtype: str = "int64"
    seed: int = 0
    description: str = ""
    #: A decoding schedule, ``[[T, [new lengths]], ...]``, for a cached case
    #: (docs: "Generating with a cache"): the sequences of ``num_queries``
    #: positions, of lengths ``valid_lens``, are fed to a cache of
    #: ``cache_length`` positions call by call, and the outputs must be those
    #: of one causal forward.
    chunks: Any = None
    cache_length: int | None = None
    #: ``None``, or the gates of the heads (docs: "Heads"): a list (``(H,)``)
    #: or a list of lists (``(B, H)``); the case checks their gradient too.
    head_mask: Any = None
    #: The layer's positions and biases options (docs: "Positions and
    #: biases"): ``rotary`` (a dict of :class:`~mha_multi.spec.Rotary`'s
    #: fields), ``alibi``, ``window``, ``softcap``, ``sinks``, ``qk_norm`` (a
    #: dict of :class:`~mha_multi.spec.QKNorm`'s fields); ``None`` for none.
    options: Any = None
    #: ``None``, or the call's ``positions``: a list of lists ``(B, Q)``.
    positions: Any = None
    #: ``None``, or the shape of a drawn ``bias`` (broadcastable to
    #: ``(B, H, Q, K)``); the case checks its gradient too.
    bias_shape: Any = None
    #: ``None``, or the call's ``segment_ids`` of packed sequences: ``(B, Q)``.
    segment_ids: Any = None

    @property
    def cached(self) -> bool:
        return self.chunks is not None

    def layer_options(self) -> dict[str, Any]:
        """The positions and biases options a layer is built with (none by default)."""
        return dict(self.options or {})

    def heads(self) -> dict[str, int]:
        """The head options a layer is built with: only those the case sets."""
        options = {"num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim}
        return {name: value for name, value in options.items() if value is not None}

    def sizes(self) -> dict[str, int]:
        return {
            "query_size": self.query_size or self.num_hiddens,
            "key_size": self.key_size or self.num_hiddens,
            "value_size": self.value_size or self.num_hiddens,
        }


def _causal(length: int) -> dict[str, Any]:
    """Causal self-attention's sizes: ``length`` queries over as many keys.

    With ``Q == K`` the spec's bottom-right causal rule is a kernel's own
    top-left one, and a cached case's sequences are its queries and keys.
    """
    return {"num_queries": length, "num_keys": length, "causal": True}


#: Grouped-query heads: 8 query heads read 2 key/value heads of size 4.
_GROUPED: dict[str, Any] = {"num_hiddens": 32, "num_heads": 8, "num_kv_heads": 2}
#: An explicit head size, 3, that 10 hiddens over 4 heads would not give
#: (``num_heads * head_dim != num_hiddens``), beside queries of their own size.
_HEAD_DIM_3: dict[str, Any] = {"num_hiddens": 10, "num_heads": 4, "head_dim": 3, "query_size": 6}

CASES: tuple[CaseConfig, ...] = (
    CaseConfig(
        "book",
        num_hiddens=100,
        num_heads=5,
        batch=2,
        num_queries=4,
        num_keys=6,
        valid_lens=[3, 2],
        description="d2l's example: 100 hiddens, 5 heads, valid_lens [3, 2]",
    ),
    CaseConfig("lens_none", description="no valid_lens"),
    CaseConfig("lens_1d", valid_lens=[4, 7, 1], description="1-D lengths"),
    CaseConfig(
        "lens_1d_float",
        valid_lens=[2.5, 6.0, 0.5],
        lens_dtype="float32",
        description="float32 lengths (MXNet style); the rule is j < len",
    ),
    CaseConfig(
        "lens_2d",
        valid_lens=[[1, 2, 3, 4, 5], [7, 0, 7, 3, 9], [2, 2, 2, 2, 2]],
        description="per-query lengths, with a zero and one longer than K",
    ),
    CaseConfig(
        "lens_zero",
        valid_lens=[0, -2, 3],
        description="lengths <= 0 hide every key: uniform weights",
    ),
    CaseConfig("lens_overlong", valid_lens=[7, 12, 1000], description="lengths >= K hide nothing"),
    CaseConfig("causal", **_causal(6), description="causal, Q == K"),
    CaseConfig(
        "causal_cross",
        num_queries=3,
        num_keys=7,
        causal=True,
        valid_lens=[6, 7, 2],
        description="causal bottom-right aligned (Q < K) AND 1-D lengths",
    ),
    CaseConfig(
        "causal_more_queries",
        num_queries=6,
        num_keys=3,
        causal=True,
        description="causal with Q > K: the first queries see nothing",
    ),
    CaseConfig(
        "causal_lens_2d",
        **_causal(5),
        valid_lens=[[5, 5, 5, 5, 5], [0, 1, 2, 3, 4], [3, 0, 5, 1, 2]],
        description="causal AND 2-D lengths",
    ),
    CaseConfig(
        "cross_sizes",
        num_hiddens=12,
        num_heads=3,
        query_size=7,
        key_size=5,
        value_size=3,
        bias=True,
        valid_lens=[5, 2, 6],
        description="cross attention with query/key/value sizes 7/5/3, bias",
    ),
    CaseConfig("bias", bias=True, valid_lens=[3, 5, 7], description="biases on"),
    CaseConfig("batch_1", batch=1, valid_lens=[4], description="batch of one"),
    CaseConfig("one_head", num_heads=1, valid_lens=[2, 5, 7], description="a single head"),
    CaseConfig("one_key", num_keys=1, valid_lens=[1, 0, 1], description="a single key"),
    CaseConfig(
        "gqa",
        **_GROUPED,
        bias=True,
        causal=True,
        valid_lens=[4, 7, 0],
        description="grouped-query: 8 query heads read 2 key/value heads; lengths, causal Q < K",
    ),
    CaseConfig(
        "mqa",
        num_kv_heads=1,
        **_causal(6),
        valid_lens=[[1, 6, 0, 3, 6, 2], [6, 6, 6, 6, 6, 6], [2, 2, 2, 5, 5, 5]],
        description="multi-query: one key/value head; per-query lengths, causal Q == K",
    ),
    CaseConfig(
        "head_dim",
        **_HEAD_DIM_3,
        num_kv_heads=2,
        bias=True,
        valid_lens=[3, 0, 7],
        description="explicit head_dim 3, num_hiddens 10 not divisible by 4 heads; grouped",
    ),
)

#: Cases gating the heads (docs: "Heads"), the gates' gradient included;
#: part of :data:`CASES`.
HEAD_MASK_CASES: tuple[CaseConfig, ...] = (
    CaseConfig(
        "head_mask",
        bias=True,
        valid_lens=[4, 7, 1],
        head_mask=[1.0, 0.0, 0.5, -2.0],
        description="one gate per head: one head off, one halved, one negated",
    ),
    CaseConfig(
        "head_mask_gqa",
        **_GROUPED,
        **_causal(5),
        head_mask=[
            [1.0, 1.0, 0.0, 0.0, 1.0, 0.25, 1.0, 1.0],
            [0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5],
            [0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.5],
        ],
        # Gates of unit scale keep the gradients of unit scale, which the
        # absolute tolerances assume (docs: "Architecture").
        description="(B, H) gates on grouped heads, causal",
    ),
)

CASES += HEAD_MASK_CASES

#: Positions and biases inside attention (docs: "Positions and biases").
OPTION_CASES: tuple[CaseConfig, ...] = (
    CaseConfig(
        "rotary",
        num_heads=2,
        num_kv_heads=1,
        **_causal(5),
        valid_lens=[5, 3, 4],
        positions=[[0, 1, 2, 3, 4], [7, 8, 9, 10, 11], [0, 0, 0, 1, 2]],
        options={
            "rotary": {
                "theta": 500.0,
                "fraction": 0.5,
                "scaling": {
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8,
                },
            }
        },
        description="partial rotary with Llama 3 scaling, ragged and left-padded positions",
    ),
    CaseConfig(
        "alibi",
        num_hiddens=12,
        num_heads=6,
        **_causal(5),
        valid_lens=[5, 2, 4],
        options={"alibi": True},
        description="ALiBi slopes of 6 heads (BLOOM's rule), self-attention, causal, ragged",
    ),
    CaseConfig(
        "score_bias",
        valid_lens=[6, 3, 0],
        bias_shape=[1, 4, 5, 7],
        description="an additive bias per head and position, its gradient; an empty example",
    ),
    CaseConfig(
        "window",
        causal=True,
        valid_lens=[[7, 7, 2, 7, 7], [4, 4, 4, 4, 4], [7, 7, 7, 7, 7]],
        options={"window": 2},
        description="a sliding window of 2 with causal and per-query lengths",
    ),
    CaseConfig(
        "softcap",
        valid_lens=[4, 7, 1],
        options={"softcap": 0.5},
        description="soft-capped scores (cap 0.5: most scores are capped)",
    ),
    CaseConfig(
        "qk_norm_heads",
        num_heads=2,
        num_kv_heads=1,
        **_causal(5),
        valid_lens=[5, 2, 4],
        options={
            "qk_norm": {"unit_offset": True, "product": "float32"},
            "rotary": {"theta": 100.0},
        },
        description="(1 + w) RMSNorm of each head's query and key, then rotary (Gemma 3), grouped",
    ),
    CaseConfig(
        "qk_norm_whole",
        bias=True,
        valid_lens=[4, 7, 1],
        options={"qk_norm": {"scope": "whole", "eps": 1e-5, "product": "float32"}},
        description="RMSNorm of the whole projected query and key (OLMo 2), biases",
    ),
    CaseConfig(
        "sinks",
        **_GROUPED,
        causal=True,
        valid_lens=[[7, 0, 3, 7, 2], [5, 5, 5, 5, 5], [0, 0, 0, 0, 0]],
        options={"sinks": True, "window": 4},
        description="a sink logit per head (gpt-oss), grouped heads, window, fully hidden rows",
    ),
)
CASES += OPTION_CASES

#: Cached cases: ragged batches decoded in chunks, against one causal forward.
CACHED_CASES: tuple[CaseConfig, ...] = (
    CaseConfig(
        "cached",
        **_causal(7),
        bias=True,
        valid_lens=[7, 3, 0],
        chunks=[[4, [4, 2, 0]], [1, [1, 1, 0]], [2, [2, 0, 0]]],
        cache_length=9,
        description="ragged prefill, a step, a chunk of 2; an empty example",
    ),
    CaseConfig(
        "cached_gqa",
        **_GROUPED,
        **_causal(6),
        valid_lens=[5, 6, 2],
        chunks=[[3, [3, 1, 2]], [1, [1, 1, 0]], [1, [1, 1, 0]], [3, [0, 3, 0]]],
        cache_length=6,
        description="grouped-query, cache filled to max_length, steps with idle examples",
    ),
    CaseConfig(
        "cached_mqa_head_dim",
        **_HEAD_DIM_3,
        num_kv_heads=1,
        **_causal(6),
        valid_lens=[4, 1, 6],
        chunks=[[6, [0, 0, 6]], [1, [1, 1, 0]], [1, [1, 0, 0]], [2, [2, 0, 0]]],
        cache_length=8,
        description="multi-query, head_dim 3; one example prefilled, the others stepped",
    ),
    CaseConfig(
        "cached_rotary_window",
        num_heads=4,
        num_kv_heads=2,
        **_causal(7),
        valid_lens=[7, 5, 3],
        chunks=[[3, [3, 3, 2]], [1, [1, 1, 1]], [3, [3, 1, 0]]],
        cache_length=8,
        options={"rotary": {"theta": 100.0}, "window": 3},
        description="rotary at each example's cache positions and a window of 3, in chunks",
    ),
    CaseConfig(
        "cached_qk_norm",
        num_heads=4,
        num_kv_heads=2,
        **_causal(6),
        valid_lens=[6, 4, 1],
        chunks=[[3, [3, 3, 1]], [1, [1, 1, 0]], [2, [2, 0, 0]]],
        cache_length=7,
        options={"qk_norm": {"eps": 1e-6}, "rotary": {"theta": 100.0}},
        description="per-head norms (Qwen 3) of the keys before they enter the cache",
    ),
    CaseConfig(
        "cached_sinks",
        options={"sinks": True},
        **_causal(6),
        chunks=[[3, [3, 2, 0]], [1, [1, 1, 0]], [2, [2, 0, 0]]],
        valid_lens=[6, 3, 0],
        num_kv_heads=2,
        cache_length=7,
        description="sink logits (gpt-oss) in chunks, grouped heads; an empty example",
    ),
)


@dataclass
class Case:
    """A parity case: configuration, inputs, weights and reference results."""

    config: CaseConfig
    weights: dict[str, np.ndarray]
    inputs: dict[str, np.ndarray]
    valid_lens: np.ndarray | None
    output_gradient: np.ndarray
    reference: dict[str, np.ndarray] = field(default_factory=dict)
    #: The call's ``bias`` (``config.bias_shape``), float32, or ``None``.
    bias: np.ndarray | None = None

    @property
    def positions(self) -> np.ndarray | None:
        """The call's ``positions`` as int64, or ``None``."""
        positions = self.config.positions
        return None if positions is None else np.asarray(positions, np.int64)

    @property
    def segment_ids(self) -> np.ndarray | None:
        """The call's ``segment_ids`` as int32, or ``None``."""
        ids = self.config.segment_ids
        return None if ids is None else np.asarray(ids, np.int32)

    @property
    def name(self) -> str:
        return self.config.name


def build_case(config: CaseConfig) -> Case:
    """Draws the case's inputs and weights and evaluates the float64 reference.

    Inputs and weights are float32 values (so every dtype up from float32
    sees the same numbers); the reference uses them in float64.
    """
    rng = np.random.default_rng(config.seed)
    sizes = config.sizes()
    sinks = bool(config.layer_options().get("sinks", False))
    weights = init_weights(
        config.num_hiddens,
        bias=config.bias,
        seed=config.seed + 1,
        num_heads=config.num_heads,
        sinks=sinks,
        **config.heads(),
        **sizes,
    )
    shapes = {
        "queries": (config.batch, config.num_queries, sizes["query_size"]),
        "keys": (config.batch, config.num_keys, sizes["key_size"]),
        "values": (config.batch, config.num_keys, sizes["value_size"]),
    }
    inputs = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}
    # The cotangent of a loss averaged over the batch and the queries: weight
    # gradients then stay of unit scale whatever B and Q, as the tolerances
    # assume (docs: "Architecture").
    output_gradient = (
        rng.standard_normal((config.batch, config.num_queries, config.num_hiddens))
        / np.sqrt(config.batch * config.num_queries)
    ).astype(np.float32)
    valid_lens = (
        None if config.valid_lens is None else np.asarray(config.valid_lens, config.lens_dtype)
    )
    bias = None
    if config.bias_shape is not None:
        bias = rng.standard_normal(config.bias_shape).astype(np.float32)
    weights.update(_norm_weights(config))
    if sinks:  # logits that matter (they start at zero), drawn last: other cases keep theirs
        weights["sinks"] = rng.standard_normal(config.num_heads).astype(np.float32)
    case = Case(config, weights, inputs, valid_lens, output_gradient, bias=bias)
    case.reference = reference_results(case)
    return case


def _norm_weights(config: CaseConfig) -> dict[str, np.ndarray]:
    """The ``q_norm`` and ``k_norm`` of a case with ``qk_norm`` (none without): their
    initial value plus noise of scale 0.5, from a stream of their own."""
    qk_norm = spec.check_qk_norm(config.layer_options().get("qk_norm"))
    if qk_norm is None:
        return {}
    rng = np.random.default_rng(config.seed + 2)
    heads = spec.check_heads(config.num_hiddens, config.num_heads, **config.heads())
    return {
        name: (qk_norm.initial_value + 0.5 * rng.standard_normal(shape)).astype(np.float32)
        for name, shape in qk_norm.shapes(heads).items()
    }


def reference_results(case: Case) -> dict[str, np.ndarray]:
    """Output, attention weights and gradients of the float64 spec.

    A cached case's reference is the output of one causal forward at the
    real positions (0 past them), which every schedule must give.
    """
    if case.config.cached:
        output = full_reference(
            case.weights,
            case.inputs,
            case.valid_lens,
            num_heads=case.config.num_heads,
            num_kv_heads=case.config.num_kv_heads,
            **case.config.layer_options(),
        )
        return {"output": output}
    args = (case.weights, case.inputs["queries"], case.inputs["keys"], case.inputs["values"])
    kwargs = {
        "num_heads": case.config.num_heads,
        "num_kv_heads": case.config.num_kv_heads,
        "causal": case.config.causal,
        "positions": case.positions,
        "bias": case.bias,
        "segment_ids": case.segment_ids,
        **case.config.layer_options(),
    }
    if case.config.head_mask is not None:
        kwargs["head_mask"] = np.asarray(case.config.head_mask, np.float32)
    output, attention_weights = spec.reference_forward(*args, case.valid_lens, **kwargs)
    grads = spec.reference_gradients(
        *args, case.valid_lens, output_gradient=case.output_gradient, **kwargs
    )
    results = {"output": output, "attention_weights": attention_weights}
    results.update({f"grad.{name}": value for name, value in grads.items()})
    return results


def _flatten(case: Case) -> dict[str, np.ndarray]:
    arrays = {"config": np.array(json.dumps(dataclasses.asdict(case.config)))}
    arrays.update({f"weight.{k}": v for k, v in case.weights.items()})
    arrays.update({f"input.{k}": v for k, v in case.inputs.items()})
    if case.valid_lens is not None:
        arrays["valid_lens"] = case.valid_lens
    arrays["output_gradient"] = case.output_gradient
    if case.bias is not None:
        arrays["bias"] = case.bias
    arrays.update({f"reference.{k}": v for k, v in case.reference.items()})
    return arrays


def _unflatten(arrays: Mapping[str, np.ndarray]) -> Case:
    config = CaseConfig(**json.loads(str(arrays["config"])))

    def group(prefix: str) -> dict[str, np.ndarray]:
        return {k[len(prefix) :]: np.asarray(v) for k, v in arrays.items() if k.startswith(prefix)}

    return Case(
        config=config,
        weights=group("weight."),
        inputs=group("input."),
        valid_lens=arrays.get("valid_lens"),
        output_gradient=np.asarray(arrays["output_gradient"]),
        reference=group("reference."),
        bias=None if "bias" not in arrays else np.asarray(arrays["bias"]),
    )


def write_cases(
    directory: str | os.PathLike[str], configs: Iterable[CaseConfig] = CASES + CACHED_CASES
) -> list[Path]:
    """Builds every case and writes it to ``directory/<name>.npz``.

    The book example's weights also go to ``directory/book.safetensors``.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for config in configs:
        case = build_case(config)
        path = directory / f"{config.name}.npz"
        with open(path, "wb") as file:
            np.savez(file, **_flatten(case))
        paths.append(path)
        if config.name == "book":
            save_weights(directory / WEIGHTS_FILE, case.weights)
    return paths


#: The file of the user's workflow check: one ``.safetensors`` file of the
#: book example's weights, loaded into every backend.
WEIGHTS_FILE = "book.safetensors"


def load_case(path: str | os.PathLike[str]) -> Case:
    """Reads a case written by :func:`write_cases` (no pickle)."""
    with np.load(path, allow_pickle=False) as file:
        return _unflatten({name: file[name] for name in file.files})


def load_cases(directory: str | os.PathLike[str]) -> list[Case]:
    """Reads every case of ``directory``, in the order of :data:`CASES` and :data:`CACHED_CASES`
    (others, such as the packed cases, after them by name)."""
    order = {config.name: i for i, config in enumerate(CASES + CACHED_CASES)}
    paths = sorted(Path(directory).glob("*.npz"), key=lambda p: (order.get(p.stem, 1 << 30), p))
    if not paths:
        raise FileNotFoundError(f"no parity cases in {os.fspath(directory)!r}")
    return [load_case(path) for path in paths]

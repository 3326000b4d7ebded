"""What several MXNet test files build: the imperative and hybridized
runners, grouped layers of one layout with their canonical weights, and a
layer's exported graph loaded back."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import numpy as np
from mxnet import gluon

from mha_multi.parity.runners import Runner, get_runner
from mha_multi.weights import init_weights

IMPERATIVE = get_runner("mxnet")
HYBRID = get_runner("mxnet-hybrid")

QUERY_SIZE, NUM_HIDDENS, NUM_HEADS = 5, 16, 4
#: Key/value heads: multi-head, grouped and multi-query attention.
KV_HEADS = {"mha": 4, "gqa": 2, "mqa": 1}


def layout_weights(kind: str, seed: int = 0) -> dict[str, np.ndarray]:
    """Canonical weights, with biases, of the layout with ``KV_HEADS[kind]`` key/value heads."""
    return init_weights(
        NUM_HIDDENS,
        num_heads=NUM_HEADS,
        num_kv_heads=KV_HEADS[kind],
        bias=True,
        query_size=QUERY_SIZE,
        seed=seed,
    )


def layer_of(
    runner: Runner, kind: str, weights: dict[str, np.ndarray], dtype: str = "float32", **kwargs: Any
) -> Any:
    """The runner's layer of the layout, holding ``weights``."""
    layer = runner.make_layer(
        NUM_HIDDENS, NUM_HEADS, num_kv_heads=KV_HEADS[kind], bias=True, dtype=dtype, **kwargs
    )
    return runner.set_weights(layer, weights)


def layout_inputs(
    seed: int, batch: int, num_queries: int, num_keys: int, dtype: Any = np.float64
) -> dict[str, np.ndarray]:
    """Standard normal queries, keys and values of the layout's sizes, drawn from ``seed``."""
    rng = np.random.default_rng(seed)
    inputs = {
        "queries": rng.standard_normal((batch, num_queries, QUERY_SIZE)),
        "keys": rng.standard_normal((batch, num_keys, NUM_HIDDENS)),
        "values": rng.standard_normal((batch, num_keys, NUM_HIDDENS)),
    }
    return {name: x.astype(dtype) for name, x in inputs.items()}


def reference_heads(kind: str) -> dict[str, int]:
    """The layout's heads, as the float64 reference's keyword arguments."""
    return {"num_heads": NUM_HEADS, "num_kv_heads": KV_HEADS[kind]}


def exported(layer: Any, path: Path) -> tuple[Any, set[str]]:
    """The graph of ``layer``'s last (appending) call as a ``SymbolBlock``, and its operators."""
    prefix = str(path / "cached")
    layer.export(prefix)
    with open(f"{prefix}-symbol.json") as file:
        operators = {node["op"] for node in json.load(file)["nodes"]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # SymbolBlock guesses the inputs' types
        block = gluon.SymbolBlock.imports(
            f"{prefix}-symbol.json",
            [f"data{i}" for i in range(7)],  # queries ... valid_lens, the cache's three
            f"{prefix}-0000.params",
        )
    return block, operators

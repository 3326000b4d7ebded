"""``MultiHeadAttention`` as a Flax Linen module, called like d2l's JAX version.

Parameters live under ``params/W_q/kernel``, ``params/W_q/bias``... as in
d2l (whose projections are ``nn.Dense`` modules of those names), in the
canonical ``x @ W + b`` orientation. Input sizes are inferred from the inputs
at ``init``. A call is :func:`mha_multi.call.forward` with JAX's facts and
the parameters' projections, as for the NNX module and
:func:`~mha_multi.jax.functional.multi_head_attention`, so all give
bit-identical outputs for the same weights.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from jax.typing import DTypeLike

from mha_multi import _docs, call, spec
from mha_multi.jax import functional
from mha_multi.jax._facts import JaxFacts, check_held_dtype, host_array, weight_array
from mha_multi.jax._kernel import check_implementation
from mha_multi.jax._ops import PrecisionLike
from mha_multi.jax._projections import Projection, WeightsProjections
from mha_multi.jax.sharding import partition_specs, shard_variables
from mha_multi.weights import KERNEL_NAMES, NORM_NAMES, SINKS_NAME, check_weights

__all__ = [
    "MultiHeadAttention",
    "partition_specs",
    "shard_variables",
    "variables_from_weights",
    "weights_from_variables",
]

Initializer = Any


@_docs.fill
class MultiHeadAttention(nn.Module):
    """d2l's multi-head attention, exact to the spec of :mod:`mha_multi.spec`.

    For incremental decoding, :meth:`init_cache` (which needs no variables:
    it works on an unbound module) makes a key/value cache that a call takes
    and returns (``cache=``; docs: "Generating with a cache"). The cache is
    an argument and a result, not a Flax collection, so ``jax.jit`` of
    ``apply`` compiles a decoding step once for each number of new positions.

    Attributes:
        num_hiddens: size of every projection and of the output.
        {num_heads_arg}
        dropout: dropout rate on the attention weights (``training=True``
            only; needs a ``'dropout'`` rng).
        bias: whether the four projections have biases.
        query_size: last dimension of the queries; ``None`` infers it at init.
        key_size: last dimension of the keys; ``None`` infers it at init.
        value_size: last dimension of the values; ``None`` infers it at init.
        num_kv_heads: key/value heads, shared by groups of query heads
            (grouped-query attention; ``None``: ``num_heads``).
        head_dim: the size of each head (``None``: ``num_hiddens // num_heads``).
        {options_args}
        {flax_compute_args}
        head_parallel: compute each key/value head's group apart on the
            generic path (the same numbers), so that variables placed by
            :func:`~mha_multi.jax.sharding.shard_variables` are computed
            head by head on their devices; a few percent slower on one
            device (docs: "Sharding heads").
        kernel_init: initializer of the kernels (``nn.Dense``'s ``lecun_normal``).
        bias_init: initializer of the biases (zeros).
    """

    num_hiddens: int
    num_heads: int
    dropout: float = 0.0
    bias: bool = False
    query_size: int | None = None
    key_size: int | None = None
    value_size: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    rotary: spec.Rotary | Mapping[str, Any] | None = None
    alibi: bool = False
    window: int | None = None
    softcap: float | None = None
    qk_norm: spec.QKNorm | Mapping[str, Any] | None = None
    sinks: bool = False
    dtype: DTypeLike | None = None
    param_dtype: DTypeLike = jnp.float32
    precision: PrecisionLike = None
    implementation: str | None = None
    head_parallel: bool = False
    kernel_init: Initializer = nn.initializers.lecun_normal()
    bias_init: Initializer = nn.initializers.zeros_init()

    def __post_init__(self) -> None:
        # Configuration errors surface at construction, as in the other backends.
        spec.check_config(
            self.num_hiddens,
            self.num_heads,
            self.dropout,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
        )
        spec.check_input_sizes(
            query_size=self.query_size, key_size=self.key_size, value_size=self.value_size
        )
        check_implementation(self.implementation)
        spec.check_flag("bias", self.bias)
        check_held_dtype("dtype", self.dtype)
        check_held_dtype("param_dtype", self.param_dtype)
        _layer_options(self)  # (a function: Flax wraps a method, which needs a scope)
        super().__post_init__()

    @property
    def heads(self) -> spec.Heads:
        """The head layout (docs: "The spec")."""
        return spec.check_heads(
            self.num_hiddens, self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim
        )

    def init_cache(
        self, batch_size: int, max_length: int, dtype: DTypeLike | None = None
    ) -> spec.KVCache:
        """An empty key/value cache for incremental decoding (docs: "Generating with a cache").

        Needs only the configuration, so it works on an unbound module.

        Args:
            batch_size: ``B``, the examples decoded together.
            max_length: the positions each example can hold.
            dtype: the dtype of the keys and values; ``None`` for the
                module's: its ``dtype``, else its ``param_dtype`` (a cached
                call writes its projections in its computation dtype, which
                must be the cache's).

        Returns:
            ``KVCache(keys, values, lengths)``: zero keys and values
            ``(B, num_kv_heads, max_length, head_dim)`` and zero lengths
            ``(B,)`` int32, on JAX's default device (the module holds no
            arrays; ``jax.default_device`` chooses another).

        Raises:
            TypeError: ``batch_size`` or ``max_length`` not an int, or
                ``dtype`` not floating.
            ValueError: ``batch_size`` or ``max_length`` negative, or
                ``dtype`` float64 without JAX's x64.
        """
        if dtype is None:
            dtype = self.param_dtype if self.dtype is None else self.dtype
        return functional.init_cache(self.heads, batch_size, max_length, dtype)

    def layer_options(self) -> spec.LayerOptions:
        """The checked positions and biases options (docs: "Positions and biases")."""
        return _layer_options(self)

    def _known_sizes(self) -> dict[str, int | None]:
        """Input sizes from the attributes, else from existing kernels, else ``None``."""
        params = nn.meta.unbox(self.variables.get("params", {}))
        sizes = {}
        for size_name, name in (("query_size", "W_q"), ("key_size", "W_k"), ("value_size", "W_v")):
            size = getattr(self, size_name)
            kernel = params.get(name, {}).get("kernel")
            if size is None and kernel is not None:
                size = int(kernel.shape[0])
            sizes[size_name] = size
        return sizes

    @nn.compact
    def __call__(
        self,
        queries: jax.Array,
        keys: jax.Array | None,
        values: jax.Array | None,
        valid_lens: Any = None,
        *,
        causal: bool = False,
        return_attention_weights: bool = False,
        training: bool = False,
        cache: spec.KVCache | None = None,
        head_mask: Any = None,
        positions: Any = None,
        bias: Any = None,
        segment_ids: Any = None,
    ) -> jax.Array | tuple[jax.Array, ...]:
        """Attends from ``queries`` to ``keys``/``values`` (and, with a ``cache``, to it).

        The NNX module's call (:meth:`mha_multi.jax.MultiHeadAttention.__call__`):
        the same arguments, results and errors, with ``training`` in place of
        its ``deterministic`` and ``rngs``, and ``jax.jit`` of ``apply`` for
        its ``nnx.jit``.

        Args:
            keys: as the NNX call's; ``None`` (with a cache) needs the module's
                key and value sizes known: given, or from its variables.
            training: apply dropout (draws from the ``'dropout'`` rng).
        """
        # (A string would be truthy: "False" would turn dropout on.)
        use_dropout = spec.check_flag("training", training) and self.dropout > 0
        result = call.forward(
            JaxFacts(self.precision, self.implementation),
            _ModuleProjections(self),
            queries,
            keys,
            values,
            valid_lens,
            causal=causal,
            return_attention_weights=return_attention_weights,
            cache=cache,
            head_mask=head_mask,
            positions=positions,
            bias=bias,
            segment_ids=segment_ids,
            layer_options=_layer_options(self),
            dropout=functional.flax_dropout(
                (lambda: self.make_rng("dropout")) if use_dropout else None, self.dropout
            ),
            dropout_rate=self.dropout,
            head_parallel=self.head_parallel,
            run=functional.attend_compiled,
        )
        return result.returned(return_attention_weights)

    def _make_params(self, sizes: Mapping[str, int]) -> dict[str, jax.Array]:
        """The canonical weights, made on ``init`` for inputs of ``sizes``."""
        heads = self.heads
        # (in_features, out_features) of each projection.
        shapes = {
            "q": (sizes["query_size"], heads.query_features),
            "k": (sizes["key_size"], heads.kv_features),
            "v": (sizes["value_size"], heads.kv_features),
            "o": (heads.query_features, self.num_hiddens),
        }
        params = {}
        for name, (size, features) in shapes.items():
            kernel, bias = Projection(
                features,
                self.bias,
                self.param_dtype,
                self.kernel_init,
                self.bias_init,
                name=f"W_{name}",
            )(size)
            params[f"W_{name}"] = kernel
            if bias is not None:
                params[f"b_{name}"] = bias
        norm = _layer_options(self).qk_norm
        if norm is not None:
            for name, shape in norm.shapes(heads).items():
                initial = nn.initializers.constant(norm.initial_value)
                params[name] = self.param(name, initial, shape, self.param_dtype)
        if self.sinks:  # each head's sink logit, zeros at first
            params[SINKS_NAME] = self.param(
                SINKS_NAME, nn.initializers.zeros_init(), (heads.num_heads,), self.param_dtype
            )
        return params


class _ModuleProjections(WeightsProjections):
    """A Linen module's projections: its parameters, made where the checked inputs size them."""

    def __init__(self, module: MultiHeadAttention) -> None:
        super().__init__(
            None,
            module.heads,
            module._known_sizes(),
            dtype=module.dtype,
            precision=module.precision,
        )
        self.module = module

    def weights_for(
        self, queries: jax.Array, keys: jax.Array | None, values: jax.Array | None
    ) -> dict[str, jax.Array]:
        sizes = {**self.sizes, "query_size": queries.shape[-1]}
        if keys is not None:
            sizes["key_size"], sizes["value_size"] = keys.shape[-1], values.shape[-1]
        elif sizes["key_size"] is None or sizes["value_size"] is None:
            raise ValueError(
                "a call without keys and values cannot make W_k and W_v: initialise the "
                "module with keys and values, or give it key_size and value_size"
            )
        params = self.module._make_params(sizes)
        # The variables are the caller's (apply's argument): their dtypes are checked, and
        # none may be left unused (Flax takes any: another module's sinks, norms or biases
        # would be ignored).
        norm = self.module.layer_options().qk_norm
        functional.check_params(
            params, qk_norm=False if norm is None else norm.scope, sinks=self.module.sinks
        )
        _check_unused(self.module)
        return params


def _check_unused(module: MultiHeadAttention) -> None:
    """Refuses parameters the module holds but does not use.

    Raises:
        ValueError: naming them and the options that do not use them.
    """
    held = module.variables.get("params", {})
    bias = {"kernel", "bias"} if module.bias else {"kernel"}
    used: dict[str, set[str] | None] = {name: bias for name in KERNEL_NAMES}
    if module.layer_options().qk_norm is not None:
        used.update(dict.fromkeys(NORM_NAMES))
    if module.sinks:
        used[SINKS_NAME] = None
    unused = sorted(set(held) - set(used))
    for name, names in used.items():
        if names is not None and name in held:
            unused += [f"{name}/{inner}" for inner in sorted(set(held[name]) - names)]
    if unused:
        raise ValueError(
            f"the module's params hold {', '.join(unused)}, which it does not use "
            f"(bias={module.bias}, qk_norm={module.layer_options().qk_norm}, "
            f"sinks={module.sinks}): "
            "variables of another module?"
        )


def variables_from_weights(
    weights: Mapping[str, Any],
    module: MultiHeadAttention | None = None,
    *,
    dtype: DTypeLike | None = None,
) -> dict[str, Any]:
    """Canonical weights as Linen variables ``{'params': {'W_q': {'kernel': ...}}}``.

    Args:
        weights: the canonical mapping (validated strictly).
        module: if given, the weights must match its ``num_hiddens``,
            ``bias``, head layout and the input sizes it fixes, and are converted to its
            ``param_dtype``.
        dtype: the dtype of the variables; overrides ``module.param_dtype``.
            Without either, each array keeps its dtype.

    Returns:
        The variables, as JAX arrays, for ``module.apply``.

    Raises:
        ValueError: a missing, extra or mis-shaped entry, named; float64
            variables without JAX's x64 (which would hold them as float32).
        TypeError: a non-floating entry.
    """
    config: dict[str, Any] = {}
    if module is not None:
        config = {
            "num_hiddens": module.num_hiddens,
            "bias": module.bias,
            "query_size": module.query_size,
            "key_size": module.key_size,
            "value_size": module.value_size,
            "num_heads": module.num_heads,
            "num_kv_heads": module.num_kv_heads,
            "head_dim": module.heads.head_dim,
            "sinks": module.sinks,
        }
        norm = module.layer_options().qk_norm
        config["qk_norm"] = False if norm is None else norm.scope
        if dtype is None:
            dtype = module.param_dtype
    arrays, _ = check_weights(weights, **{"qk_norm": None, "sinks": None, **config})
    params: dict[str, Any] = {}
    for name, array in arrays.items():
        if dtype is not None:
            array = np.asarray(array).astype(np.dtype(dtype))
        if name in NORM_NAMES or name == SINKS_NAME:  # a parameter of the module itself
            params[name] = weight_array(array)
            continue
        entry = "kernel" if name in KERNEL_NAMES else "bias"
        params.setdefault(f"W_{name[-1]}", {})[entry] = weight_array(array)
    return {"params": params}


def weights_from_variables(variables: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """The canonical weights in Linen variables, as numpy arrays.

    Args:
        variables: ``{'params': {...}}`` as returned by ``init``, or the
            ``params`` collection itself.

    Returns:
        The canonical mapping (validated). bfloat16 parameters are returned
        as float32; every other dtype is kept.

    Raises:
        ValueError: a missing or extra parameter, named.
    """
    params = nn.meta.unbox(variables.get("params", variables))
    extra = sorted(map(str, set(params) - {*KERNEL_NAMES, *NORM_NAMES, SINKS_NAME}))
    if extra:
        raise ValueError(f"unexpected entries in the layer's Linen params: {extra}")
    weights = {}
    for name in KERNEL_NAMES:
        projection = params.get(name, {})
        extra = sorted(map(str, set(projection) - {"kernel", "bias"}))
        if extra:
            raise ValueError(f"unexpected entries in the Linen params' {name}: {extra}")
        for entry, canonical in (("kernel", name), ("bias", f"b_{name[-1]}")):
            if entry in projection:
                weights[canonical] = host_array(projection[entry])
    weights.update({name: host_array(params[name]) for name in NORM_NAMES if name in params})
    if SINKS_NAME in params:
        weights[SINKS_NAME] = host_array(params[SINKS_NAME])
    return check_weights(weights, qk_norm=None, sinks=None)[0]


def _layer_options(module: MultiHeadAttention) -> spec.LayerOptions:
    """:meth:`MultiHeadAttention.layer_options`, as a function: the module's checks call it
    before it is set up, where Flax fails a method it wraps (``tabulate``'s), and a
    call's, where ``tabulate`` records a method's result as arrays."""
    options = spec.LayerOptions(
        module.rotary,
        module.alibi,
        module.window,
        module.softcap,
        module.sinks,
        qk_norm=module.qk_norm,
    )
    return options.check(module.heads.head_dim)

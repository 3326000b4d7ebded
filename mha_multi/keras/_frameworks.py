"""What differs between the frameworks under Keras: one class each, and the process's devices.

Keras calls TensorFlow, JAX and PyTorch its backends; each has a class here
(:func:`active` makes the process's). The layer's facts
(:mod:`mha_multi.keras._facts`) ask it for devices, GPU detection, the
settings for exact float32 products, whether values can be read now, and
how a cache's rows are written (a new array, or in place on PyTorch without
gradients). The fastest way to each array operation is each framework's own,
in :mod:`mha_multi.keras._framework_ops`. Only the active backend's class is
created, so only that framework is ever imported.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import keras
import numpy as np

from mha_multi import spec
from mha_multi.call.contract import all_arrays_of, array_signature
from mha_multi.keras._first_use import made_on_first_use
from mha_multi.keras._framework_ops import framework_ops
from mha_multi.spec.memo import Kept

#: The Keras backend of this process: ``"tensorflow"``, ``"jax"`` or ``"torch"``.
BACKEND: str = keras.backend.backend()

Tensor = Any


# -- what differs per Keras backend --------------------------------------------------


class _Framework:
    """What the framework under one Keras backend does its own way."""

    def gpu_available(self) -> bool:
        raise NotImplementedError

    def gpu_name(self) -> str:
        raise NotImplementedError

    def device_of(self, x: Tensor) -> str:
        raise NotImplementedError

    def exact_float32(self) -> None:
        raise NotImplementedError

    def enable_float64(self) -> None:
        """Nothing to enable where float64 arrays are always available."""

    def values_readable(self, x: Tensor) -> bool:
        raise NotImplementedError

    def records_gradient(self, x: Tensor) -> bool:
        """Whether a gradient is recorded through ``x``: ``True`` where the array
        cannot tell (TensorFlow's tapes and JAX's traces record outside it)."""
        return True

    #: The fused kernel's call of ``(B, T, H, dh)`` arrays
    #: (:func:`mha_multi.keras._kernel.dot_product_attention`): Keras' own, but where a
    #: framework calls its kernel itself.
    dot_product_attention = staticmethod(keras.ops.dot_product_attention)

    def scalar_gradient(self, function: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
        """The gradient of the scalar ``function(x)`` with respect to ``x``, eagerly."""
        raise NotImplementedError

    def values_within(self, q: Tensor, k: Tensor, v: Tensor, bound: float) -> Tensor:
        """A boolean scalar: every element of ``q``, ``k``, ``v`` finite, and
        ``max|q| * max|k| < bound`` (what the fused kernel needs; see
        :func:`mha_multi.keras._facts.values_exact`)."""
        ops = keras.ops
        finite = [ops.all(ops.isfinite(x)) for x in (q, k, v)]
        largest_q, largest_k = (
            ops.max(ops.abs(ops.cast(x, "float32")), initial=0.0) for x in (q, k)
        )
        return ops.all(ops.stack([*finite, ops.less(largest_q * largest_k, bound)]))

    def all_finite(self, x: Tensor) -> Tensor:
        """A boolean scalar: whether ``x``'s float32 sum is finite, which it is only
        where every element is (or, at worst, a large sum overflows)."""
        return keras.ops.isfinite(keras.ops.sum(keras.ops.cast(x, "float32")))

    def sync(self, value: Any) -> None:
        # Reading one element waits for the operation that produced the array.
        for leaf in keras.tree.flatten(value):
            if leaf is not None:
                keras.ops.convert_to_numpy(keras.ops.reshape(leaf, (-1,))[:1])

    def span_bucket(self, keys: Tensor) -> int:
        """What an eager cached call's attended span is a multiple of (see
        :meth:`KerasFacts.span_bucket_of`): the spec's bucket, where eager kernels
        keep something for each new shape.

        TensorFlow on the CPU keeps memory for every new shape its eager
        kernels meet: a generation of 256 steps, each attending one more
        position, grew the process by 181 MiB with spans of every length and
        by 22 MiB (a 16 MiB cache) with spans rounded up to 64, at the same
        speed (docs: "Results"). Eager JAX compiles each operation for each
        new shape.
        """
        return spec.SPAN_BUCKET

    def cache_lengths(self, lengths: Tensor) -> Tensor:
        """A cache's ``lengths`` as the spec's arithmetic takes them: as they are."""
        return lengths

    def write_rows(self, held: Tensor, rows: Tensor, first: int, *, in_place: bool) -> Tensor:
        """``held`` ``(B, H_kv, M, dh)`` with ``rows`` ``(B, H_kv, T, dh)`` at ``first``.

        A new array (``keras.ops.slice_update``), or with ``in_place`` (where
        :meth:`writes_in_place`) ``held`` itself, written.
        """
        return framework_ops().slice_update(held, (0, 0, first, 0), rows)

    def writes_in_place(self, *arrays: Tensor) -> bool:
        """Whether an eager call may write a cache of these arrays in place."""
        return False

    def write_in_place(
        self, ops: Any, cache: spec.KVCache, k: Tensor, v: Tensor, valid_lens: Any, **sizes: Any
    ) -> tuple[spec.KVCache, Tensor] | None:
        """:func:`mha_multi.spec.update_cache` written into the cache's own arrays, for
        any lengths (an eager call's, where :meth:`writes_in_place`); ``None`` where
        this backend writes no array in place (TensorFlow's and JAX's cannot be).
        ``sizes``: ``head_dim`` and ``causal``."""
        return None

    #: How a traced call writes a cache's new rows, where not as the spec's gather:
    #: ``traced_write(ops, cache, k, v, valid_lens, head_dim=, causal=)`` returns what
    #: :func:`mha_multi.spec.update_cache` returns, or ``None`` for a call it leaves
    #: to the rest of the write (an eager one); ``None`` on TensorFlow.
    traced_write: Callable[..., tuple[spec.KVCache, Tensor] | None] | None = None

    def version(self, x: Tensor) -> Hashable | None:
        """What changes when ``x`` is written in place or given other storage, or ``None``
        where nothing would tell. TensorFlow's and JAX's arrays cannot be written:
        always 0."""
        return 0

    def kernel_takes_grouped(self, q: Tensor, num_queries: Any, head_dim: int) -> bool:
        """:meth:`mha_multi.call.Facts.kernel_takes_grouped` on this backend."""
        return True

    def kernel_takes_mask(self, q: Tensor, num_queries: Any, num_keys: Any) -> bool:
        """:meth:`mha_multi.call.Facts.kernel_takes_mask` on this backend."""
        return True

    def has_call_hooks(self, layer: Any) -> bool:
        """Whether calling ``layer`` runs hooks of the framework's own (PyTorch's modules)."""
        return False

    #: How an eager call is compiled into one program of its own, the layer's call plan
    #: (:mod:`mha_multi.keras._call_plan`): ``compile_call(function)``, or ``None`` where
    #: eager calls run the flow's operations one by one (PyTorch's: its eager operations
    #: are dispatched in C++, and ``torch.compile``'s guards and graph breaks would cost
    #: a small call more than they save).
    compile_call: Callable[[Callable[..., Any]], Callable[..., Any]] | None = None

    #: How many eager calls of a signature run the flow before its program serves it:
    #: where a new signature's trace costs many eager calls (TensorFlow's), a shape met
    #: once (a prompt's length) is not traced.
    eager_calls_before_plan = 0

    def plan_arrays(self, arrays: Any, *, numpy: bool = True) -> bool:
        """Whether each of ``arrays`` is ``None``, or a concrete array of the framework (a
        tuple of them: a cache, segment ids) that :attr:`compile_call`'s program takes;
        with ``numpy``, a numpy array too."""
        return False

    def plan_place(self, x: Tensor) -> Any:
        """Where ``x`` lives, as a call plan's key tells programs apart."""
        return None

    def batch_pieces(self, q: Tensor, example_bytes: int) -> int:
        """How many pieces of the batch the generic path of a call of queries ``q`` takes
        one after another (:func:`mha_multi.spec.batch_pieces`; ``example_bytes``: one
        example's float32 scores): 1, the whole batch, but in a program on JAX's CPU."""
        return 1

    def map_pieces(self, function: Callable[[Any], Any], stacked: Any) -> Any:
        """``function`` of each piece of ``stacked`` in turn (:func:`mha_multi.spec.in_pieces`),
        where :meth:`batch_pieces` answers more than 1."""
        raise NotImplementedError


class _TensorFlow(_Framework):
    """Keras on TensorFlow: ``tf.GradientTape``."""

    def __init__(self) -> None:
        import tensorflow as tf

        self.tf = tf
        # (Made at the first use of the facts, an eager call's: a constant's type is the
        # eager tensors'.)
        self._eager_type = type(tf.constant(0))

    def gpu_available(self) -> bool:
        return bool(self.tf.config.list_physical_devices("GPU"))

    def gpu_name(self) -> str:
        gpu = self.tf.config.list_physical_devices("GPU")[0]
        return str(self.tf.config.experimental.get_device_details(gpu).get("device_name", "gpu"))

    def device_of(self, x: Tensor) -> str:
        return "gpu" if "GPU" in x.device.upper() else "cpu"

    def cache_lengths(self, lengths: Tensor) -> Tensor:
        # TensorFlow's integers of two widths do not meet in one operation: int64 lengths
        # as the int32 positions the spec counts (JAX makes them int32 too).
        return self.tf.cast(lengths, "int32") if lengths.dtype == self.tf.int64 else lengths

    def exact_float32(self) -> None:
        self.tf.config.experimental.enable_tensor_float_32_execution(False)

    def values_readable(self, x: Tensor) -> bool:
        return self.tf.executing_eagerly() and not isinstance(x, keras.KerasTensor)

    def scalar_gradient(self, function: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
        with self.tf.GradientTape() as tape:
            tape.watch(x)
            y = function(x)
        gradient = tape.gradient(y, x)
        return self.tf.zeros_like(x) if gradient is None else gradient  # (y apart from x)

    # A traced call runs as one graph (``tf.function``, without AutoGraph: the flow's
    # Python branches stay Python's), dispatched once instead of operation by operation:
    # a decoding step of the bench's shape 3 ms against 9 eagerly, but a new signature's
    # trace costs some 80 ms (docs: "Fast paths").
    eager_calls_before_plan = 2

    @property
    def compile_call(self) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        tf = self.tf
        return lambda function: _GraphPerSignature(tf.function(function, autograph=False))

    def plan_arrays(self, arrays: Any, *, numpy: bool = True) -> bool:
        # Eager tensors only: a numpy array, which the eager flow takes as it is, would be
        # a constant of the program (one trace per value), and a symbolic one is traced.
        return all_arrays_of(arrays, (self._eager_type,))

    def plan_place(self, x: Tensor) -> Any:
        return x.device


class _GraphPerSignature:
    """A ``tf.function`` called as its graph of the arguments' signature
    (:func:`~mha_multi.call.array_signature`: their shapes and dtypes, the variables'
    included), each kept as the concrete function it is.

    ``tf.function``'s own call looks its graph up by the arguments' trace types:
    2300 Python calls of the tiny layer's one-token call (700 us), where the
    graph called as itself takes 690 (220 us).
    """

    def __init__(self, function: Any) -> None:
        self.function = function
        self.graphs: Kept[Any] = Kept(GRAPHS_PER_PROGRAM)

    def __call__(self, *args: Any) -> Any:
        signature = array_signature(args)
        graph = self.graphs.get(signature)
        if graph is None:
            graph = self.graphs.keep(signature, self.function.get_concrete_function(*args))
        return graph(*args)


#: How many signatures' graphs a TensorFlow program keeps, the oldest dropped first.
GRAPHS_PER_PROGRAM = 16


class _Jax(_Framework):
    """Keras on JAX: ``jax.grad``.

    The facts of plain JAX are written again here rather than taken from
    :mod:`mha_multi.jax`: that package imports Flax, which Keras' JAX
    environment does not install.
    """

    def __init__(self) -> None:
        import jax

        self.jax = jax

    def gpu_available(self) -> bool:
        try:
            return bool(self.jax.devices("gpu"))
        except RuntimeError:
            return False

    def gpu_name(self) -> str:
        return str(self.jax.devices("gpu")[0].device_kind)

    def device_of(self, x: Tensor) -> str:
        platform = next(iter(x.devices())).platform
        return "cpu" if platform == "cpu" else "gpu"

    def exact_float32(self) -> None:
        self.jax.config.update("jax_default_matmul_precision", "highest")

    def enable_float64(self) -> None:
        self.jax.config.update("jax_enable_x64", True)

    def values_readable(self, x: Tensor) -> bool:
        return not isinstance(x, (self.jax.core.Tracer, keras.KerasTensor))

    def scalar_gradient(self, function: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
        # The layer's variables enter the trace as the constants they are.
        return self.jax.grad(function)(x)

    def sync(self, value: Any) -> None:
        self.jax.block_until_ready(value)

    @property
    def compile_call(self) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        return self.jax.jit

    def plan_arrays(self, arrays: Any, *, numpy: bool = True) -> bool:
        # (numpy arrays too, where the eager flow takes them: lengths, which the layer
        # passes on as numpy, enter the program as JAX arrays, as in any jax.jit.)
        return all_arrays_of(
            arrays, (self._array_type(), np.ndarray) if numpy else (self._array_type(),)
        )

    def plan_place(self, x: Tensor) -> Any:
        # The kernel a call takes depends on the platform, its pieces on the devices.
        return x.sharding

    def batch_pieces(self, q: Tensor, example_bytes: int) -> int:
        # A traced call's (a call plan's, a caller's jax.jit): XLA's program on a CPU holds
        # several (B, H, Q, K) arrays at once (docs: "Fast paths"). An eager call's
        # operations run as they are, and a distribution's batch stays as it splits it.
        if (
            not isinstance(q, self.jax.core.Tracer)
            or self.jax.default_backend() != "cpu"
            or keras.distribution.distribution() is not None
        ):
            return 1
        return spec.batch_pieces(q.shape[0], example_bytes, spec.CPU_PIECE_BYTES)

    def map_pieces(self, function: Callable[[Any], Any], stacked: Any) -> Any:
        # As mha_multi.jax's generic path: a piece's backward pass computes its scores
        # and weights again rather than storing them for every piece.
        return self.jax.lax.map(self.jax.checkpoint(function, prevent_cse=False), stacked)

    def _array_type(self) -> type:
        """The type of JAX's concrete arrays, made at the first call (an array initialises
        JAX's backend), outside any trace."""
        array_type = self.__dict__.get("array_type")
        if array_type is None:
            with self.jax.ensure_compile_time_eval():
                array_type = self.__dict__["array_type"] = type(self.jax.numpy.zeros(()))
        return array_type

    def traced_write(
        self, ops: Any, cache: spec.KVCache, k: Tensor, v: Tensor, valid_lens: Any, **sizes: Any
    ) -> tuple[spec.KVCache, Tensor] | None:
        """A traced call's rows scattered (:meth:`scatter`), where its length is known;
        ``sizes``: ``head_dim`` and ``causal``, as :func:`mha_multi.spec.update_cache` takes."""
        if self.values_readable(k) or not isinstance(k.shape[1], int):
            return None
        return spec.update_cache(ops, cache, k, v, valid_lens, scatter=self.scatter, **sizes)

    def scatter(self, held: Tensor, rows: Tensor, positions: Tensor, kept: Tensor) -> Tensor:
        """JAX's scatter of a cache's new rows, as :mod:`mha_multi.jax`'s cache write: under
        ``jit`` the spec's gather would recompute the rows' rotation at every position."""
        jnp = self.jax.numpy
        positions = jnp.where(kept, positions, held.shape[2])  # (past the end: dropped)
        examples = jnp.arange(held.shape[0])[:, None]
        return held.at[examples, :, positions].set(rows, mode="drop")


class _Torch(_Framework):
    """Keras on PyTorch: ``torch.autograd.grad``.

    Devices, precision and PyTorch's own rules for a cache written in place
    and for grouped heads are plain PyTorch's facts
    (:mod:`mha_multi.torch._facts`), the finiteness reads its reads
    (:mod:`mha_multi.torch._reads`), a compiled call's cache written as its
    (:mod:`mha_multi.torch._compiled_cache`), SDPA called as its kernel calls it
    (:mod:`mha_multi.torch._kernel`): nothing else of :mod:`mha_multi.torch`.
    """

    def __init__(self) -> None:
        import torch

        from mha_multi.torch import _compiled_cache, _facts, _kernel, _reads

        self.torch = torch
        self.plain, self.compiled_cache, self.kernel = _facts, _compiled_cache, _kernel
        self.finite_sum, self.largest_magnitude = _reads.finite_sum, _reads.largest_magnitude

    def gpu_available(self) -> bool:
        return self.plain.gpu_available()

    def gpu_name(self) -> str:
        return self.plain.device_description("gpu")

    def device_of(self, x: Tensor) -> str:
        return "gpu" if x.device.type == "cuda" else "cpu"

    def exact_float32(self) -> None:
        self.plain.exact_float32()

    def values_readable(self, x: Tensor) -> bool:
        return not self.torch.compiler.is_compiling()

    def records_gradient(self, x: Tensor) -> bool:
        return x.requires_grad

    def scalar_gradient(self, function: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
        x = x.detach().requires_grad_(True)
        y = function(x)
        if not y.requires_grad:  # (y apart from x)
            return self.torch.zeros_like(x)
        (grad,) = self.torch.autograd.grad(y, [x], allow_unused=True)
        return self.torch.zeros_like(x) if grad is None else grad

    def sync(self, value: Any) -> None:
        for leaf in keras.tree.flatten(value):
            self.plain.sync(leaf)

    def values_within(self, q: Tensor, k: Tensor, v: Tensor, bound: float) -> Tensor:
        # PyTorch's layer's reads, nothing allocated: a decoding step's keys and
        # values are the cache's filled positions. largest_magnitude is NaN for a
        # NaN anywhere, finite_sum finite only where every element is.
        # isfinite().all() took 1.5 ms over an 8/8 cache's 384 positions;
        # largest_magnitude 93 us there (aminmax 221 us), a sum 42 us.
        largest_q, largest_k = (self.largest_magnitude(x) for x in (q, k))
        return (largest_q * largest_k < bound) & self.torch.isfinite(self.finite_sum(v))

    def all_finite(self, x: Tensor) -> Tensor:
        return self.torch.isfinite(self.finite_sum(x))  # one pass, nothing allocated

    def span_bucket(self, keys: Tensor) -> int:
        return self.plain.FACTS.span_bucket_of(keys)

    def writes_in_place(self, *arrays: Tensor) -> bool:
        """In the calls PyTorch's own layer writes its cache in place
        (:func:`mha_multi.torch._cache.writes_in_place`)."""
        return self.plain.writes_in_place(*arrays)

    def version(self, x: Tensor) -> Hashable | None:
        # Inference tensors keep no version counter; storage swapped through .data keeps
        # the counter, not the address.
        return None if x.is_inference() else (x._version, x.data_ptr())

    def dot_product_attention(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        *,
        mask: Tensor | None,
        scale: float | None,
        is_causal: bool,
    ) -> Tensor:
        """PyTorch's ``scaled_dot_product_attention`` called as Keras calls it (the
        same additive mask), on the arrays as they are: Keras repeats grouped
        key/value heads and copies every argument into a contiguous array first
        (docs: "Fast paths"). One query's grouped heads reach it as the queries of
        their key/value head (:func:`mha_multi.torch._kernel.folds_groups`)."""
        torch = self.torch
        if mask is not None and is_causal:
            return super().dot_product_attention(
                query, key, value, mask=mask, scale=scale, is_causal=is_causal
            )
        if mask is not None:
            # Keras' mask: 0 where visible, -0.7 times the dtype's largest value where hidden.
            largest = 65500.0 if query.dtype == torch.float16 else 3.38953e38
            # The hidden value as a Python number: a tensor made of one would be
            # copied to the device, which waits for the GPU.
            visible = torch.as_tensor(mask, dtype=torch.bool)
            mask = torch.zeros(visible.shape, dtype=query.dtype, device=query.device)
            mask.masked_fill_(~visible, largest * -0.7)
        attention = torch.nn.functional.scaled_dot_product_attention
        num_heads, kv_heads = query.shape[2], key.shape[2]
        if self.kernel.folds_groups(num_heads, kv_heads, query.shape[1], is_causal=is_causal):
            # One query's grouped heads as the queries of their key/value head, (B, H_kv,
            # G, dh): no enable_gqa (docs: "Fast paths"), as PyTorch's own layer calls SDPA.
            group_size = num_heads // kv_heads
            output = attention(
                query.view(query.shape[0], kv_heads, group_size, -1),
                key.transpose(1, 2),
                value.transpose(1, 2),
                attn_mask=self.kernel.folded_mask(mask, kv_heads, group_size),
                scale=scale,
            )
            return output.reshape(query.shape)
        grouped = {"enable_gqa": True} if kv_heads != num_heads else {}
        output = attention(
            query.transpose(1, 2),
            key.transpose(1, 2),
            value.transpose(1, 2),
            attn_mask=mask,
            is_causal=is_causal,
            scale=scale,
            **grouped,
        )
        return output.transpose(1, 2)

    def kernel_takes_grouped(self, q: Tensor, num_queries: Any, head_dim: int) -> bool:
        """PyTorch's own rule for SDPA (:func:`mha_multi.torch._ops.repeats_grouped_heads`),
        in float32, which the kernel runs in (16-bit inputs are cast up)."""
        return not self.plain.repeats_grouped_heads(q, num_queries, head_dim, self.torch.float32)

    def kernel_takes_mask(self, q: Tensor, num_queries: Any, num_keys: Any) -> bool:
        """PyTorch's own rule for SDPA's masks over few keys on a CPU
        (:func:`mha_multi.torch._ops.masks_few_keys_slowly`)."""
        return not (
            isinstance(q, self.torch.Tensor)
            and self.plain.masks_few_keys_slowly(q, num_queries, num_keys)
        )

    def has_call_hooks(self, layer: Any) -> bool:
        # A Keras layer is a torch.nn.Module, whose __call__ runs its hooks.
        hooks = self.torch.nn.modules.module
        return bool(
            layer._forward_hooks
            or layer._forward_pre_hooks
            or hooks._global_forward_hooks
            or hooks._global_forward_pre_hooks
        )

    def write_rows(self, held: Tensor, rows: Tensor, first: int, *, in_place: bool) -> Tensor:
        if not in_place:
            return super().write_rows(held, rows, first, in_place=False)
        held.narrow(2, first, rows.shape[2]).copy_(rows)
        return held

    def write_in_place(
        self, ops: Any, cache: spec.KVCache, k: Tensor, v: Tensor, valid_lens: Any, **sizes: Any
    ) -> tuple[spec.KVCache, Tensor] | None:
        # PyTorch's own layer's compiled write, one indexed write per array, which
        # writes the spec's update for any lengths; the spec's gathers every position.
        if not self.writes_in_place(k, v, cache.keys, cache.values):
            return None
        return self.compiled_cache.write_in_place(ops, cache, k, v, valid_lens, **sizes)

    def traced_write(
        self, ops: Any, cache: spec.KVCache, k: Tensor, v: Tensor, valid_lens: Any, **sizes: Any
    ) -> tuple[spec.KVCache, Tensor] | None:
        """Under ``torch.compile``, where no gradient is recorded through the cache,
        PyTorch's own layer's write: one indexed write per array into the cache's own
        tensors, no value read (:func:`mha_multi.torch._compiled_cache.write_in_place`).
        The spec's update gathers every position of a new cache at every step.
        ``sizes``: ``head_dim`` and ``causal``."""
        if not self.torch.compiler.is_compiling() or not self.compiled_cache.writes_in_place(
            k, v, cache.keys, cache.values
        ):
            return None
        return self.compiled_cache.write_in_place(ops, cache, k, v, valid_lens, **sizes)


@made_on_first_use
def active() -> _Framework:
    """The facts of the Keras backend this process runs, made on first use.

    Not at import: the documentation imports this module against mocked
    frameworks, where there is no backend to look up.
    """
    return {"tensorflow": _TensorFlow, "jax": _Jax, "torch": _Torch}[BACKEND]()


def values_readable(x: Tensor) -> bool:
    """Whether the values of ``x`` can be read now (eager execution).

    Inside ``tf.function``, under ``jax.jit`` or while ``torch.compile``
    traces, a tensor has no value yet, and a branch on one would fail (or,
    in PyTorch, break the graph).
    """
    return active().values_readable(x)


def scalar_gradient(function: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    """The gradient of the scalar ``function(x)`` with respect to ``x``, eagerly."""
    return active().scalar_gradient(function, x)


def values_within(q: Tensor, k: Tensor, v: Tensor, bound: float) -> Tensor:
    """Whether ``q``, ``k``, ``v`` are finite and ``max|q| * max|k| < bound``, a boolean scalar."""
    return active().values_within(q, k, v, bound)


def all_finite(x: Tensor) -> Tensor:
    """Whether every element of ``x`` is finite, a boolean scalar (a large sum may say not)."""
    return active().all_finite(x)


def sync(value: Any) -> None:
    """Waits until ``value`` (a tensor, or a nest of them) is computed."""
    active().sync(value)

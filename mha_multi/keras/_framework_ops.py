"""Each framework's own array operations, where ``keras.ops`` is pure overhead: one class a backend.

A ``keras.ops`` call converts its arguments, standardises dtypes and looks
for symbolic tensors before it calls the framework's operation: 20 to 500
Python calls (a product on TensorFlow), where the operation itself costs 1
(PyTorch's, JAX's compiled ``jnp`` functions) to 4 (TensorFlow's
``tf.raw_ops``). An eager one-token call or decoding step makes some fifty
operations, so this is most of its host time (docs: "Fast paths"). The
classes here call the framework's operation that ``keras.ops`` itself calls
for these arguments, so the numbers are Keras' own; anything else
(symbolic ``keras.KerasTensor``\\ s, unknown sizes, other dtypes) takes
``keras.ops``. :func:`framework_ops` makes the process's backend's class on
first use, so only that framework is imported.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np

from mha_multi.keras._first_use import made_on_first_use

__all__ = ["framework_ops"]

Tensor = Any

#: The elementwise comparisons of :meth:`_KerasOps.compare`, which every backend's
#: framework names as Keras does.
COMPARISONS = ("less", "greater_equal", "logical_and")


class _KerasOps:
    """``keras.ops`` itself: the operations of a backend without faster ones."""

    #: The framework's module whose functions of Keras' names (``exp``, ``cos``...)
    #: Keras calls for the arrays :meth:`owns`.
    functions: Any = keras.ops

    def owns(self, x: Tensor) -> bool:
        """Whether ``x`` is a floating array that :attr:`functions` take as Keras' do."""
        return False

    def memos_writable(self) -> bool:
        """Whether a call may write a module's memo now (:mod:`mha_multi.keras._ops`'
        dtype names): where no tracer records the write."""
        return True

    def shape(self, x: Tensor) -> tuple[Any, ...]:
        """``x``'s sizes, Python ints where known (else as ``x.shape`` gives them)."""
        return tuple(x.shape)

    def reshape(self, x: Tensor, shape: tuple[Any, ...]) -> Tensor:
        """``x`` reshaped to ``shape`` (sizes may be unknown: scalar tensors)."""
        return keras.ops.reshape(x, shape)

    def where(self, condition: Tensor, x: Tensor, fill: float | Tensor) -> Tensor:
        """``x`` where ``condition``, else ``fill`` rounded to ``x``'s dtype."""
        # An explicit fill of x's dtype: no backend's promotion rules apply.
        dtype = keras.backend.standardize_dtype(x.dtype)
        return keras.ops.where(condition, x, keras.ops.cast(fill, dtype))

    def transpose(self, x: Tensor, axes: tuple[int, ...]) -> Tensor:
        """``x`` with its axes in the order ``axes``."""
        return keras.ops.transpose(x, axes)

    def row_max(self, x: Tensor) -> Tensor:
        """The maximum over the last axis of ``x`` (not empty), kept as an axis of 1.

        An explicit initial value: without one TensorFlow's ``max`` checks
        eagerly for an empty reduction, a device read per call.
        """
        return keras.ops.max(x, axis=-1, keepdims=True, initial=-float("inf"))

    def matmul(self, a: Tensor, b: Tensor) -> Tensor:
        """``a @ b``, batch axes broadcast."""
        return keras.ops.matmul(a, b)

    def exp(self, x: Tensor) -> Tensor:
        """``e ** x`` of a floating ``x``."""
        return (self.functions if self.owns(x) else keras.ops).exp(x)

    def softmax(self, x: Tensor) -> Tensor:
        """The spec's softmax over the last axis of ``x`` (not empty), written out.

        Not ``keras.ops.softmax``: TensorFlow's float32 softmax kernel gives 0
        instead of NaN to the other entries of a row holding a NaN or +inf,
        where the spec (IEEE arithmetic) makes the whole row NaN. The shift
        only guards ``exp`` against overflow: it cancels in the quotient, so it
        carries no gradient. (The maximum is the backend's: Keras' own reads or
        fails on some.)
        """
        shifted = x - self.stop_gradient(self.row_max(x))
        exponentials = self.exp(shifted)
        return exponentials / self.sum_last(exponentials)

    def cast(self, x: Tensor, dtype: str) -> Tensor:
        """``x`` as ``dtype`` (a Keras dtype name)."""
        return keras.ops.cast(x, dtype)

    def unary(self, name: str, x: Tensor) -> Tensor:
        """``keras.ops.<name>(x)`` (``cos``, ``sin``, ``tanh``, ``sqrt``) of a floating ``x``."""
        return getattr(self.functions if self.owns(x) else keras.ops, name)(x)

    def expand_dims(self, x: Tensor, axis: int) -> Tensor:
        """``x`` with a new axis of 1 at ``axis``."""
        return keras.ops.expand_dims(x, axis)

    def slice_update(self, held: Tensor, start: tuple[int, ...], rows: Tensor) -> Tensor:
        """A new array: ``held`` with ``rows`` written from ``start`` on."""
        return keras.ops.slice_update(held, start, rows)

    def sum_last(self, x: Tensor) -> Tensor:
        """The sum over the last axis, kept as an axis of 1."""
        return keras.ops.sum(x, axis=-1, keepdims=True)

    def constant(self, value: np.ndarray, like: Tensor) -> Tensor:
        """``value`` as a tensor of its dtype (where ``like`` lies)."""
        return keras.ops.convert_to_tensor(value, dtype=str(value.dtype))

    def rows_at(self, x: Tensor, index: np.ndarray) -> Tensor:
        """``x[index]``: rows of the first axis picked by integers on the host."""
        return keras.ops.take(x, self.constant(index.astype(np.int32), x), axis=0)

    def stop_gradient(self, x: Tensor) -> Tensor:
        """``x``, carrying no gradient."""
        return keras.ops.stop_gradient(x)

    def arange(self, size: Any) -> Tensor:
        """``0, 1, ..., size - 1`` as int32."""
        return keras.ops.arange(size, dtype="int32")

    def compare(self, name: str, a: Tensor, b: Tensor) -> Tensor:
        """``keras.ops.<name>(a, b)``, a boolean array: ``name`` is ``less``,
        ``greater_equal`` or ``logical_and`` (:data:`COMPARISONS`)."""
        return getattr(keras.ops, name)(a, b)


class _TensorFlowOps(_KerasOps):
    """TensorFlow's ``tf.raw_ops``, which ``tf.matmul``, ``tf.reshape``... call.

    An eager keras.ops.reshape or transpose costs 150-200 us on the
    project's CPU: Keras' dispatch, then TensorFlow's slow path, which makes
    a constant of a Python shape at every call; keras.ops.matmul costs about
    300 us more than the tf.matmul it calls (docs: "Results"). The raw
    operations given numpy shapes cost one kernel launch and four Python
    calls. Graph tensors (``tf.function``) take them too; symbolic Keras
    tensors and unknown sizes take Keras'.
    """

    def __init__(self) -> None:
        import tensorflow as tf
        from tensorflow.compiler.tf2xla.python.xla import dynamic_update_slice

        self.tf = tf
        self.raw = tf.raw_ops

        @tf.custom_gradient
        def update_slice(held: Tensor, rows: Tensor, start: Any) -> Any:
            # Keras' slice_update, differentiable: TensorFlow registers no gradient for
            # XlaDynamicUpdateSlice, which an eager cached call under a GradientTape met.
            def gradient(upstream: Tensor) -> tuple[Tensor, Tensor, None]:
                # held's: the upstream gradient but where the rows went; the rows': there.
                cleared = dynamic_update_slice(upstream, tf.zeros_like(rows), start)
                return cleared, tf.slice(upstream, start, tf.shape(rows)), None

            return dynamic_update_slice(held, rows, start), gradient

        self.update_slice = update_slice
        #: Fills of where(), by value, dtype and device.
        self._fills: dict[tuple[float, Any, str], Tensor] = {}
        # An eager tensor knows its sizes without a TensorShape (15 Python calls).
        self.eager_tensor = type(tf.constant(0.0))

    def shape(self, x: Tensor) -> tuple[Any, ...]:
        if type(x) is self.eager_tensor:
            return x._shape_tuple()
        return tuple(x.shape)

    def reshape(self, x: Tensor, shape: tuple[Any, ...]) -> Tensor:
        if isinstance(x, self.tf.Tensor) and all(type(size) is int for size in shape):
            return self.raw.Reshape(tensor=x, shape=np.asarray(shape, np.int64))
        return keras.ops.reshape(x, shape)

    def transpose(self, x: Tensor, axes: tuple[int, ...]) -> Tensor:
        if isinstance(x, self.tf.Tensor):
            return self.raw.Transpose(x=x, perm=np.asarray(axes, np.int32))
        return keras.ops.transpose(x, axes)

    def matmul(self, a: Tensor, b: Tensor) -> Tensor:
        # keras.ops.matmul calls tf.matmul for two tensors of one floating
        # dtype, which is MatMul for matrices and BatchMatMulV3 for batches,
        # except a matrix ``b`` after a batch of ``a``, which it takes through
        # tf.tensordot: those keep Keras' path. (A variable, a projection's
        # kernel, is read as by Keras.)
        tf = self.tf
        if not (
            isinstance(a, tf.Tensor)
            and isinstance(b, (tf.Tensor, tf.Variable))
            and a.dtype == b.dtype
            and a.dtype.is_floating
        ):
            return keras.ops.matmul(a, b)
        rank_a, rank_b = len(a.shape), len(b.shape)
        if rank_a == rank_b == 2:
            return self.raw.MatMul(a=a, b=b)
        if rank_a >= 2 and rank_b > 2:
            return self.raw.BatchMatMulV2(x=a, y=b)
        return keras.ops.matmul(a, b)

    def cast(self, x: Tensor, dtype: str) -> Tensor:
        tf = self.tf
        if isinstance(x, tf.Tensor) and (x.dtype.is_floating or x.dtype.is_integer):
            target = tf.as_dtype(dtype)
            if target.is_floating or target.is_integer:  # tf.cast's own Cast
                return x if x.dtype == target else self.raw.Cast(x=x, DstT=target)
        return keras.ops.cast(x, dtype)

    def expand_dims(self, x: Tensor, axis: int) -> Tensor:
        if isinstance(x, self.tf.Tensor):
            return self.raw.ExpandDims(input=x, axis=axis)
        return keras.ops.expand_dims(x, axis)

    def exp(self, x: Tensor) -> Tensor:
        return self.raw.Exp(x=x) if isinstance(x, self.tf.Tensor) else keras.ops.exp(x)

    def sum_last(self, x: Tensor) -> Tensor:
        if isinstance(x, self.tf.Tensor):
            return self.raw.Sum(input=x, axis=-1, keep_dims=True)
        return keras.ops.sum(x, axis=-1, keepdims=True)

    def stop_gradient(self, x: Tensor) -> Tensor:
        if isinstance(x, self.tf.Tensor):
            return self.raw.StopGradient(input=x)
        return keras.ops.stop_gradient(x)

    def row_max(self, x: Tensor) -> Tensor:
        # tf.reduce_max's own Max: TensorFlow checks no empty reduction (Keras'
        # initial value is for that), and the axis is not empty (the spec's softmax).
        if isinstance(x, self.tf.Tensor):
            return self.raw.Max(input=x, axis=-1, keep_dims=True)
        return super().row_max(x)

    def where(self, condition: Tensor, x: Tensor, fill: float | Tensor) -> Tensor:
        # tf.where's SelectV2, the fill a constant of x's dtype made once: a
        # number would be made a tensor at every call (100 Python calls).
        tf = self.tf
        if (
            isinstance(fill, (int, float))
            and isinstance(condition, tf.Tensor)
            and isinstance(x, tf.Tensor)
            and tf.executing_eagerly()
        ):
            key = (float(fill), x.dtype, x.device)
            constant = self._fills.get(key)
            if constant is None:
                constant = self._fills[key] = super().cast(fill, x.dtype.name)
            return self.raw.SelectV2(condition=condition, t=x, e=constant)
        return super().where(condition, x, fill)

    def arange(self, size: Any) -> Tensor:
        if type(size) is int:  # tf.range's own, int32 from int32 bounds
            return self.raw.Range(start=0, limit=size, delta=1)
        return super().arange(size)

    def unary(self, name: str, x: Tensor) -> Tensor:
        # tf.cos, tf.sin...'s own operation, which Keras calls for a floating x.
        if isinstance(x, self.tf.Tensor) and x.dtype.is_floating:
            return getattr(self.raw, name.capitalize())(x=x)
        return super().unary(name, x)

    def constant(self, value: np.ndarray, like: Tensor) -> Tensor:
        # What Keras' conversion calls for a numpy array of a floating dtype.
        if value.dtype.kind == "f":
            return self.tf.convert_to_tensor(value)
        return super().constant(value, like)

    def slice_update(self, held: Tensor, start: tuple[int, ...], rows: Tensor) -> Tensor:
        # Keras' own XLA operation, the start as an array: a tuple would be converted.
        if isinstance(held, self.tf.Tensor) and isinstance(rows, self.tf.Tensor):
            return self.update_slice(held, rows, np.asarray(start, np.int32))
        return super().slice_update(held, start, rows)


class _JaxOps(_KerasOps):
    """JAX's own: ``jnp``'s compiled functions, and single operations compiled once.

    ``jnp.exp``, ``jnp.matmul``... dispatch in one Python call where
    keras.ops' conversions cost 20 to 70; a reshape, transpose, cast or
    new axis is ``lax``'s under ``jax.jit`` (one call; lax's own costs 50,
    keras.ops' 100 to 130). Compiling one operation changes no number: an
    eager operation is compiled alone the same way. Traced arrays take them
    too (inlined into the trace); symbolic Keras tensors take Keras'.
    """

    def __init__(self) -> None:
        import jax
        import jax.numpy as jnp

        self.jax, self.jnp, lax = jax, jnp, jax.lax
        self.functions = jnp
        self.floats = {jnp.dtype(name) for name in ("float64", "float32", "bfloat16", "float16")}
        self._reshape = jax.jit(lax.reshape, static_argnums=(1,))
        self._transpose = jax.jit(lax.transpose, static_argnums=(1,))
        self._cast = jax.jit(lax.convert_element_type, static_argnums=(1,))
        self._expand_dims = jax.jit(lax.expand_dims, static_argnums=(1,))
        self._stop_gradient = jax.jit(lax.stop_gradient)
        # The start an argument: a position that moves at every decoding step compiles nothing new.
        self._slice_update = jax.jit(lax.dynamic_update_slice)
        # jnp's where and arange, which cost some 130 and 110 Python calls eagerly.
        self._where = jax.jit(jnp.where)
        self._where_number = jax.jit(_where_number, static_argnums=(2,))
        self._arange = jax.jit(jnp.arange, static_argnums=(0,), static_argnames=("dtype",))
        self._comparisons = {name: jax.jit(getattr(jnp, name)) for name in COMPARISONS}

    def reshape(self, x: Tensor, shape: tuple[Any, ...]) -> Tensor:
        if isinstance(x, self.jax.Array) and all(type(size) is int for size in shape):
            return self._reshape(x, tuple(shape))
        return keras.ops.reshape(x, shape)

    def transpose(self, x: Tensor, axes: tuple[int, ...]) -> Tensor:
        if isinstance(x, self.jax.Array):
            return self._transpose(x, tuple(axes))
        return keras.ops.transpose(x, axes)

    def matmul(self, a: Tensor, b: Tensor) -> Tensor:
        # Keras' own for floating arrays: jnp.matmul, a variable read as its value.
        if isinstance(b, keras.Variable):
            b = b.value
        jax = self.jax
        native = isinstance(a, jax.Array) and isinstance(b, jax.Array)
        if native and a.dtype == b.dtype and a.dtype in self.floats:
            return self.jnp.matmul(a, b)
        return keras.ops.matmul(a, b)

    def cast(self, x: Tensor, dtype: str) -> Tensor:
        if isinstance(x, self.jax.Array) and x.dtype in self.floats:
            target = self.jnp.dtype(dtype)
            if target in self.floats:
                return x if x.dtype == target else self._cast(x, target)
        return keras.ops.cast(x, dtype)

    def expand_dims(self, x: Tensor, axis: int) -> Tensor:
        if isinstance(x, self.jax.Array):
            return self._expand_dims(x, (axis % (x.ndim + 1),))
        return keras.ops.expand_dims(x, axis)

    def owns(self, x: Tensor) -> bool:
        # (jnp's cos, sin... keep float64, which Keras' compute in float32.)
        return isinstance(x, self.jax.Array) and x.dtype in self.floats

    def sum_last(self, x: Tensor) -> Tensor:
        if isinstance(x, self.jax.Array):
            return self.jnp.sum(x, axis=-1, keepdims=True)
        return keras.ops.sum(x, axis=-1, keepdims=True)

    def stop_gradient(self, x: Tensor) -> Tensor:
        if isinstance(x, self.jax.Array):
            return self._stop_gradient(x)
        return keras.ops.stop_gradient(x)

    def slice_update(self, held: Tensor, start: tuple[int, ...], rows: Tensor) -> Tensor:
        if isinstance(held, self.jax.Array) and isinstance(rows, self.jax.Array):
            return self._slice_update(held, rows, start)
        return keras.ops.slice_update(held, start, rows)

    def where(self, condition: Tensor, x: Tensor, fill: float | Tensor) -> Tensor:
        jax = self.jax
        if not (isinstance(condition, jax.Array) and isinstance(x, jax.Array)):
            return super().where(condition, x, fill)
        if isinstance(fill, float):
            # (A program's key: a float by its bits, so that -0.0 is not 0.0 and NaN is one.)
            return self._where_number(condition, x, fill.hex())
        if isinstance(fill, int):
            return self._where_number(condition, x, int(fill))
        if not isinstance(fill, jax.Array):
            return super().where(condition, x, fill)
        if fill.dtype != x.dtype:
            fill = self._cast(fill, x.dtype)
        return self._where(condition, x, fill)

    def arange(self, size: Any) -> Tensor:
        if type(size) is int:
            return self._arange(size, dtype="int32")
        return super().arange(size)

    def compare(self, name: str, a: Tensor, b: Tensor) -> Tensor:
        if isinstance(a, self.jax.Array) and isinstance(b, self.jax.Array):
            return self._comparisons[name](a, b)  # (Keras' jnp.<name>)
        return super().compare(name, a, b)


def _where_number(condition: Tensor, x: Tensor, fill: int | str) -> Tensor:
    """``jnp.where`` of ``x`` and the number ``fill`` (an int, or a float's ``hex()``)
    as Keras' cast makes it of ``x``'s dtype (its ``convert_to_tensor``: straight to
    that dtype, to bfloat16 through the number's own); compiled with ``fill`` a
    constant (:meth:`_JaxOps.where`)."""
    import jax.numpy as jnp

    if isinstance(fill, str):
        fill = float.fromhex(fill)
    dtype = x.dtype
    if dtype == jnp.bfloat16:
        number = jnp.asarray(fill).astype(dtype)
    else:
        number = jnp.asarray(fill, dtype=dtype)
    return jnp.where(condition, x, number)


class _TorchOps(_KerasOps):
    """PyTorch's own functions, one Python call each, as Keras' PyTorch backend calls them.

    (keras.ops' conversions and dtype checks cost 20 to 120 calls each.)
    """

    def __init__(self) -> None:
        import torch

        from mha_multi.torch._facts import softmax

        self.torch = self.functions = torch
        self.torch_softmax = softmax

    def memos_writable(self) -> bool:
        # Not while torch.compile traces: the write is a dict mutation, after which dynamo
        # reads no mapping proxy, and Keras' call reads one (its signature's parameters):
        # fullgraph=True broke where a compiled call met a dtype first.
        return not self.torch.compiler.is_compiling()

    def reshape(self, x: Tensor, shape: tuple[Any, ...]) -> Tensor:
        # torch's own, which keras.ops' reaches through some 130 Python calls of dispatch.
        native = isinstance(x, self.torch.Tensor)
        return self.torch.reshape(x, shape) if native else keras.ops.reshape(x, shape)

    def transpose(self, x: Tensor, axes: tuple[int, ...]) -> Tensor:
        native = isinstance(x, self.torch.Tensor)
        return self.torch.permute(x, axes) if native else keras.ops.transpose(x, axes)

    def matmul(self, a: Tensor, b: Tensor) -> Tensor:
        torch = self.torch
        if isinstance(b, keras.Variable):
            b = b.value
        # float32, which Keras multiplies with torch.matmul as it is (it casts
        # float16 products on the CPU to float32, float64 ones' results to float32).
        if (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype == torch.float32
        ):
            return torch.matmul(a, b)
        return keras.ops.matmul(a, b)

    def constant(self, value: np.ndarray, like: Tensor) -> Tensor:
        # What Keras' conversion calls, on ``like``'s device; and under torch.compile,
        # which traces numpy arrays as tensors, the one conversion Dynamo takes whole
        # (Keras' reads the array's dtype: a graph break).
        if isinstance(like, self.torch.Tensor):
            return self.torch.as_tensor(value, device=like.device)
        return super().constant(value, like)

    def cast(self, x: Tensor, dtype: str) -> Tensor:
        torch = self.torch
        if isinstance(x, torch.Tensor):
            target = getattr(torch, dtype, None)
            if isinstance(target, torch.dtype):
                return x if x.dtype == target else x.to(target)
        return keras.ops.cast(x, dtype)

    def expand_dims(self, x: Tensor, axis: int) -> Tensor:
        if isinstance(x, self.torch.Tensor):
            return self.torch.unsqueeze(x, axis)
        return keras.ops.expand_dims(x, axis)

    def owns(self, x: Tensor) -> bool:
        return isinstance(x, self.torch.Tensor) and x.dtype.is_floating_point

    def rows_at(self, x: Tensor, index: np.ndarray) -> Tensor:
        if isinstance(x, self.torch.Tensor):
            # (Keras' take checks and wraps negative indices: these lie in the table.)
            return x[self.torch.as_tensor(index, device=x.device)]
        return super().rows_at(x, index)

    def softmax(self, x: Tensor) -> Tensor:
        # PyTorch's generic path's softmax, whose non-finite pattern is the spec's:
        # torch.softmax (one kernel where the formula takes four), and on a CPU rows
        # shorter than its vector width by the formula, floored (PyTorch's CPU exp
        # is six times slower where its result is below the smallest normal number,
        # as a hidden key's is; docs: "Fast paths").
        if self.owns(x):
            return self.torch_softmax(x)
        return super().softmax(x)

    def sum_last(self, x: Tensor) -> Tensor:
        if isinstance(x, self.torch.Tensor):
            return self.torch.sum(x, dim=-1, keepdim=True)
        return keras.ops.sum(x, axis=-1, keepdims=True)

    def stop_gradient(self, x: Tensor) -> Tensor:
        return x.detach() if isinstance(x, self.torch.Tensor) else keras.ops.stop_gradient(x)

    def compare(self, name: str, a: Tensor, b: Tensor | int) -> Tensor:
        torch = self.torch
        if isinstance(a, torch.Tensor) and (
            (isinstance(b, torch.Tensor) and a.device == b.device)
            # An integer as PyTorch takes one (the same answer as Keras' tensor of it,
            # which a GPU's call would copy from the host).
            or (type(b) is int and name != "logical_and")
        ):
            return getattr(torch, name)(a, b)  # (Keras' torch.<name>)
        return super().compare(name, a, b)

    def where(self, condition: Tensor, x: Tensor, fill: float | Tensor) -> Tensor:
        torch = self.torch
        if (
            isinstance(fill, torch.Tensor)
            and isinstance(condition, torch.Tensor)
            and isinstance(x, torch.Tensor)
            and condition.dtype == torch.bool
            and condition.device == x.device == fill.device
        ):
            # Keras' own: the fill cast to x's dtype, then torch.where.
            return torch.where(condition, x, fill if fill.dtype == x.dtype else fill.to(x.dtype))
        if not (isinstance(fill, (int, float)) and isinstance(condition, torch.Tensor)):
            return super().where(condition, x, fill)
        # A number, as PyTorch takes one: Keras would make it a tensor on the
        # device, a copy from the host that waits for a GPU. A number does
        # not promote a floating tensor: the fill is rounded to x's dtype.
        return torch.where(condition, x, fill)

    def row_max(self, x: Tensor) -> Tensor:
        # Keras' max with an initial value makes it a CPU tensor, which a
        # CUDA one cannot meet; amax checks only the shape.
        return self.torch.amax(x, dim=-1, keepdim=True)

    def slice_update(self, held: Tensor, start: tuple[int, ...], rows: Tensor) -> Tensor:
        torch = self.torch
        if not (isinstance(held, torch.Tensor) and isinstance(rows, torch.Tensor)):
            return keras.ops.slice_update(held, start, rows)
        # Keras' own: a clone, the rows copied in.
        updated = torch.clone(held)
        updated[tuple(slice(s, s + n) for s, n in zip(start, rows.shape, strict=True))] = rows
        return updated


@made_on_first_use
def framework_ops() -> _KerasOps:
    """The operations of the Keras backend this process runs, made on first use.

    Not at import: the documentation imports this module against mocked
    frameworks, where there is no backend to look up.
    """
    backend = keras.backend.backend()
    return {"tensorflow": _TensorFlowOps, "jax": _JaxOps, "torch": _TorchOps}[backend]()

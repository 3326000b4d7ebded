"""Benchmarks: our layer against each framework's own, measured, never asserted.

``python -m mha_multi.bench run BACKEND --out DIR`` writes ``DIR/BACKEND.json``;
``python -m mha_multi.bench report --results DIR`` prints and writes the tables.
"""

#: Benchmark name -> module whose ``FRAMEWORK`` (a
#: :class:`~mha_multi.bench.framework.Framework`) it runs; imported only when run.
BENCHMARKS = {
    "torch": "mha_multi.bench.torch",
    "jax": "mha_multi.bench.jax",
    "mxnet": "mha_multi.bench.mxnet",
    **{f"keras-{b}": "mha_multi.bench.keras" for b in ("tensorflow", "jax", "torch")},
}

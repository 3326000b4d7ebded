"""Test configuration shared by every nox session.

Backend tests are written once and parametrized over runners:

* ``MHA_MULTI_BACKENDS=torch,jax-nnx`` selects the backends (a nox session
  sets it); a selected backend that fails to import is an error, not a skip.
  Unset, every backend whose framework imports is used.
* ``MHA_MULTI_REQUIRE_GPU=1`` turns a missing GPU into a failure instead of
  a skip.
* ``HYPOTHESIS_PROFILE=exhaustive`` runs the randomised tests with many more
  examples.
* ``MHA_MULTI_TEST_DTYPES=jax-nnx=float32+bfloat16,jax-linen=float32``
  runs those backends' dtype-parametrized tests in the dtypes named only (a
  nox session sets it where each case is compiled anew: eager JAX);
  ``nox -s parity`` still runs every backend on every case in every dtype.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import settings

DEVICES = ("cpu", "gpu")

# Randomised tests: a few dozen examples per backend in the default run (eager
# frameworks compile every new shape, so examples are the suite's main cost);
# ``HYPOTHESIS_PROFILE=exhaustive`` (the ``exhaustive-*`` nox sessions) for many.
settings.register_profile("mha_multi", max_examples=40)
# Eager JAX compiles every operation for every new shape: its sessions take fewer.
settings.register_profile("compiles-each-shape", max_examples=15)
settings.register_profile("exhaustive", max_examples=1000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "mha_multi"))


def selected_backends() -> list[str]:
    from mha_multi.parity.runners import get_runner, runner_names

    requested = os.environ.get("MHA_MULTI_BACKENDS", "").strip()
    if requested:
        return [name.strip() for name in requested.split(",") if name.strip()]
    available = []
    for name in runner_names():
        try:
            get_runner(name)
        except ImportError:
            continue
        available.append(name)
    return available


def gpu_required() -> bool:
    return os.environ.get("MHA_MULTI_REQUIRE_GPU", "") not in ("", "0")


def without_synchronisation(run):
    """``run()`` with PyTorch raising at any wait for a CUDA device (sync debug "error")."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        return run()
    finally:
        torch.cuda.set_sync_debug_mode(0)


def record_sdpa_key_heads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, bool]]:
    """PyTorch's ``scaled_dot_product_attention`` recording, at each call, the
    key/value heads it gets (``k.shape[1]``) and whether ``enable_gqa`` is set."""
    import torch

    seen: list[tuple[int, bool]] = []
    original = torch.nn.functional.scaled_dot_product_attention

    def recording(q, k, v, **kwargs):
        seen.append((k.shape[1], kwargs.get("enable_gqa", False)))
        return original(q, k, v, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    return seen


def recorded_calls(
    monkeypatch: pytest.MonkeyPatch, owner: Any, name: str, record: Callable[..., Any]
) -> list[Any]:
    """Returns a list that gets ``record(*args, **kwargs)`` at each call of
    ``owner.name``, which then runs as it did."""
    recorded: list[Any] = []
    original = getattr(owner, name)

    def recording(*args, **kwargs):
        recorded.append(record(*args, **kwargs))
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, recording)
    return recorded


def counted_flow_runs(monkeypatch: pytest.MonkeyPatch, forget) -> Iterator[list[int]]:
    """Yields a list that gets an entry per run of the call flow
    (:func:`mha_multi.call.forward`), which a call plan's call runs only while its
    program is traced; the plans ``forget()`` drops are made anew before and after.
    A fixture's body: ``yield from counted_flow_runs(monkeypatch, forget)``."""
    from mha_multi import call

    runs: list[int] = []
    forward = call.forward

    def counted(*args, **kwargs):
        runs.append(1)
        return forward(*args, **kwargs)

    monkeypatch.setattr(call, "forward", counted)
    forget()
    yield runs
    forget()


@contextlib.contextmanager
def recording_host_moves() -> Iterator[list[str]]:
    """Yields a list that gets the name of every PyTorch call that would wait for a GPU:
    a read to the host (``item``, ``tolist``, ``__array__``...), or a tensor made of
    host data (a copy to a GPU from pageable memory waits too)."""
    import torch
    from torch.overrides import TorchFunctionMode

    moving = {"item", "cpu", "numpy", "tolist", "__array__", "__bool__", "__int__", "__float__"}
    moved: list[str] = []

    class Recording(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            name = getattr(func, "__name__", "")
            made = name in ("tensor", "as_tensor", "from_numpy")
            if name in moving or (made and not isinstance(args[0], torch.Tensor)):
                moved.append(name)
            return func(*args, **(kwargs or {}))

    with Recording():
        yield moved


def device_or_skip(device: str, available: bool, missing: str) -> str:
    """``device`` where it is ``available``; skips the test otherwise.

    A missing GPU fails the test instead where ``MHA_MULTI_REQUIRE_GPU`` is
    set: a GPU run must not pass by skipping its GPU tests.

    Args:
        device: ``"cpu"`` or ``"gpu"``.
        available: whether the framework can use ``device``, as it says.
        missing: the skip's reason (``"no CUDA device"``...).
    """
    if not available:
        if device != "cpu" and gpu_required():
            pytest.fail(f"{missing}, and MHA_MULTI_REQUIRE_GPU is set")
        pytest.skip(missing)
    return device


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "backend" in metafunc.fixturenames:
        metafunc.parametrize("backend", selected_backends(), scope="session")
    if "device" in metafunc.fixturenames:
        metafunc.parametrize("device", DEVICES, scope="session")


def chosen_test_dtypes() -> dict[str, set[str]]:
    """``MHA_MULTI_TEST_DTYPES`` as backend -> the dtypes its tests run in."""
    chosen = {}
    for entry in os.environ.get("MHA_MULTI_TEST_DTYPES", "").split(","):
        if entry.strip():
            backend, _, dtypes = entry.strip().partition("=")
            chosen[backend] = set(dtypes.split("+"))
    return chosen


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    chosen = chosen_test_dtypes()
    if not chosen:
        return
    kept, dropped = [], []
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        dtypes = chosen.get(params.get("backend"))
        left_out = dtypes is not None and params.get("dtype", "float32") not in dtypes
        (dropped if left_out else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


@pytest.fixture(scope="session")
def runner(backend: str):
    """The parity runner of ``backend`` (imports its framework)."""
    from mha_multi.parity.runners import get_runner

    return get_runner(backend)


@pytest.fixture(scope="session")
def available_device(runner, device: str) -> str:
    """``device`` if the runner can use it; skips (or fails) otherwise."""
    return device_or_skip(
        device, runner.device_available(device), f"{runner.name}: no {device} device"
    )


@pytest.fixture(scope="session")
def cases():
    """Every parity case, built once per test session: name -> Case."""
    from mha_multi.parity.cases import CASES, build_case

    return {config.name: build_case(config) for config in CASES}


@pytest.fixture(autouse=True)
def _programs_of_each_test() -> Iterator[None]:
    """Each test's Keras layers trace their own programs: layers of the same settings
    share their call plan's programs (docs: "Fast paths"), which would carry one
    test's traces into whichever test a worker runs next, and a test that watches
    the flow run would see none. (Asked only where the module was imported.)"""
    yield
    plans = sys.modules.get("mha_multi.keras._call_plan")
    if plans is not None:
        plans.forget()

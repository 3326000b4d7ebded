"""nox sessions: one environment per framework, because they cannot share one.

``nox`` runs every ``tests-*`` session, ``lint`` and ``docs``; ``nox -s parity``
runs every backend on the shared parity cases and prints the report;
``nox -s exhaustive`` runs the randomised tests with many more examples.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import nox

# uv where it is installed (`pip install "nox[uv]"`): it installs each
# framework environment in seconds where pip takes one to two minutes. Without
# uv, nox falls back to venv and pip.
nox.options.default_venv_backend = "uv|venv"
nox.options.reuse_existing_virtualenvs = True

ROOT = Path(__file__).parent
PARITY_DIR = ROOT / "parity-report"
BENCH_DIR = ROOT / "bench-report"
#: The result files the results page is made from (docs: "Measured results").
RESULTS_DIR = ROOT / "docs" / "results"

# Every pinned version lives here. An unpinned torch pulls gigabytes of CUDA
# packages; 2.13.0 resolves to a CPU wheel on the project's machines.
PINS = {
    "numpy": "numpy==2.4.6",
    "safetensors": "safetensors==0.8.0",
    "pytest": "pytest==9.2.0",
    "pytest-xdist": "pytest-xdist==3.8.0",
    "hypothesis": "hypothesis==6.170.15",
    "ruff": "ruff==0.17.5",
    "matplotlib": "matplotlib==3.11.2",
    "sphinx": "sphinx==9.0.4",
    "furo": "furo==2025.12.19",
    "myst-parser": "myst-parser==5.2.0",
    "torch": "torch==2.13.0",
    # Tests only: llama-style attention modules to convert weights from and to.
    "transformers": "transformers==5.23.0",
    # MXNet 1.9 (the last release) uses np.bool: numpy < 1.24 in its environment.
    "mxnet": "mxnet==1.9.1",
    "numpy-mxnet": "numpy==1.23.5",
    "keras": "keras==3.15.1",
    "tensorflow": "tensorflow==2.21.0",
    "jax": "jax==0.10.2",
    "jaxlib": "jaxlib==0.10.2",
    "flax": "flax==0.12.8",
}


@dataclass(frozen=True)
class Environment:
    """A framework environment: what it installs and which backends it runs."""

    pins: tuple[str, ...]
    extras: str
    backends: tuple[str, ...] = ()
    tests: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    benchmarks: tuple[str, ...] = ()
    #: Settings of the test sessions only (parity and bench run as users do).
    test_env: dict[str, str] = field(default_factory=dict)


TEST_TOOLS = (PINS["pytest"], PINS["pytest-xdist"], PINS["hypothesis"])
# Eager JAX compiles every operation for every new shape, and the tests make
# thousands of small programs: XLA's LLVM optimizations off cut tests-jax from
# 7.8 to 6.3 minutes on a 2-core machine; XLA's older fusion emitters (the
# default MLIR ones take longer to compile a small program) with one codegen
# thread per program (the two test processes hold both cores) from 7.3 to 3.2
# (tests-keras-jax 3.8 to 2.1). The numbers are IEEE float32 either way (no
# fast math); the parity and bench sessions compile as users do.
FAST_XLA_COMPILES = {
    "XLA_FLAGS": (
        "--xla_backend_optimization_level=0"
        " --xla_cpu_use_fusion_emitters=false"
        " --xla_cpu_parallel_codegen_split_count=1"
    ),
    # Fewer randomised examples (conftest.py): each is new shapes to compile.
    "HYPOTHESIS_PROFILE": "compiles-each-shape",
}
COMMON = (PINS["numpy"], PINS["safetensors"], *TEST_TOOLS)


def keras_environment(
    backend: str, pins: tuple[str, ...], extras: str = "test", **settings: dict[str, str]
) -> Environment:
    """Keras 3 on ``backend`` (``KERAS_BACKEND``) with its framework's ``pins``."""
    return Environment(
        (*COMMON, PINS["keras"], *pins),
        extras,
        backends=(f"keras-{backend}",),
        tests=("tests/backends", "tests/keras", "tests/examples"),
        env={"KERAS_BACKEND": backend},
        benchmarks=(f"keras-{backend}",),
        **settings,
    )


ENVIRONMENTS: dict[str, Environment] = {
    "numpy": Environment(COMMON, "test", tests=("tests/core", "tests/examples")),
    "torch": Environment(
        (*COMMON, PINS["torch"], PINS["transformers"]),
        "torch,test",
        backends=("torch",),
        tests=("tests/backends", "tests/torch", "tests/examples"),
        benchmarks=("torch",),
    ),
    "jax": Environment(
        (*COMMON, PINS["jax"], PINS["jaxlib"], PINS["flax"]),
        "jax,test",
        backends=("jax-nnx", "jax-linen"),
        tests=("tests/backends", "tests/jax", "tests/examples"),
        benchmarks=("jax",),
        # Each case in each dtype is compiled anew: the full sweeps run in
        # `nox -s parity`. float16 takes bfloat16's path; float64 is JAX's x64
        # mode of the same code, checked in tests/jax (gradients against finite
        # differences, NNX and Linen bit for bit); Linen computes NNX's
        # functional core, bit-identically in every dtype (tests/jax).
        test_env={
            **FAST_XLA_COMPILES,
            "MHA_MULTI_TEST_DTYPES": "jax-nnx=float32+bfloat16,jax-linen=float32",
        },
    ),
    "mxnet": Environment(
        # COMMON with numpy 1.23: MXNet 1.9 imports only with numpy < 1.24.
        (
            PINS["numpy-mxnet"],
            PINS["safetensors"],
            *TEST_TOOLS,
            PINS["mxnet"],
        ),
        "mxnet,test",
        backends=("mxnet", "mxnet-hybrid"),
        tests=("tests/core", "tests/backends", "tests/mxnet", "tests/examples"),
        benchmarks=("mxnet",),
    ),
    # Keras fixes its backend per process from KERAS_BACKEND, so each Keras
    # backend is an environment of its own running the same layer.
    "keras-tensorflow": keras_environment("tensorflow", (PINS["tensorflow"],), "keras,test"),
    "keras-jax": keras_environment(
        "jax",
        (PINS["jax"], PINS["jaxlib"]),
        test_env={
            **FAST_XLA_COMPILES,
            # float64 runs on Keras' other backends and in `nox -s parity`.
            "MHA_MULTI_TEST_DTYPES": "keras-jax=float32+bfloat16",
        },
    ),
    "keras-torch": keras_environment("torch", (PINS["torch"],)),
}

# GPU runs must compare IEEE float32 and not grab all device memory (docs: "Architecture").
GPU_ENV = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", "TF_FORCE_GPU_ALLOW_GROWTH": "true"}


def pip_find_links() -> list[str]:
    """pip's configured ``find-links`` locations, which uv does not read.

    A machine may keep wheels on disk for pip to take before an index (the
    project's machines keep the CPU build of torch 2.13.0 there); uv takes them
    only when told, and would otherwise download torch's CUDA build.
    """
    value = os.environ.get("PIP_FIND_LINKS")
    if value is None:
        try:
            found = subprocess.run(
                [sys.executable, "-m", "pip", "config", "get", "global.find-links"],
                capture_output=True,
                text=True,
                check=False,
            )
        except OSError:
            return []
        value = found.stdout if found.returncode == 0 else ""
    return value.split()


# uv's list is comma-separated; pip's is whitespace-separated.
if "UV_FIND_LINKS" not in os.environ and (_find_links := pip_find_links()):
    os.environ["UV_FIND_LINKS"] = ",".join(_find_links)
# Bytecode compiled once, at install, as pip does by default (uv only when
# asked): where Python writes none at import (PYTHONDONTWRITEBYTECODE), every
# test process would compile the frameworks' sources anew (keras-jax's API
# tests: 21 s without, 14 s with).
os.environ.setdefault("UV_COMPILE_BYTECODE", "1")


def install(session: nox.Session, environment: Environment) -> None:
    session.install(*environment.pins, "-e", f".[{environment.extras}]")


def session_env(environment: Environment) -> dict[str, str]:
    env = {**GPU_ENV, **environment.env, "MHA_MULTI_BACKENDS": ",".join(environment.backends)}
    for name in ("MHA_MULTI_REQUIRE_GPU",):
        if name in os.environ:
            env[name] = os.environ[name]
    return env


# One pytest worker per core: eager JAX spends the suite's time compiling each
# operation for each new shape, single-threaded (tests-jax: 407 s in one
# process, 250 s in two on a 2-core machine).
# Work stealing: a worker that runs out takes the other's pending tests, so a
# run does not end on one worker's tail of slow tests (keras-torch: 101 s with
# the default distribution, 73 s with stealing).
PARALLEL = ("--numprocesses", "auto", "--dist", "worksteal")


def make_test_session(name: str, environment: Environment) -> None:
    @nox.session(name=f"tests-{name}")
    def tests(session: nox.Session) -> None:
        install(session, environment)
        session.run(
            "pytest",
            *PARALLEL,
            *environment.tests,
            *session.posargs,
            env={**session_env(environment), **environment.test_env},
        )

    if environment.backends:

        @nox.session(name=f"exhaustive-{name}", default=False)
        def exhaustive(session: nox.Session) -> None:
            """The randomised backend tests with many examples (not in the default run)."""
            install(session, environment)
            env = {**session_env(environment), "HYPOTHESIS_PROFILE": "exhaustive"}
            session.run(
                "pytest", *PARALLEL, "tests/backends/test_random.py", *session.posargs, env=env
            )


def make_parity_session(name: str, environment: Environment) -> None:
    @nox.session(name=f"parity-{name}", default=False)
    def parity_backend(session: nox.Session) -> None:
        with_backends = [n for n, e in ENVIRONMENTS.items() if e.backends]
        position = with_backends.index(name) + 1
        backends = ", ".join(environment.backends)
        session.log(f"[parity] environment {position}/{len(with_backends)}: {name} ({backends})")
        session.log("[parity] installing (first run only: frameworks are large)")
        install(session, environment)
        session.run(
            "python",
            "-m",
            "mha_multi.parity",
            "run",
            "--cases",
            str(PARITY_DIR / "cases"),
            "--out",
            str(PARITY_DIR / "results"),
            *environment.backends,
            env=session_env(environment),
        )


def make_bench_session(name: str, environment: Environment) -> None:
    @nox.session(name=f"bench-{name}", default=False)
    def bench_backend(session: nox.Session) -> None:
        install(session, environment)
        session.run(
            "python",
            "-m",
            "mha_multi.bench",
            "run",
            "--out",
            str(BENCH_DIR / "results"),
            *session.posargs,
            *environment.benchmarks,
            env=session_env(environment),
        )


for _name, _environment in ENVIRONMENTS.items():
    make_test_session(_name, _environment)
    if _environment.backends:
        make_parity_session(_name, _environment)
    if _environment.benchmarks:
        make_bench_session(_name, _environment)


@nox.session(default=False)
def exhaustive(session: nox.Session) -> None:
    """Every backend's randomised tests with many hypothesis examples."""
    for name, environment in ENVIRONMENTS.items():
        if environment.backends:
            session.notify(f"exhaustive-{name}", posargs=session.posargs)


@nox.session(default=False)
def parity(session: nox.Session) -> None:
    """Every backend on the shared cases, then the report (non-zero on any failure)."""
    install(session, ENVIRONMENTS["numpy"])
    session.run("python", "-m", "mha_multi.parity", "cases", str(PARITY_DIR / "cases"))
    session.run("python", "-m", "mha_multi.parity", "clean", str(PARITY_DIR / "results"))
    for name, environment in ENVIRONMENTS.items():
        if environment.backends:
            session.notify(f"parity-{name}")
    session.notify("parity-report")


@nox.session(name="parity-report", default=False)
def parity_report(session: nox.Session) -> None:
    install(session, ENVIRONMENTS["numpy"])
    session.install(PINS["matplotlib"])  # heads.png
    expected = [b for e in ENVIRONMENTS.values() for b in e.backends]
    session.run(
        "python",
        "-m",
        "mha_multi.parity",
        "report",
        "--results",
        str(PARITY_DIR / "results"),
        "--out",
        str(PARITY_DIR),
        "--expect",
        ",".join(expected),
    )


@nox.session(default=False)
def bench(session: nox.Session) -> None:
    """Ours vs each framework's own layer (a benchmark: prints tables, asserts nothing).

    ``nox -s bench -- --quick`` runs small sizes only.
    """
    session.install(PINS["numpy"], "-e", ".")
    session.run("python", "-m", "mha_multi.parity", "clean", str(BENCH_DIR / "results"))
    for name, environment in ENVIRONMENTS.items():
        if environment.benchmarks:
            session.notify(f"bench-{name}", posargs=session.posargs)
    session.notify("bench-report")


@nox.session(name="bench-report", default=False)
def bench_report(session: nox.Session) -> None:
    session.install(PINS["numpy"], "-e", ".")
    session.run(
        "python",
        "-m",
        "mha_multi.bench",
        "report",
        "--results",
        str(BENCH_DIR / "results"),
        "--out",
        str(BENCH_DIR),
    )


@nox.session(default=False)
def results(session: nox.Session) -> None:
    """The results page's tables from the newest parity report and benchmark results.

    ``nox -s parity bench results`` measures, then writes the page: the work
    is queued behind what ``parity`` and ``bench`` queue (``results-page``).
    """
    session.notify("results-page")


@nox.session(name="results-page", default=False)
def results_page(session: nox.Session) -> None:
    session.install(PINS["numpy"], "-e", ".")
    made = [PARITY_DIR / "report.json", BENCH_DIR / "results"]
    takes = [arg for path in made if path.exists() for arg in ("--take", str(path))]
    session.run("python", "-m", "mha_multi.bench", "page", "--results", str(RESULTS_DIR), *takes)


@nox.session
def docs(session: nox.Session) -> None:
    """The documentation site in docs/_build/html (warnings are errors).

    Only the package and the docs tools are installed: the API pages mock the
    frameworks (``autodoc_mock_imports``), and the figures come from
    ``mha_multi.spec`` itself.
    """
    session.install(
        PINS["numpy"],
        PINS["safetensors"],
        PINS["sphinx"],
        PINS["furo"],
        PINS["myst-parser"],
        PINS["matplotlib"],
        "-e",
        ".[docs]",
    )
    # The results page's tables must be those its result files make.
    session.run("python", "-m", "mha_multi.bench", "page", "--check", "--results", str(RESULTS_DIR))
    session.run("sphinx-build", "-W", "--keep-going", "-b", "html", "docs", "docs/_build/html")


@nox.session
def lint(session: nox.Session) -> None:
    session.install(PINS["ruff"])
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")

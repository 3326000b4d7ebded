"""Importing the package or its spec imports no framework."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

FRAMEWORKS = ("torch", "jax", "flax", "tensorflow", "keras", "mxnet", "h5py")


@pytest.mark.parametrize(
    "module",
    [
        "mha_multi",
        "mha_multi.spec",
        "mha_multi.weights",
        "mha_multi.parity.cases",
        "mha_multi.parity.compare",
        "mha_multi.parity.runners",
        # The format registry and the command line name frameworks, import none.
        "mha_multi.interop",
        "mha_multi.interop.formats",
        "mha_multi.__main__",
    ],
)
def test_no_framework_is_imported(module):
    code = (
        f"import json, sys; import {module}; "
        f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {FRAMEWORKS!r})))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert json.loads(result.stdout) == []


def test_version_has_one_source():
    from importlib.metadata import version

    import mha_multi

    assert version("mha_multi") == mha_multi.__version__

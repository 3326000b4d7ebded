"""Sphinx configuration of the mha_multi documentation."""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

from sphinx.ext.autodoc.mock import mock
from sphinx.util.inspect import stringify_signature

DOCS = Path(__file__).parent
sys.path.insert(0, str(DOCS / "_scripts"))

import figures  # noqa: E402

import mha_multi  # noqa: E402

project = "mha_multi"
author = "mha_multi contributors"
copyright = "mha_multi contributors"
release = version = mha_multi.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build", "examples", "_scripts"]
myst_enable_extensions = ["colon_fence", "dollarmath", "deflist"]
myst_heading_anchors = 3

# The documentation environment installs no framework: every backend module
# is imported against mocks, so that its docstrings and signatures render.
autodoc_mock_imports = [
    "torch",
    "jax",
    "jaxlib",
    "flax",
    "keras",
    "tensorflow",
    "mxnet",
    "transformers",
]
autodoc_member_order = "bysource"

# A mocked class decorator would replace the Keras layer class by a mock and
# hide its members: import the module once with a pass-through decorator, so
# that autodoc finds the real class in sys.modules.
with mock(autodoc_mock_imports):
    import keras.saving

    keras.saving.register_keras_serializable = lambda *args, **kwargs: lambda cls: cls
    import mha_multi.keras

autodoc_typehints = "description"
autodoc_typehints_description_target = "documented"
autodoc_typehints_format = "short"
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "furo"
html_title = f"mha_multi {release}"
pygments_style = "friendly"


def _constructor_signature(app, what, name, obj, options, signature, return_annotation):
    """The constructor signature of classes whose framework base class is mocked.

    A mocked base class contributes a ``__new__(*args, **kwargs)`` that would
    otherwise hide the real arguments: those of the class's own ``__init__``,
    or, for dataclass-style modules (Flax Linen), its annotated fields.
    """
    if what != "class" or signature != "(*args, **kwargs)":
        return None
    if "__init__" in vars(obj):
        parameters = list(inspect.signature(obj.__init__).parameters.values())[1:]
    else:
        fields = [f for f in vars(obj).get("__annotations__", {}) if not f.startswith("_")]
        if not fields:
            return None
        parameters = [
            inspect.Parameter(
                field,
                inspect.Parameter.POSITIONAL_OR_KEYWORD,
                default=vars(obj).get(field, inspect.Parameter.empty),
            )
            for field in fields
        ]
    parameters = [p.replace(annotation=inspect.Parameter.empty) for p in parameters]
    return stringify_signature(inspect.Signature(parameters)), return_annotation


def setup(app):
    app.connect("autodoc-process-signature", _constructor_signature)


# Figures of the head layout and of the visibility masks, drawn by the spec.
figures.write_all(DOCS / "_generated")

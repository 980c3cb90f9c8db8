"""Sphinx configuration of the lowrank_jax documentation.

Build: ``python -m pip install -e ".[docs]"`` then
``python -m sphinx -n -W --keep-going -b html docs docs/_build/html`` (nitpicky, warnings are
errors: what CI runs). The API reference is generated from the public ``__all__`` of each
subpackage (``_ext/apigen.py``); the notebooks are rendered from the executed copies the test
suite saves (``_ext/notebooks.py``); the command-line reference from the argparse parser
(``_ext/cli_reference.py``).
"""

from __future__ import annotations

import os
import pathlib
import sys
import tomllib

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))  # the checkout's library, also without an editable install
sys.path.insert(0, str(HERE / "_ext"))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

project = "lowrank_jax"
author = "the lowrank_jax authors"
copyright = "the lowrank_jax authors"  # noqa: A001 - Sphinx's name
# The version of the checkout being documented (pyproject.toml), which an installed copy's
# metadata (what lowrank_jax.__version__ reads) equals once installed from this checkout.
release = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
version = release

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "myst_nb",  # MyST Markdown pages and notebooks (includes myst_parser)
    "apigen",
    "xrefs",
    "notebooks",
    "cli_reference",
    "benchmark_tables",
]

source_suffix = {".rst": "restructuredtext", ".md": "myst-nb", ".ipynb": "myst-nb"}
exclude_patterns = ["_build", "**/.ipynb_checkpoints", "Thumbs.db", ".DS_Store",
                    "notebooks/README.md"]
root_doc = "index"
# "--help" stays two hyphens (docutils would make it an en dash), quotes stay straight
smartquotes = False

# --- MyST / notebooks -------------------------------------------------------------------------
myst_enable_extensions = ["colon_fence", "deflist", "dollarmath"]
myst_heading_anchors = 3
# The test suite executes every notebook once (tests/test_notebooks.py) and saves the executed
# copies; the docs render those and never run a notebook themselves.
nb_execution_mode = "off"
nb_merge_streams = True

# --- autodoc / napoleon ------------------------------------------------------------------------
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_preserve_defaults = True
autodoc_class_signature = "mixed"
autosummary_generate = False  # the pages are written by apigen, one per public module
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_use_ivar = True
# The dataclass records describe their fields under a "Fields:" heading.
napoleon_custom_sections = [("Fields", "params_style")]

# --- nitpicky mode -----------------------------------------------------------------------------
# No network at build time, so no intersphinx inventories: references to other libraries' types
# (in signatures and docstrings) are not linked and not reported. Everything of lowrank_jax
# must resolve (``_ext/xrefs.py`` maps short and private-module names to the one entry).
nitpicky = True
nitpick_ignore_regex = [
    (r"py:.*", r"(jax|jaxlib|jnp|np|numpy|optax|flax|nnx|linen|orbax|chex|scipy|torch|"
               r"transformers|safetensors|tokenizers|matplotlib|plt|aeon|tensorly|tqdm|"
               r"threadpoolctl|ml_dtypes|PIL)(\..*)?"),
    (r"py:.*", r"(typing|typing_extensions|collections|collections\.abc|abc|pathlib|os|io|"
               r"argparse|dataclasses|enum|types|contextlib|concurrent|re|json|numbers|"
               r"functools|itertools|logging|subprocess|threading|builtins)\..*"),
    # builtins and typing names as bare words in docstrings and hints
    (r"py:.*", r"(Array|ArrayLike|PyTree|Pytree|DTypeLike|Shape|Callable|Sequence|Mapping|"
               r"Iterable|Iterator|Generator|Any|Optional|Union|Literal|Self|TypeVar|Path|"
               r"PathLike|Protocol|NamedTuple|ClassVar|Hashable|MutableMapping|"
               r"ModuleType|TextIO|IO|ndarray|Mesh|PartitionSpec|NamedSharding|Sharding|"
               r"PRNGKey|KeyArray|Module|GradientTransformation|OptState|"
               r"T|K|V|F|P|R|LeafT|NodeT)"),
]

# --- HTML --------------------------------------------------------------------------------------
html_theme = "furo"
html_title = f"lowrank_jax {release}"
html_static_path = ["_static"]
html_css_files = ["custom.css"]
html_theme_options = {
    "source_repository": "https://github.com/lowrank-jax/lowrank_jax/",
    "source_branch": "main",
    "source_directory": "docs/",
}
html_show_sourcelink = False

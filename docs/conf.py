"""Sphinx configuration: MyST Markdown pages, furo, API reference from the docstrings.

Built by tests/test_docs.py with warnings as errors (``sphinx-build -W``), once as HTML
and once with the doctest builder, which runs the ``{testcode}`` samples.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The sharding guide's sample runs on 8 CPU devices. XLA reads this flag once, when
# JAX starts its CPU backend, so it is set here, before any sample imports JAX.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    os.environ["XLA_FLAGS"] = flags.strip()

project = "jaxrec"
author = "jaxrec authors"
copyright = "2026, jaxrec authors"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.doctest",
    "sphinx.ext.viewcode",
]

source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]

myst_enable_extensions = ["colon_fence", "deflist"]
# Anchors for headings down to ####, so pages link to each other's sections.
myst_heading_anchors = 4

autodoc_default_options = {"members": True, "member-order": "bysource"}
autodoc_typehints = "description"
autodoc_class_signature = "separated"
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "furo"
html_title = "jaxrec"

# The doctest builder runs the pages' {testcode}/{testoutput} and {doctest} blocks, with
# JAX on the CPU. The docstrings' ">>>" examples are illustrations (most use names from
# the surrounding text), so plain doctest blocks are not run.
doctest_test_doctest_blocks = ""

# Attributes sections as fields of their class, not as attribute entries that would
# collide with autodoc's entries for the same NamedTuple fields.
napoleon_use_ivar = True

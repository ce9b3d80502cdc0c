"""Builds jaxrec's optional C++ CPU kernels (``jaxrec/cpu/_kernels``).

Everything else about the package is in ``pyproject.toml``. The extension is
optional: if the compiler is missing or the build fails, ``pip install`` still
succeeds (with a printed warning) and jaxrec runs its XLA path on CPU, warning
once at run time with the reason. ``JAXREC_CPU_MARCH`` sets ``-march=``
(default ``native``: the kernels are built on the machine that runs them; set
e.g. ``x86-64-v3`` for a portable build, or ``none`` to pass no ``-march``).
``JAXREC_CPU_NO_BUILD=1`` skips the extension.
"""

import glob
import os

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class OptionalBuildExt(build_ext):
    """``build_ext`` that never fails the install."""

    def run(self):
        try:
            super().run()
        except Exception as e:  # noqa: BLE001  (any failure: fall back to XLA)
            self.warn(f"jaxrec: C++ CPU kernels not built ({e}); jaxrec will use XLA on CPU")

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as e:  # noqa: BLE001
            self.warn(f"jaxrec: C++ CPU kernels not built ({e}); jaxrec will use XLA on CPU")


def _extensions():
    if os.environ.get("JAXREC_CPU_NO_BUILD") == "1":
        return []
    march = os.environ.get("JAXREC_CPU_MARCH", "native")
    headers = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "include")
    flags = [
        "-isystem",
        headers,
        "-O3",
        "-std=c++17",
        "-fvisibility=hidden",
        "-ffp-contract=off",
        "-pthread",
    ]
    if march != "none":
        flags.append(f"-march={march}")
    return [
        Extension(
            "jaxrec.cpu._kernels",
            sources=["csrc/jaxrec_cpu.cc"],
            depends=sorted(glob.glob("csrc/jaxrec_cpu/*.h")),
            language="c++",
            extra_compile_args=flags,
            extra_link_args=["-pthread"],
            optional=True,
        )
    ]


setup(ext_modules=_extensions(), cmdclass={"build_ext": OptionalBuildExt})

"""``jaxrec.pallas.triton_backend``: jaxrec on a JAX whose Pallas has no Triton backend.

JAX 0.11 deprecates Pallas's Triton backend. Without it, ``import jaxrec``
must work, every lookup must run XLA where a kernel would have run, and one
``PallasBackendWarning`` must say so (no_triton_worker.py, in processes of
their own).
"""

import os
import sys
from pathlib import Path

import pytest
from processes import run_processes

from jaxrec import pallas
from jaxrec.pallas import triton_backend

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("no_triton_worker.py")


def test_this_jax_has_triton():
    assert pallas.available(), pallas.unavailable_reason()
    assert pallas.unavailable_reason() is None
    triton_backend.require()  # no error


def test_without_triton_lookups_run_xla_and_warn_once():
    """Both ways JAX's removal can look: the module is gone, or it no longer lowers."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    modes = ("module", "lowering")
    codes, outputs = run_processes(
        [[sys.executable, str(WORKER), mode] for mode in modes], env, timeout_s=120
    )
    for mode, code, out in zip(modes, codes, outputs, strict=True):
        assert code == 0 and out.strip().endswith("ok"), f"{mode}: exited {code}\n{out[-4000:]}"


def test_stand_in_names_the_missing_module():
    stand_in = triton_backend._Missing()
    with pytest.raises(pallas.TritonUnavailableError, match="pallas.triton.load"):
        stand_in.load  # noqa: B018
    assert not hasattr(stand_in, "__wrapped__")  # introspection sees a plain object

"""The extension's host functions (jaxrec.cache's passes): a stale build is not used."""

import logging

import pytest

from jaxrec.cpu import loader

_kernels = pytest.importorskip("jaxrec.cpu._kernels", reason="the C++ extension is not built")


def test_stale_build_falls_back_with_a_log(monkeypatch, caplog):
    """A build whose cache functions take other arguments (another ``cache_api``) is
    not handed out: ``jaxrec.cache`` then runs its numpy passes, and the log says why
    and how to rebuild. The current build is handed out silently."""
    with caplog.at_level(logging.WARNING, logger="jaxrec"):
        assert loader.host_functions() is _kernels
    assert not caplog.records
    monkeypatch.setattr(_kernels, "info", lambda: {"cache_api": loader.CACHE_API - 1})
    with caplog.at_level(logging.WARNING, logger="jaxrec"):
        assert loader.host_functions() is None
    assert "stale" in caplog.text and "pip install -e ." in caplog.text

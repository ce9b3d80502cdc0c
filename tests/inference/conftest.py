"""One small exported DLRM for the serving, fuzz and integrity tests (exporting
takes seconds; they only read it, or copy it before editing)."""

import pytest
from export_cases import make_batch, make_model

from jaxrec.inference import export


@pytest.fixture(scope="session")
def dlrm_artifact(tmp_path_factory):
    path = tmp_path_factory.mktemp("shared_artifact") / "dlrm"
    dense, kjt, _ = make_batch(4)
    export(make_model(), (dense, kjt), path)
    return path

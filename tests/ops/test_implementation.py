"""The typed ``implementation`` choice: one type, every value documented where it is taken."""

import inspect
import typing

import pytest

from jaxrec.inference import quant_ops
from jaxrec.ops import IMPLEMENTATIONS, Implementation, dispatch, grouped, pooled, single

# Modules whose public functions take ``implementation=``.
MODULES = [dispatch, grouped, pooled, single, quant_ops]


def test_the_type_and_the_checked_values_agree():
    literal, none = typing.get_args(Implementation)
    assert none is type(None)
    assert set(IMPLEMENTATIONS) == {None, *typing.get_args(literal)}


def test_an_unknown_implementation_names_the_choices():
    with pytest.raises(ValueError, match=r"'cpu', 'mosaic_gpu'\), got 'gpu'"):
        dispatch.dispatch("embedding_bag", "gpu", lambda: None)


def _takers():
    for module in MODULES:
        for name, fn in vars(module).items():
            if (
                inspect.isfunction(fn)
                and fn.__module__ == module.__name__
                and not name.startswith("_")
                and "implementation" in inspect.signature(fn).parameters
            ):
                yield f"{module.__name__}.{name}", fn


@pytest.mark.parametrize("name, fn", list(_takers()), ids=lambda x: x if isinstance(x, str) else "")
def test_every_taker_is_typed_and_documents_every_value(name, fn):
    param = inspect.signature(fn).parameters["implementation"]
    assert param.annotation in ("Implementation", Implementation), (name, param.annotation)
    doc = inspect.getdoc(fn) or ""
    values = ("``None``", '``"xla"``', '``"pallas"``', '``"cpu"``', '``"mosaic_gpu"``')
    missing = [v for v in values if v not in doc]
    assert not missing, f"{name}'s docstring does not list {missing}"

"""``jaxrec.cache.errors.with_state``: an error handed back with a state keeps its type,
message, notes, attributes and cause, and is a ``StateHandedBack`` besides."""

import pickle

import pytest

import jaxrec.cache as jc
from jaxrec.cache.errors import with_state
from jaxrec.train.guard import BoundsCheckError


def raised(err: Exception) -> Exception:
    """``err`` as raised while handling a KeyError (its context)."""
    try:
        try:
            raise KeyError("first")
        except KeyError:
            raise err  # noqa: B904
    except Exception as e:
        return e


@pytest.mark.parametrize(
    "err",
    [
        TypeError("bad labels"),
        RuntimeError("no move"),
        Exception("plain"),
        BoundsCheckError({"t": (2, 9)}, "unchanged"),
    ],
    ids=["TypeError", "RuntimeError", "Exception", "BoundsCheckError"],
)
def test_the_copy_keeps_type_message_notes_attributes_and_cause(err):
    err = raised(err)
    err.add_note("a note")
    got = with_state(err, "loaded")
    assert isinstance(got, type(err)) and isinstance(got, jc.StateHandedBack)
    assert type(got).__name__ == type(err).__name__ and repr(got) == repr(err)
    assert str(got) == str(err) and got.__notes__ == ["a note"]
    assert got.state == "loaded" and got.__traceback__ is err.__traceback__
    assert isinstance(got.__cause__, KeyError) and got.__suppress_context__  # shown once
    if isinstance(err, BoundsCheckError):
        assert got.failures == err.failures  # its own attributes
    with pytest.raises(type(err), match="^" + str(err)[:12]):
        raise got
    assert with_state(got, "again") is got and got.state == "again"


def test_pickled_as_the_original_type():
    got = with_state(TypeError("bad"), "loaded")
    back = pickle.loads(pickle.dumps(got))
    assert type(back) is TypeError and str(back) == "bad" and back.state == "loaded"


def test_an_error_whose_copy_would_change_its_message_carries_the_state_itself():
    err = FileNotFoundError(2, "No such file", "/some/path")  # the filename is not in args
    assert with_state(err, "loaded") is err and err.state == "loaded"

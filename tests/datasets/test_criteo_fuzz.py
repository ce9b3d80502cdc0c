"""Property test of the Criteo TSV parser against a plain-Python reference parser.

Random files mix valid lines with wrong field counts, non-UTF-8 / non-ASCII
bytes, bad labels, dense values that are huge, negative, empty or not
integers, and hex categoricals of any length. ``on_error="raise"`` must give the
reference's parse of a valid file, or ``CriteoParseError`` naming the file and
the first bad line; ``on_error="skip"`` must give the valid lines and count the
others.
"""

import string

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from jaxrec.datasets import CriteoParseError, ParseStats, read_criteo_tsv

INT64 = (-(2**63), 2**63 - 1)


def reference_parse(raw: bytes):
    """``(label, dense, sparse)`` of one line, or None when the line is malformed.

    The format: ASCII; 40 tab-separated fields; label ``0``, ``1`` or empty;
    13 dense fields ``-?[0-9]+`` or empty; 26 categoricals of hex digits or
    empty; every value in int64; an empty field is 0; trailing CR/LF ignored.
    """
    try:
        text = raw.decode("ascii").rstrip("\r\n")
    except UnicodeDecodeError:
        return None
    fields = text.split("\t")
    if len(fields) != 40 or fields[0] not in ("", "0", "1"):
        return None
    dense = []
    for x in fields[1:14]:
        digits = x[1:] if x.startswith("-") else x
        if x and not (digits and all(c in string.digits for c in digits)):
            return None
        dense.append(int(x or "0"))
    sparse = []
    for x in fields[14:]:
        if not all(c in string.hexdigits for c in x):
            return None
        sparse.append(int(x or "0", 16))
    if not all(INT64[0] <= v <= INT64[1] for v in dense + sparse):
        return None
    return int(fields[0] or "0"), dense, sparse


good_dense = st.one_of(st.just(""), st.integers(-5, 1000).map(str), st.integers(*INT64).map(str))
bad_dense = st.sampled_from(
    [" 5", "+3", "1_0", "-", "1.5", "\u0661", "0x10", str(2**63), str(-(2**63) - 1), "5 "]
)
good_cat = st.one_of(
    st.just(""),
    st.integers(0, 2**63 - 1).map(lambda v: f"{v:x}"),
    st.text("0123456789abcdefABCDEF", min_size=1, max_size=16),  # odd lengths; some overflow
)
bad_cat = st.sampled_from(["0x1f", "g", "-1f", "1_f", "8" + "0" * 15, "f" * 17, " a"])
mutation = st.one_of(
    st.tuples(st.just("label"), st.sampled_from(["2", "-1", "x", "01", " 1"])),
    st.tuples(st.just("dense"), st.integers(0, 12), bad_dense),
    st.tuples(st.just("cat"), st.integers(0, 25), bad_cat),
    st.tuples(st.just("drop"), st.integers(0, 39)),
    st.tuples(st.just("extra"), st.sampled_from(["", "1", "ab"])),
    st.tuples(
        st.just("byte"), st.integers(0, 200), st.sampled_from([b"\xff", b"\x80", b"\xc3\xa9"])
    ),
)


@st.composite
def lines(draw):
    fields = [draw(st.sampled_from(["0", "1", ""]))]
    fields += [draw(good_dense) for _ in range(13)] + [draw(good_cat) for _ in range(26)]
    change = draw(st.one_of(st.none(), st.none(), mutation))
    extra_byte = None
    if change is not None:
        kind = change[0]
        if kind == "label":
            fields[0] = change[1]
        elif kind == "dense":
            fields[1 + change[1]] = change[2]
        elif kind == "cat":
            fields[14 + change[1]] = change[2]
        elif kind == "drop":
            del fields[change[1]]
        elif kind == "extra":
            fields.append(change[1])
        else:
            extra_byte = change[1:]
    raw = "\t".join(fields).encode("utf-8")
    if extra_byte is not None:
        at = extra_byte[0] % (len(raw) + 1)
        raw = raw[:at] + extra_byte[1] + raw[at:]
    return raw + draw(st.sampled_from([b"\n", b"\r\n"]))


@settings(
    max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.lists(lines(), min_size=1, max_size=12),
    st.booleans(),
    st.integers(1, 5),
)
def test_parser_matches_reference(tmp_path, raw_lines, last_newline, chunk_rows):
    if not last_newline:
        raw_lines[-1] = raw_lines[-1].rstrip(b"\r\n")
    path = tmp_path / "day_0"
    path.write_bytes(b"".join(raw_lines))
    ref = [reference_parse(x) for x in raw_lines]
    good = [r for r in ref if r is not None]
    bad_lines = [i + 1 for i, r in enumerate(ref) if r is None]
    event("every line valid" if not bad_lines else "some line malformed")

    if bad_lines:
        with pytest.raises(CriteoParseError, match=rf"day_0:{bad_lines[0]}: "):
            read_criteo_tsv(path, chunk_rows=chunk_rows)
    else:
        labels, dense, sparse = read_criteo_tsv(path, chunk_rows=chunk_rows)
        assert labels.tolist() == [r[0] for r in good]
        assert dense.tolist() == [r[1] for r in good]
        assert sparse.tolist() == [r[2] for r in good]

    stats = ParseStats()
    if not good:
        with pytest.raises(CriteoParseError, match=r"day_0: no valid lines"):
            read_criteo_tsv(path, chunk_rows=chunk_rows, on_error="skip", stats=stats)
    else:
        labels, dense, sparse = read_criteo_tsv(
            path, chunk_rows=chunk_rows, on_error="skip", stats=stats
        )
        assert labels.tolist() == [r[0] for r in good]
        assert dense.tolist() == [r[1] for r in good]
        assert sparse.tolist() == [r[2] for r in good]
    assert (stats.lines, stats.skipped) == (len(raw_lines), len(bad_lines))
    assert [e.split(": ")[0] for e in stats.examples] == [f"{path}:{i}" for i in bad_lines[:5]]

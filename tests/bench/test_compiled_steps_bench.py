"""bench/compiled_steps.py: a dumped program carries no source locations; programs that
differ only in those compare equal; one changed instruction, or a missing program, is
reported (exit 1); an unknown program name is refused."""

import json
import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "compiled_steps.py")

HLO = """HloModule jit__step, is_scheduled=true

FileNames
1 "{root}/jaxrec/train/step.py"

StackFrames
1 {{file_location_id=1 parent_frame_id=0}}

%fused_add (p0: f32[4], p1: f32[4]) -> f32[4] {{
  %p0 = f32[4]{{0}} parameter(0)
  %p1 = f32[4]{{0}} parameter(1)
  ROOT %add = f32[4]{{0}} {op}(%p0, %p1), {meta}, stack_frame_id=1
}}

ENTRY %main (a: f32[4], b: f32[4]) -> f32[4] {{
  ROOT %f = f32[4]{{0}} fusion(%a, %b), kind=kLoop, calls=%fused_add
}}
"""
META = 'metadata={{op_name="add" source_file="{root}/a.py" source_line={line}}}'


def _hlo(root, op, line):
    return HLO.format(root=root, op=op, meta=META.format(root=root, line=line))


def _compare(tmp_path, a_files, b_files):
    for name, files in (("a", a_files), ("b", b_files)):
        (tmp_path / name).mkdir()
        for fname, text in files.items():
            (tmp_path / name / fname).write_text(text)
    cmd = [sys.executable, BENCH, "--compare", str(tmp_path / "a"), str(tmp_path / "b")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    return res.returncode, [json.loads(x) for x in res.stdout.splitlines()]


def test_source_locations_do_not_count(tmp_path):
    a = _hlo("/work/base", "add", 10)
    b = _hlo("/work/head", "add", 97)
    rc, rows = _compare(tmp_path, {"p.hlo": a}, {"p.hlo": b})
    assert rc == 0 and rows == [{"program": "p.hlo", "lines": [10, 10], "lines_differ": 0}]


def test_a_changed_instruction_or_a_missing_program_is_reported(tmp_path):
    a = _hlo("/r", "add", 1)
    b = _hlo("/r", "multiply", 1)
    rc, rows = _compare(tmp_path, {"p.hlo": a, "q.hlo": a}, {"p.hlo": b})
    assert rc == 1
    assert rows[0] == {"program": "p.hlo", "lines": [10, 10], "lines_differ": 1}
    assert rows[1]["program"] == "q.hlo" and rows[1]["missing_in"].endswith("b")


def test_dump_writes_the_program_without_source_locations(tmp_path):
    cmd = [sys.executable, BENCH, "--dump", str(tmp_path), "--only", "ebc_data_parallel"]
    subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, check=True)
    assert [p.name for p in tmp_path.iterdir()] == ["ebc_data_parallel.hlo"]
    text = (tmp_path / "ebc_data_parallel.hlo").read_text()
    assert text.startswith("HloModule") and "ENTRY" in text and "all-reduce" in text
    assert "metadata=" not in text and "FileNames" not in text and ".py" not in text


def test_an_unknown_program_is_refused(tmp_path):
    cmd = [sys.executable, BENCH, "--dump", str(tmp_path), "--only", "ebc_row_wise,ebc_nope"]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode != 0 and "unknown ['ebc_nope']" in res.stderr
    assert not list(tmp_path.iterdir())  # refused before anything is written

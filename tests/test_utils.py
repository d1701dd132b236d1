"""Tests for embedtrain.utils: the helpers the generators, the data jobs and the planner share."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from embedtrain.utils import first_line, is_int, natural_key, phase_bar, progress_bar


@pytest.mark.parametrize("value, least, ok", [
    (3, None, True), (0, None, True), (-4, None, True), (np.int64(7), None, True),
    (np.uint8(2), None, True), (True, None, False), (np.bool_(True), None, False),
    (3.0, None, False), (np.float64(3), None, False), ("3", None, False), (None, None, False),
    (2, 2, True), (1, 2, False), (np.int32(5), 5, True), (True, 0, False), (False, 0, False),
])
def test_is_int(value, least, ok):
    assert is_int(value, least=least) is ok


def test_natural_key_orders_numbers_as_numbers():
    names = ["day_10.tsv", "day_2.tsv", "day_1.tsv", "t_C10", "t_C2", "a"]
    assert sorted(names, key=natural_key) == [
        "a", "day_1.tsv", "day_2.tsv", "day_10.tsv", "t_C2", "t_C10"]
    paths = [Path("raw/part-10.parquet"), Path("raw/part-9.parquet")]
    assert sorted(paths, key=natural_key) == paths[::-1]
    assert natural_key(Path("x/a12b")) == natural_key("x/a12b") == ["x/a", 12, "b"]


def test_first_line():
    assert first_line(ValueError("  bad value\nTraceback detail\n")) == "bad value"
    assert first_line(KeyError()) == "KeyError"
    assert first_line(OSError("")) == "OSError"


def test_progress_bars_write_to_stderr_unless_disabled(capsys):
    with progress_bar(10, "job") as bar:
        bar.update(10)
    with phase_bar(None, "phased") as bar:
        bar.set_postfix_str("last", refresh=False)
        bar.update()
    with progress_bar(10, "quiet", disable=True) as bar:
        bar.update(10)
    out, err = capsys.readouterr()
    lines = [line.split("\r")[-1] for line in err.rstrip("\n").split("\n")]  # final redraws
    assert out == "" and len(lines) == 2
    assert lines[0].startswith("job: 100%|") and " 10/10 [" in lines[0]
    assert lines[0].endswith(" rows/s]")
    assert lines[1].startswith("phased: 1 phases [") and lines[1].endswith("], last")


def test_imports_nothing_of_embedtrain():
    code = ("import sys, embedtrain.utils; "
            "bad = sorted(m for m in sys.modules if m.startswith('embedtrain') "
            "and m not in ('embedtrain', 'embedtrain.utils', 'embedtrain.fbgemm_cpu')); "
            "assert not bad, bad; "
            "assert 'numpy' not in sys.modules and 'torch' not in sys.modules")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]

"""``bench_retrieval.py --als-grid``: the ALS settings a run tries, parsed or refused in one line."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_retrieval import ALS_GRID, parse_als_grid  # noqa: E402


def test_als_grid_parses_factors_regularisation_alpha():
    assert parse_als_grid("128:1:40,256:0.1:10") == [(128, 1.0, 40.0), (256, 0.1, 10.0)]
    assert len(ALS_GRID) == 18 and (256, 1.0, 40.0) in ALS_GRID


@pytest.mark.parametrize("bad", ["128:1", "x:1:40", "128:1:40:2", "128:1:40,"])
def test_a_bad_als_grid_is_one_line(bad):
    with pytest.raises(SystemExit, match=r"^--als-grid: .* is not FACTORS:REG:ALPHA$"):
        parse_als_grid(bad)

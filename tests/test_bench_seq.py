"""The baselines of ``benchmarks/bench_seq.py`` (popularity, item-to-item co-occurrence) against
a brute-force ranking of every item."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_seq import (  # noqa: E402
    figures, ranks_by_cooccurrence, ranks_by_popularity, with_targets)


def _rank(scores: np.ndarray, target: int) -> int:
    """1-based rank of ``target`` among items 1..V: higher score first, then lower id."""
    order = sorted(range(1, len(scores)), key=lambda j: (-scores[j], j))
    return order.index(target) + 1


def test_baseline_ranks_equal_brute_force():
    rng = np.random.default_rng(0)
    v = 40
    lengths = rng.integers(1, 12, 300)
    t_items = np.minimum(rng.zipf(1.4, lengths.sum()), v).astype(np.int64)
    t_off = np.concatenate([[0], np.cumsum(lengths)])
    pop = np.bincount(t_items, minlength=v + 1).astype(np.int64)
    pop[0] = 0
    e_len = rng.integers(1, 6, 200)
    e_items = np.minimum(rng.zipf(1.4, e_len.sum()), v).astype(np.int64)
    e_off = np.concatenate([[0], np.cumsum(e_len)])
    targets = rng.integers(1, v + 1, 200)
    pairs = np.zeros((v + 1, v + 1), np.int64)
    for r in range(len(lengths)):
        seq = t_items[t_off[r]:t_off[r + 1]]
        for a, b in zip(seq[:-1], seq[1:]):
            pairs[a, b] += 1
    got_pop = ranks_by_popularity(pop, targets)
    got_co = ranks_by_cooccurrence((t_off, t_items, None), pop, e_off, e_items, targets)
    pop_rank = np.array([0] + [_rank(pop.astype(float), j) for j in range(1, v + 1)])
    for r, t in enumerate(targets):
        assert got_pop[r] == _rank(pop.astype(float), t)
        last = e_items[e_off[r + 1] - 1]
        # co-occurrence count first, then popularity (rank), then id
        score = pairs[last] * 1e6 - pop_rank
        score[0] = -np.inf
        assert got_co[r] == _rank(score, t), r
    f = figures(np.array([1, 3, 11]), k=10)
    assert f["hr@10"] == 2 / 3 and np.isclose(f["mrr"], (1 + 1 / 3 + 1 / 11) / 3)
    assert np.isclose(f["ndcg@10"], (1 + 1 / np.log2(4)) / 3)


def test_with_targets_appends_each_rows_target():
    offsets, items = with_targets(np.array([0, 2, 2, 5]), np.array([1, 2, 3, 4, 5]),
                                  np.array([7, 8, 9]))
    assert offsets.tolist() == [0, 3, 4, 8] and items.tolist() == [1, 2, 7, 8, 3, 4, 5, 9]


def test_bounds_script(tmp_path, monkeypatch, capsys):
    """``bench_seq_bounds.py``: its oracle is the planted model's (the metadata's HR@10 when no
    history is truncated), its co-occurrence is ``bench_seq.py``'s on the same rows, and the
    known-structure ranking, which counts the successors, lies between the two on a set with
    few events an item."""
    import json

    import bench_seq_bounds
    from embedtrain.datagen import SeqDataSpec, generate_seq

    small, more = tmp_path / "small", tmp_path / "more"
    kw = dict(items=300, clusters=10, max_length=200, mean_extra_events=10.0, seed=4)
    meta = generate_seq(SeqDataSpec(users=1500, **kw), small, progress=False)
    generate_seq(SeqDataSpec(users=6000, **kw), more, progress=False)
    out = tmp_path / "bounds.json"
    argv = ["bench_seq_bounds.py", "--data", str(small), "--more", str(more), "--rows", "1500",
            "--json", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    assert bench_seq_bounds.main() == 0
    record = json.loads(out.read_text())
    assert abs(record["oracle"]["hr@10"] - meta["oracle_hr@10"]["test"]) < 0.005
    train = with_targets(*bench_seq_bounds.read_split(small, meta, "train"))
    offsets, items, targets = bench_seq_bounds.read_split(small, meta, "test")
    pop = np.bincount(train[1], minlength=meta["num_items"]).astype(np.int64)
    pop[0] = 0
    expected = figures(ranks_by_cooccurrence((*train, None), pop, offsets, items, targets))
    assert record["cooccurrence"] == expected
    assert record["cooccurrence_more_data"]["hr@10"] > expected["hr@10"]
    assert expected["hr@10"] < record["known_structure"]["hr@10"] < record["oracle"]["hr@10"]
    assert record["oracle_last_item"]["hr@10"] < record["oracle"]["hr@10"]
    other = tmp_path / "other"
    generate_seq(SeqDataSpec(users=100, **{**kw, "seed": 5}), other, progress=False)
    monkeypatch.setattr(sys, "argv", argv[:4] + [str(other)] + argv[5:])
    with pytest.raises(SystemExit, match="another planted model than .* \\(seed\\)"):
        bench_seq_bounds.main()

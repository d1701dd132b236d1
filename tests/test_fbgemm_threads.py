"""``embedtrain.fbgemm_threads``: a CPU TBE's backward with the fused row-wise Adagrad, cut into
runs of whole tables on worker threads, leaves the pooled rows, weights and Adagrad state bit
for bit as FBGEMM's own single-thread step does; shared tables and weighted ids keep FBGEMM's
path; a run trained with the threads is the run trained without (the speed is in
``benchmarks/bench_roofline.py``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from embedtrain import fbgemm_threads  # first: FBGEMM binds as embedtrain/fbgemm_cpu.py says
from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    ComputeDevice, EmbeddingLocation, OptimType, SplitTableBatchedEmbeddingBagsCodegen)

RUN_ALL = fbgemm_threads._run_all
# rows, dim of each table: dims differ, so a run's column offsets into the output gradient matter
TABLES = [(500, 8), (2000, 16), (300, 8), (1000, 4), (50, 16), (4000, 8)]


def _tbe(feature_table_map=None, pooling=PoolingMode.SUM) -> torch.nn.Module:
    torch.manual_seed(0)
    return SplitTableBatchedEmbeddingBagsCodegen(
        [(rows, dim, EmbeddingLocation.HOST, ComputeDevice.CPU) for rows, dim in TABLES],
        feature_table_map=feature_table_map, optimizer=OptimType.EXACT_ROWWISE_ADAGRAD,
        learning_rate=0.05, eps=1e-4, pooling_mode=pooling)


def _batches(features: list[int], steps: int = 4, batch: int = 64, weighted: bool = False):
    """Multi-hot bags (0-4 ids, repeats within a bag and a batch) of each feature's table."""
    rng = np.random.default_rng(1)
    dim = sum(TABLES[t][1] for t in features)
    out = []
    for _ in range(steps):
        lengths = rng.integers(0, 5, size=len(features) * batch)
        ids = np.concatenate([rng.zipf(1.3, size=lengths[f * batch:(f + 1) * batch].sum())
                              % TABLES[t][0] for f, t in enumerate(features)])
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        weights = torch.rand(len(ids)) if weighted else None
        out.append((torch.from_numpy(ids).long(), torch.from_numpy(offsets).long(), weights,
                    torch.randn(batch, dim)))
    return out


def _train(monkeypatch, threads: str, features: list[int], **kw):
    """Trains a fresh TBE on :func:`_batches`; its outputs, weights, momentum and the number of
    backward steps that ran over threads."""
    monkeypatch.setenv(fbgemm_threads.ENV, threads)
    runs = []
    monkeypatch.setattr(fbgemm_threads, "_run_all", lambda calls: runs.append(len(calls))
                        or RUN_ALL(calls))
    fbgemm_threads.install()
    tbe = _tbe(feature_table_map=None if features == list(range(len(TABLES))) else features,
               pooling=kw.get("pooling", PoolingMode.SUM))
    outputs = []
    for ids, offsets, weights, grad in _batches(features, weighted=kw.get("weighted", False)):
        pooled = tbe(ids, offsets, per_sample_weights=weights)
        pooled.backward(grad)
        outputs.append(pooled.detach().clone())
    return outputs, tbe.weights_host.detach().clone(), tbe.momentum1_host.detach().clone(), runs


def _same(a, b) -> None:
    assert len(a[0]) == len(b[0])
    for x, y in zip(a[0], b[0]):
        assert torch.equal(x, y)
    assert torch.equal(a[1], b[1]), "weights differ"
    assert torch.equal(a[2], b[2]), "Adagrad state differs"


@pytest.mark.parametrize("threads", ["2", "3"])
@pytest.mark.parametrize("pooling", [PoolingMode.SUM, PoolingMode.MEAN])
def test_the_threaded_step_is_fbgemms_bit_for_bit(monkeypatch, threads, pooling):
    features = list(range(len(TABLES)))
    own = _train(monkeypatch, "1", features, pooling=pooling)
    threaded = _train(monkeypatch, threads, features, pooling=pooling)
    assert own[3] == [] and threaded[3] == [int(threads)] * 4  # every backward over threads
    _same(own, threaded)


def test_a_table_read_by_several_features_stays_in_one_run(monkeypatch):
    shared = [0, 0, 1, 2, 2, 2, 3, 4, 5]  # tables 0 and 2 read by 2 and 3 features
    own, threaded = (_train(monkeypatch, t, shared) for t in ("1", "3"))
    assert threaded[3] == [3] * 4
    _same(own, threaded)


def test_weighted_ids_keep_fbgemms_path(monkeypatch):
    features = list(range(len(TABLES)))
    own, threaded = (_train(monkeypatch, t, features, weighted=True) for t in ("1", "2"))
    assert threaded[3] == []
    _same(own, threaded)


def test_features_are_cut_at_table_starts_into_balanced_runs():
    cut = fbgemm_threads.split_features
    assert cut([10, 10, 10, 10, 10, 10], [True] * 6, 3) == [0, 2, 4, 6]
    assert cut([30, 1, 1, 1, 1, 26], [True] * 6, 2) == [0, 1, 6]
    # a table of features 1-3 is never cut
    assert cut([5, 10, 10, 10, 15], [True, True, False, False, True], 2) == [0, 4, 5]
    assert cut([0, 0, 7], [True] * 3, 2) == [0, 3]  # a run of no ids is no run
    assert cut([1, 1], [True, True], 4) == [0, 1, 2]


def test_a_bad_thread_count_is_one_line(monkeypatch):
    monkeypatch.setenv(fbgemm_threads.ENV, "two")
    with pytest.raises(ValueError, match="EMBEDTRAIN_TBE_THREADS='two': expected a positive"):
        fbgemm_threads.max_threads()


def test_a_forked_child_steps_over_threads_of_its_own(monkeypatch):
    """A process forked after a threaded step (a worker pool started) gets a pool of its own:
    the parent's worker threads do not exist in the child, and a pool counting them would wait
    forever for the first backward."""
    import os

    features = list(range(len(TABLES)))
    expected = _train(monkeypatch, "2", features)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: train again, say whether the result is the parent's
        try:
            # GNU OpenMP's thread pool does not survive a fork: a torch parallel region in the
            # child would hang whatever embedtrain does (DataLoader workers take 1 thread too)
            torch.set_num_threads(1)
            got = _train(monkeypatch, "2", features)
            ok = got[3] == [2] * 4 and torch.equal(got[1], expected[1])
            os.write(write, b"1" if ok else b"0")
        finally:
            os._exit(0)
    os.close(write)
    import select

    ready, _, _ = select.select([read], [], [], 60)
    answer = os.read(read, 1) if ready else b"timeout"
    if not ready:
        os.kill(pid, 9)
    os.waitpid(pid, 0)
    os.close(read)
    assert answer == b"1"


@pytest.mark.slow
def test_a_run_trained_over_threads_is_the_run_without(tmp_path, monkeypatch):
    import embedtrain as et
    from embedtrain.testing import tiny_ctr_dataset

    data = tiny_ctr_dataset(tmp_path / "data", rows=2000)
    metrics, runs = [], []
    monkeypatch.setattr(fbgemm_threads, "_run_all", lambda calls: runs.append(len(calls))
                        or RUN_ALL(calls))
    for threads in ("1", "2"):
        monkeypatch.setenv(fbgemm_threads.ENV, threads)
        cfg = et.from_dict(et.Config, {
            "data": {"path": str(data), "batch_size": 256, "num_workers": 0},
            "model": {"embedding_dim": 8, "bottom_mlp": [8, 8], "top_mlp": [8, 1]},
            "train": {"max_steps": 5, "eval_every": 0, "progress": False}})
        et.fit(cfg, tmp_path / f"run{threads}")
        metrics.append(et.evaluate(tmp_path / f"run{threads}", split="valid"))
    assert runs == [2] * 5  # the sharded tables' backward ran over threads in the second run
    assert metrics[0] == metrics[1]

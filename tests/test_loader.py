"""The streaming loader: ranks x workers partitioning, determinism, resume, shutdown, errors."""

import gc
import subprocess
import sys
import textwrap
import threading
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from embedtrain.data.prefetch import IdleReadAhead, OrderedPrefetcher
from embedtrain.data.reader import DataError, LastBatch, ParquetBatchReader
from embedtrain.features import DenseTransform, FeatureSpec
from embedtrain.testing import random_ctr_table, write_parquet


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """1,000 rows in two files, 16 row groups of uneven sizes (the last of each file is short)."""
    root = tmp_path_factory.mktemp("loader")
    table, spec = random_ctr_table(rows=1000, seed=7)
    files = [write_parquet(table.slice(0, 430), root / "a.parquet", row_group_size=64),
             write_parquet(table.slice(430), root / "b.parquet", row_group_size=64)]
    return files, spec, table


def keys(batch) -> list[float]:
    """Rows are identified by their (unique, random) first dense value."""
    return batch.dense_features[:, 0].tolist()


def same(a, b) -> bool:
    return (torch.equal(a.dense_features, b.dense_features) and torch.equal(a.labels, b.labels)
            and torch.equal(a.sparse_features.values(), b.sparse_features.values())
            and torch.equal(a.sparse_features.lengths(), b.sparse_features.lengths()))


def new_threads(before: set) -> set:
    """Threads alive now that were not alive at ``before`` (other tests' threads may come and go)."""
    return {t for t in threading.enumerate() if t not in before}


def wait_for_threads(before: set, within_s: float = 5.0) -> set:
    """Waits until the threads started since ``before`` have ended; returns those still alive."""
    deadline = time.monotonic() + within_s
    while new_threads(before) and time.monotonic() < deadline:
        time.sleep(0.01)
    return new_threads(before)


@pytest.mark.parametrize("num_workers", [1, 2, 3])
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_each_row_exactly_once_over_ranks_and_workers(dataset, world_size, num_workers):
    files, spec, table = dataset
    seen = []
    for rank in range(world_size):
        reader = ParquetBatchReader(files, spec, 50, shuffle=True, seed=1, shuffle_buffer_rows=150,
                                    rank=rank, world_size=world_size, num_workers=num_workers,
                                    last_batch=LastBatch.KEEP)
        batches = list(reader.iter_epoch(3))
        assert len(batches) == len(reader)
        seen += [k for b in batches for k in keys(b)]
    assert len(seen) == 1000 and sorted(seen) == sorted(table.column("d0").to_pylist())


def test_same_seed_and_epoch_give_same_batches_for_any_worker_count(dataset):
    files, spec, _ = dataset
    epoch = lambda w, e: list(ParquetBatchReader(  # noqa: E731
        files, spec, 40, shuffle=True, seed=3, shuffle_buffer_rows=200, num_workers=w,
        prefetch_batches=2).iter_epoch(e))
    reference = epoch(0, 1)
    for w in (1, 2, 3, 3):
        assert all(same(a, b) for a, b in zip(reference, epoch(w, 1), strict=True))
    assert [keys(b) for b in epoch(2, 2)] != [keys(b) for b in reference]
    # Shuffling mixes rows of different row groups inside one batch.
    row_group = {k: i // 64 for i, k in enumerate(dataset[2].column("d0").to_pylist())}
    assert max(len({row_group[k] for k in keys(b)}) for b in reference) > 1


def test_skip_batches_resumes_exactly_with_workers(dataset):
    files, spec, _ = dataset
    reader = ParquetBatchReader(files, spec, 30, shuffle=True, seed=5, shuffle_buffer_rows=100,
                                num_workers=2, last_batch=LastBatch.KEEP)
    full = list(reader.iter_epoch(4))
    for skip in (1, 7, len(full) - 1, len(full)):
        tail = list(reader.iter_epoch(4, skip_batches=skip))
        assert len(tail) == len(full) - skip
        assert all(same(a, b) for a, b in zip(full[skip:], tail))


@pytest.mark.parametrize("shuffle", [False, True])
def test_workers_match_the_synchronous_path(dataset, shuffle):
    files, spec, _ = dataset
    def make(num_workers: int) -> ParquetBatchReader:
        return ParquetBatchReader(files, spec, 64, shuffle=shuffle, num_workers=num_workers)

    sync, threaded = list(make(0)), list(make(2))
    assert len(sync) == len(threaded) == len(make(0))
    assert all(same(a, b) for a, b in zip(sync, threaded, strict=True))
    if not shuffle:  # in file order, batch after batch
        flat = [k for b in sync for k in keys(b)]
        assert flat == [np.float32(v).item() for v in dataset[2].column("d0").to_pylist()]


def test_kjt_carries_consistent_offsets_and_per_key_lengths(dataset):
    files, spec, _ = dataset
    batch = next(iter(ParquetBatchReader(files, spec, 100, shuffle=True, num_workers=1)))
    kjt = batch.sparse_features
    lengths = kjt.lengths().long()
    assert torch.equal(kjt.offsets().long(), torch.cat([torch.zeros(1).long(), lengths.cumsum(0)]))
    assert kjt.stride() == 100
    assert kjt.length_per_key() == lengths.view(len(kjt.keys()), -1).sum(1).tolist()
    assert kjt.offset_per_key()[-1] == kjt.values().numel()


def test_early_stop_ends_the_threads(dataset):
    files, spec, _ = dataset
    reader = ParquetBatchReader(files, spec, 16, shuffle=True, num_workers=3, prefetch_batches=2)
    before = set(threading.enumerate())
    for i, _ in enumerate(reader.iter_epoch(0)):  # what the trainer does at max_steps
        if i == 1:
            break
    assert not wait_for_threads(before)
    it = reader.iter_epoch(1)  # abandoned without being iterated or closed
    next(it)
    assert new_threads(before)
    del it
    gc.collect()
    assert not wait_for_threads(before)


def test_abandoned_iterator_does_not_hang_exit(tmp_path):
    # The prefetcher module alone (no torch import), in a child that exits while threads block.
    script = textwrap.dedent(f"""
        import importlib.util, time
        spec = importlib.util.spec_from_file_location(
            "prefetch", {str(Path(__file__).parents[1] / "embedtrain/data/prefetch.py")!r})
        prefetch = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(prefetch)
        slow = lambda i: (time.sleep(0.01), i)[1]
        kept = prefetch.OrderedPrefetcher(range(10_000), slow, lambda xs: xs, num_workers=2,
                                          max_ready=1)
        print(next(kept))
        # the idle-class read-ahead thread, unclosed and in the middle of a load
        ahead = iter(prefetch.IdleReadAhead(range(10_000), slow, ahead=100))
        print(next(ahead))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=20)
    assert done.returncode == 0 and done.stdout.split() == ["0", "0"], done.stderr


def test_worker_error_is_raised_in_consumer_with_its_message(tmp_path):
    table, spec = random_ctr_table(rows=600)
    s0 = table.column("s0").to_numpy().copy()
    s0[530] = 7  # vocab of s0 is 7; row group 8 of 10
    table = table.set_column(table.schema.get_field_index("s0"), "s0", pa.array(s0))
    f = write_parquet(table, tmp_path / "bad.parquet", row_group_size=64)
    before = set(threading.enumerate())
    reader = ParquetBatchReader([f], spec, 16, shuffle=False, num_workers=3)
    got = []
    message = r"bad.parquet: column s0: id 7 outside \[0, 7\) at row 530$"
    with pytest.raises(DataError, match=message):
        for batch in reader:
            got.append(batch)
    assert len(got) == 512 // 16  # every batch before the bad row group came out first
    assert not wait_for_threads(before)


def test_prefetcher_reraises_the_original_exception():
    def load(i: int) -> int:
        if i == 5:
            raise KeyError(f"item {i}")
        return i

    it = OrderedPrefetcher(range(10), load, lambda xs: (x * 10 for x in xs), num_workers=2)
    assert [next(it) for _ in range(5)] == [0, 10, 20, 30, 40]
    with pytest.raises(KeyError, match="item 5"):
        next(it)
    with pytest.raises(StopIteration):
        next(it)


@pytest.mark.parametrize("world_size", [1, 2])
def test_idle_read_ahead_gives_the_synchronous_batches_and_errors(dataset, tmp_path, world_size):
    files, spec, table = dataset
    def make(read_ahead: bool, rank: int) -> ParquetBatchReader:
        return ParquetBatchReader(files, spec, 30, shuffle=True, seed=2, shuffle_buffer_rows=100,
                                  rank=rank, world_size=world_size, num_workers=0,
                                  read_ahead=read_ahead, last_batch=LastBatch.PAD)
    seen = []
    for rank in range(world_size):
        sync, ahead = make(False, rank), make(True, rank)
        assert ahead.read_ahead and not sync.read_ahead
        got = list(ahead.iter_epoch(1))
        assert all(same(a, b) for a, b in zip(sync.iter_epoch(1), got, strict=True))
        tail = list(ahead.iter_epoch(1, skip_batches=3))
        assert all(same(a, b) for a, b in zip(got[3:], tail, strict=True))
        seen += [k for b in got for k in _real(b)]
    assert sorted(seen) == sorted(table.column("d0").to_pylist())  # every row once

    bad, spec = random_ctr_table(rows=600)
    s0 = bad.column("s0").to_numpy().copy()
    s0[530] = 7
    bad = bad.set_column(bad.schema.get_field_index("s0"), "s0", pa.array(s0))
    f = write_parquet(bad, tmp_path / "bad.parquet", row_group_size=64)
    got = []
    message = r"bad.parquet: column s0: id 7 outside \[0, 7\) at row 530$"
    with pytest.raises(DataError, match=message):
        for batch in ParquetBatchReader([f], spec, 16, num_workers=0, read_ahead=True):
            got.append(batch)
    assert len(got) == 512 // 16


def test_idle_read_ahead_loads_ahead_but_the_consumer_never_waits_for_it():
    by_thread: dict[int, str] = {}

    def load(i: int) -> int:
        by_thread[i] = threading.current_thread().name
        return i * i

    # A consumer slower than the loads: the idle thread has loaded the next item before it is
    # asked for (given up to 10 s of whatever CPU time nothing else wants).
    ahead = IdleReadAhead(range(6), load, ahead=2, name="ahead-test")
    out = []
    for i, value in enumerate(ahead):
        out.append(value)
        deadline = time.monotonic() + 10
        while i + 1 < 6 and ahead._state.done.get(i + 1) is None and time.monotonic() < deadline:
            time.sleep(0.005)
    assert out == [i * i for i in range(6)]
    assert ahead.loaded_ahead >= 5 and by_thread[5] == "ahead-test"  # item 0: either

    # A thread that never gets to finish (a starved one): the consumer loads every item itself,
    # at once, and its errors come out at their position.
    release = threading.Event()

    def stuck(i: int) -> int:
        release.wait(30)
        return -1

    def failing(i: int) -> int:
        if i == 3:
            raise KeyError(f"item {i}")
        return i

    before = set(threading.enumerate())
    starved = IdleReadAhead(range(5), failing, ahead=3, background_load=stuck)
    start, got = time.monotonic(), []
    with pytest.raises(KeyError, match="item 3"):
        for value in starved:
            got.append(value)
    assert time.monotonic() - start < 5  # closing does not wait for the stuck load either
    assert got == [0, 1, 2] and starved.loaded_ahead == 0
    release.set()
    assert not wait_for_threads(before)


def _real(batch) -> list[float]:
    """Keys of the batch's real rows (padding rows come last)."""
    return keys(batch)[: len(batch.labels) - getattr(batch, "padding", 0)]


def _check_padding(batch) -> None:
    """Padding rows: label -1, zero dense features, an empty bag for every sparse feature."""
    pad = getattr(batch, "padding", 0)
    n = len(batch.labels)
    if not pad:
        return
    assert (batch.labels[n - pad:] == -1).all() and (batch.labels[: n - pad] >= 0).all()
    assert (batch.dense_features[n - pad:] == 0).all()
    lengths = batch.sparse_features.lengths().view(len(batch.sparse_features.keys()), n)
    assert (lengths[:, n - pad:] == 0).all()


@pytest.mark.parametrize("world, batch", [(3, 48), (2, 64), (4, 50), (3, 333)])
def test_last_batch_drop_keep_pad(dataset, world, batch):
    """PAD: every row exactly once over the ranks, equal batches everywhere, padding only in the
    last step (at most one row per rank) and marked; KEEP: every row once, ranks may differ in
    length; DROP: only full batches, as many on every rank, the rest counted as dropped."""
    files, spec, table = dataset
    runs = {}
    for mode in LastBatch:
        readers = [ParquetBatchReader(files, spec, batch, rank=rank, world_size=world,
                                      last_batch=mode, num_workers=2) for rank in range(world)]
        runs[mode] = (readers, [list(r) for r in readers])
        for reader, batches in zip(*runs[mode]):
            assert len(batches) == len(reader)
    every = sorted(table.column("d0").to_numpy().astype("float32").tolist())
    readers, keep = runs[LastBatch.KEEP]
    assert sorted(k for batches in keep for b in batches for k in keys(b)) == every
    assert [sum(len(b.labels) for b in batches) for batches in keep] == readers[0].rank_rows
    assert max(readers[0].rank_rows) - min(readers[0].rank_rows) <= 1

    readers, pad = runs[LastBatch.PAD]
    assert len({len(batches) for batches in pad}) == 1  # every rank runs the same steps
    steps = len(pad[0])
    for i in range(steps):  # equal batch sizes across ranks at every step
        sizes = {len(batches[i].labels) for batches in pad}
        assert sizes == ({batch} if i < steps - 1 else sizes) and len(sizes) == 1
    for batches, own in zip(pad, keep):
        assert [k for b in batches for k in _real(b)] == [k for b in own for k in keys(b)]
        assert all(getattr(b, "padding", 0) == 0 for b in batches[:-1])
        _check_padding(batches[-1])
    padding = sum(getattr(batches[-1], "padding", 0) for batches in pad)
    assert padding == (-len(every)) % world  # world - (N mod world) rows, or none
    counted = [readers[0].step_rows(i) for i in range(steps)]
    assert sum(e for e, _ in counted) == len(every) and sum(p for _, p in counted) == padding

    readers, drop = runs[LastBatch.DROP]
    full = min(readers[0].rank_rows) // batch
    for batches, own in zip(drop, keep):
        assert len(batches) == full and all(len(b.labels) == batch for b in batches)
        assert [keys(b) for b in batches] == [keys(b) for b in own[:full]]
    assert readers[0].dropped_rows == len(every) - full * batch * world


def test_pad_reaches_the_same_length_when_shuffled(dataset):
    files, spec, table = dataset
    lengths, seen = set(), []
    readers = [ParquetBatchReader(files, spec, 40, shuffle=True, rank=rank, world_size=3,
                                  last_batch=LastBatch.PAD, num_workers=1) for rank in range(3)]
    for reader in readers:
        batches = list(reader.iter_epoch(2))
        lengths.add(len(batches))
        assert all(b.labels.numel() == 40 for b in batches[:-1])
        assert batches[-1].labels.numel() == max(reader.rank_rows) - 40 * (len(batches) - 1)
        _check_padding(batches[-1])
        seen += [k for b in batches for k in _real(b)]
    assert len(lengths) == 1
    assert sorted(seen) == sorted(table.column("d0").to_numpy().astype("float32").tolist())


def test_rank_with_no_row_left_gets_a_padding_batch(tmp_path):
    """7 rows, 3 ranks, batch 2: shares 3, 2, 2; the step-2 batches hold 1 real row on rank 0
    and none on ranks 1 and 2, which get a one-row padding batch each (equal sizes)."""
    table, spec = random_ctr_table(rows=7)
    f = write_parquet(table, tmp_path / "seven.parquet")
    per_rank = [list(ParquetBatchReader([f], spec, 2, rank=r, world_size=3, num_workers=0,
                                        last_batch=LastBatch.PAD)) for r in range(3)]
    assert [len(b) for b in per_rank] == [2, 2, 2]
    assert [len(b[-1].labels) for b in per_rank] == [1, 1, 1]
    assert [getattr(b[-1], "padding", 0) for b in per_rank] == [0, 1, 1]
    for batches in per_rank:
        _check_padding(batches[-1])
    reader = ParquetBatchReader([f], spec, 2, rank=0, world_size=3, last_batch=LastBatch.PAD)
    assert reader.step_rows(0) == (6, 0) and reader.step_rows(1) == (1, 2)


def test_empty_input_is_an_error_and_rows_split_within_row_groups(tmp_path):
    table, spec = random_ctr_table(rows=100)
    empty = write_parquet(table.slice(0, 0), tmp_path / "empty.parquet")
    with pytest.raises(DataError, match=r"empty.parquet: no rows"):
        ParquetBatchReader([empty], spec, 16)
    one_group = write_parquet(table, tmp_path / "one.parquet")
    # One row group, three ranks: each reads a third of its rows (34, 33, 33), none twice.
    for last in (LastBatch.KEEP, LastBatch.PAD):
        seen = []
        for rank in range(3):
            reader = ParquetBatchReader([empty, one_group], spec, 16, rank=rank, world_size=3,
                                        num_workers=2, last_batch=last)
            batches = list(reader)
            assert len(batches) == len(reader) == 3
            seen.append([x for b in batches for x in _real(b)])
        assert [len(part) for part in seen] == [34, 33, 33]
        assert sorted(x for part in seen for x in part) == sorted(
            table.column("d0").to_numpy().astype("float32").tolist())


def test_list_and_single_columns_must_agree_across_files(tmp_path):
    table, spec = random_ctr_table(rows=100)
    a = write_parquet(table, tmp_path / "a.parquet")
    lists = pa.array([[v] for v in table.column("s0").to_pylist()])
    b = write_parquet(table.set_column(table.schema.get_field_index("s0"), "s0", lists),
                      tmp_path / "b.parquet")
    with pytest.raises(DataError, match=r"b.parquet: column s0: a list column here but a single"):
        ParquetBatchReader([a, b], spec, 16)


def test_bad_id_inside_a_list_is_named_with_row(tmp_path):
    table, spec = random_ctr_table(rows=100)  # s1 is the list feature (vocab 50)
    lists = table.column("s1").to_pylist()
    lists[71] = [1, 50]
    table = table.set_column(table.schema.get_field_index("s1"), "s1", pa.array(lists))
    f = write_parquet(table, tmp_path / "t.parquet", row_group_size=30)
    with pytest.raises(DataError, match=r"t.parquet: column s1: id 50 outside \[0, 50\) at row 71"):
        list(ParquetBatchReader([f], spec, 16, num_workers=2))


def test_peak_memory_follows_the_buffers_not_the_data(tmp_path):
    def peak(rows: int) -> tuple[int, int]:
        table, spec = random_ctr_table(rows=rows, seed=rows)
        f = write_parquet(table, tmp_path / f"{rows}.parquet", row_group_size=500)
        reader = ParquetBatchReader([f], spec, 100, shuffle=True, shuffle_buffer_rows=1000,
                                    num_workers=2, prefetch_batches=2)
        data = table.nbytes
        del table
        tracemalloc.start()
        for _ in reader:
            pass
        size = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        return size, data

    # Both long enough for the read-ahead to fill. The peak varies by ~1.3x from run to run with
    # the worker threads' timing; memory that followed the data would grow 4x with it.
    (small, _), (large, data) = peak(20_000), peak(80_000)
    assert large < 2 * small, (small, large)
    assert large < data / 4, (large, data)


def test_log1p_of_integer_counts_matches_numpy(tmp_path):
    # Counts take the table-lookup path: negatives, the table's edge and values past it.
    counts = np.array([-5, 0, 1, 2, 7, 65_534, 65_535, 65_536, 10**7, 3], np.int64)
    table, spec = random_ctr_table(rows=len(counts), num_dense=2)
    table = table.set_column(table.schema.get_field_index("d1"), "d1", pa.array(counts))
    spec = FeatureSpec(spec.label, spec.dense, spec.sparse, DenseTransform.LOG1P)
    f = write_parquet(table, tmp_path / "counts.parquet")
    expected = np.log1p(np.maximum(counts, 0).astype(np.float64))
    for shuffle in (False, True):
        batch = next(iter(ParquetBatchReader([f], spec, 16, shuffle=shuffle, num_workers=0)))
        got = batch.dense_features[:, 1].numpy()
        if shuffle:
            got, expected = np.sort(got), np.sort(expected)
        np.testing.assert_allclose(got, expected, rtol=1e-6)


@pytest.mark.parametrize("statistics", [True, False])
def test_id_ranges_come_from_statistics_or_a_scan(tmp_path, statistics):
    table, spec = random_ctr_table(rows=100)
    good = tmp_path / "good.parquet"
    pq.write_table(table, good, row_group_size=30, write_statistics=statistics)
    units = ParquetBatchReader([good], spec, 16).row_groups
    assert set(units[0].id_ranges) == ({"s0", "s1", "s2"} if statistics else set())
    s2 = table.column("s2").to_numpy().copy()
    s2[44] = 1000  # vocab of s2 is 1000
    bad = tmp_path / "bad.parquet"
    pq.write_table(table.set_column(table.schema.get_field_index("s2"), "s2", pa.array(s2)), bad,
                   row_group_size=30, write_statistics=statistics)
    message = r"bad.parquet: column s2: id 1000 outside \[0, 1000\) at row 44"
    with pytest.raises(DataError, match=message):
        list(ParquetBatchReader([bad], spec, 16))


def test_tiny_row_groups_and_unusual_layouts(tmp_path):
    # 3-row groups: a batch spans dozens of blocks (concatenated before assembly).
    table, spec = random_ctr_table(rows=500, seed=9)
    f = write_parquet(table, tmp_path / "tiny.parquet", row_group_size=3)
    batches = list(ParquetBatchReader([f], spec, 100, shuffle=True, shuffle_buffer_rows=200))
    assert sorted(k for b in batches for k in keys(b)) == sorted(table.column("d0").to_pylist())
    # No dense column, only list features; and only single-id features.
    for kwargs in ({"num_dense": 0, "list_features": (0, 1, 2)}, {"list_features": ()}):
        table, spec = random_ctr_table(rows=300, seed=1, **kwargs)
        f = write_parquet(table, tmp_path / "layout.parquet", row_group_size=70)
        batches = list(ParquetBatchReader([f], spec, 64, shuffle=True, num_workers=2))
        assert sum(b.labels.numel() for b in batches) == 300
        for b in batches:
            kjt = b.sparse_features
            assert b.dense_features.shape == (b.labels.numel(), len(spec.dense))
            assert kjt.lengths().sum().item() == kjt.values().numel()
            assert kjt.length_per_key() == kjt.lengths().view(len(spec.sparse), -1).sum(1).tolist()

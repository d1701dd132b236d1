"""Sharded training matches unsharded training, for every sharding type, on 2 gloo ranks.

One pair of ranks is spawned for the whole module (importing TorchRec costs seconds per process);
inside, for each sharding type, the ranks build an ``EmbeddingBagCollection`` planned by
embedtrain's planner with that type forced, wrap it in ``DistributedModelParallel`` with a fused
SGD, load the weights of an unsharded reference, and take one step on their half of a global
batch. The parent reassembles the updated tables from the ranks' shards and compares them with
the reference after one SGD step on the whole batch.

Gradient reduction (measured, then pinned here): every table steps with the *mean* of the
ranks' gradients, i.e. like the reference after one step of SGD(lr / world_size) on
loss = sum over the global batch. For sharded tables (table/row/column-wise) this is TorchRec's
``comm_ops.GRADIENT_DIVISION`` (default True): the backward all-to-all / reduce-scatter divides
the summed gradient by the world size. A ``data_parallel`` table is replicated and its dense
lookup wrapped in DDP, which all-reduces and averages. But the fused optimizer does *not* reach
``data_parallel`` tables: their DDP-wrapped lookup owns fresh parameters without
``_in_backward_optimizers``, so backward leaves them unchanged with a ``.grad``, and it is the
dense optimizer (``in_backward_optimizer_filter(..., include=False)``, as
``embedtrain.train.optim.combined_optimizer`` does) that steps them; this test does the same,
with SGD(lr), and asserts that the fused step left them alone.

Column-wise on CPU: with no ``min_partition`` constraint (embedtrain sets none) TorchRec cuts
columns into blocks of 128 (``MIN_CW_DIM``) when the dim allows, else keeps the table whole. So
the model mixes dim-16 tables (one CW shard) with dims 384 (3 shards of 128 over 2 ranks) and
256 (2 shards). ``table_column_wise`` on one host of 2 ranks places shards like column-wise.
"""

from __future__ import annotations

import pytest
import torch

from embedtrain.processes import spawn

pytestmark = pytest.mark.slow  # two spawned ranks

WORLD = 2
LOCAL_BATCH = 16
LR = 0.1
SEED = 1234
TABLES = [(50, 16), (300, 384), (1200, 256), (5000, 16)]  # (rows, dim) of t0..t3
TYPES = ["table_wise", "row_wise", "column_wise", "table_row_wise", "table_column_wise",
         "data_parallel"]
ATOL = 1e-5


def _inputs(seed: int = SEED):
    """The global batch (ids per feature per example, lengths 0..4), loss weights, tables."""
    g = torch.Generator().manual_seed(seed)
    batch = WORLD * LOCAL_BATCH
    ids = [[torch.randint(0, rows, (int(torch.randint(0, 5, (1,), generator=g)),), generator=g)
            for _ in range(batch)] for rows, _ in TABLES]
    loss_w = [torch.randn(batch, dim, generator=g) for _, dim in TABLES]
    weights = [torch.randn(rows, dim, generator=g) * 0.5 for rows, dim in TABLES]
    return ids, loss_w, weights


def _kjt(ids, start: int, stop: int):
    from torchrec import KeyedJaggedTensor

    lengths = torch.tensor([len(ids[f][i]) for f in range(len(TABLES)) for i in range(start, stop)])
    values = torch.cat([ids[f][i] for f in range(len(TABLES)) for i in range(start, stop)])
    return KeyedJaggedTensor.from_lengths_sync(
        keys=[f"f{i}" for i in range(len(TABLES))], values=values.long(), lengths=lengths)


def _loss(pooled: dict, loss_w, start: int, stop: int) -> torch.Tensor:
    return sum((torch.tanh(pooled[f"f{i}"]) * loss_w[i][start:stop]).sum()
               for i in range(len(TABLES)))


def _ebc(device: str):
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=dim, num_embeddings=rows,
                                 feature_names=[f"f{i}"]) for i, (rows, dim) in enumerate(TABLES)]
    return EmbeddingBagCollection(tables=tables, device=torch.device(device))


def _one_type(rank: int, sharding_type: str, ids, loss_w, weights) -> dict:
    import torch.distributed as dist
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    from embedtrain.sharding.planner import plan_sharding
    from embedtrain.sharding.sharders import embedding_sharders
    from embedtrain.sharding.types import ClusterConfig, DeviceKind, PlannerOptions, ShardingType

    start, stop = rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH
    # Unsharded reference with the same weights: its output on the local half, and (rank 0)
    # its tables after one plain SGD step on the global batch.
    ref = _ebc("cpu")
    with torch.no_grad():
        for i, w in enumerate(weights):
            ref.embedding_bags[f"t{i}"].weight.copy_(w)
    ref_local = {k: v.detach() for k, v in ref(_kjt(ids, start, stop)).to_dict().items()}
    out: dict = {"ref_forward": ref_local}
    if rank == 0:
        params = [ref.embedding_bags[f"t{i}"].weight for i in range(len(TABLES))]
        grads = torch.autograd.grad(
            _loss(ref(_kjt(ids, 0, WORLD * LOCAL_BATCH)).to_dict(), loss_w, 0, WORLD * LOCAL_BATCH),
            params)
        # TorchRec and DDP both average gradients over ranks (module docstring).
        out["ref_updated"] = [(p - LR / WORLD * g).detach() for p, g in zip(params, grads)]

    model = _ebc("meta")
    apply_optimizer_in_backward(torch.optim.SGD, model.parameters(), {"lr": LR})
    cluster = ClusterConfig(name="test-cpu", hosts=1, devices_per_host=WORLD,
                            device=DeviceKind.CPU, ddr_gb=4)
    sharding = PlannerOptions(sharding_types=[ShardingType(sharding_type)])
    plan = plan_sharding(model, cluster, sharding).sharding_plan
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan,
                                   sharders=embedding_sharders(),
                                   env=ShardingEnv.from_process_group(dist.GroupMember.WORLD))

    def local_shards() -> dict:
        shards = {}
        for key, value in dmp.state_dict().items():
            table = key.split(".")[-2]
            if hasattr(value, "local_shards"):
                shards[table] = [(list(s.metadata.shard_offsets), s.tensor.detach().clone())
                                 for s in value.local_shards()]
            else:  # data_parallel: a plain, replicated tensor
                shards[table] = [("replica", value.detach().clone())]
        return shards

    with torch.no_grad():
        for key, value in dmp.state_dict().items():
            full = weights[int(key.split(".")[-2][1:])]
            if hasattr(value, "local_shards"):
                for s in value.local_shards():
                    (r0, c0), (nr, nc) = s.metadata.shard_offsets, s.metadata.shard_sizes
                    s.tensor.copy_(full[r0:r0 + nr, c0:c0 + nc])
            else:
                value.copy_(full)
    out["loaded"] = local_shards()
    pooled = dmp(_kjt(ids, start, stop)).to_dict()
    out["forward"] = {k: v.detach().clone() for k, v in pooled.items()}
    _loss(pooled, loss_w, start, stop).backward()  # the fused SGD steps inside the backward
    out["after_backward"] = local_shards()
    # Tables without a fused optimizer (data_parallel: its DDP-wrapped dense lookup has fresh
    # parameters that do not carry it) are stepped by the dense optimizer, as in training.
    dense = dict(in_backward_optimizer_filter(dmp.named_parameters(), include=False))
    out["dense_params"] = sorted(n.split(".")[-2] for n in dense)
    if dense:
        torch.optim.SGD(list(dense.values()), lr=LR).step()
    out["updated"] = local_shards()
    out["sharding_types"] = sorted({p.sharding_type for m in plan.plan.values()
                                    for p in m.values()})
    return out


def _rank_main(rank: int, world_size: int, types: list[str]) -> dict:
    import traceback

    ids, loss_w, weights = _inputs()
    results = {}
    for sharding_type in types:
        try:
            results[sharding_type] = _one_type(rank, sharding_type, ids, loss_w, weights)
        except Exception:  # reported by that type's test; symmetric failures let others run
            results[sharding_type] = {"error": traceback.format_exc()}
    return results


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return spawn(_rank_main, WORLD, TYPES, timeout=240)


def _assemble(per_rank: list[dict], shape: tuple[int, int]):
    """The full table from all ranks' shards, and which rank(s) hold each element."""
    full = torch.zeros(shape)
    owners = torch.zeros((WORLD,) + shape, dtype=torch.int32)
    for rank, shards in enumerate(per_rank):
        for offsets, t in shards:
            if offsets == "replica":
                offsets = [0, 0]
            (r0, c0), (nr, nc) = offsets, t.shape
            full[r0:r0 + nr, c0:c0 + nc] = t
            owners[rank, r0:r0 + nr, c0:c0 + nc] += 1
    return full, owners


def _check_layout(sharding_type: str, loaded: list[dict]) -> None:
    """The tables are split the way the sharding type says (so the test is not vacuous)."""
    spread = set()
    for i, (rows, dim) in enumerate(TABLES):
        name = f"t{i}"
        per_rank = [loaded[r][name] for r in range(WORLD)]
        _, owners = _assemble(per_rank, (rows, dim))
        holders = {r for r in range(WORLD) if per_rank[r]}
        spread |= holders
        if sharding_type == "data_parallel":
            assert all(len(s) == 1 and s[0][0] == "replica" and s[0][1].shape == (rows, dim)
                       for s in per_rank), f"{name}: not replicated"
            continue
        assert torch.equal(owners.sum(0), torch.ones(rows, dim, dtype=torch.int32)), \
            f"{name}: shards do not tile the table exactly once"
        shards = [(r, off, t.shape) for r in range(WORLD) for off, t in per_rank[r]]
        if sharding_type == "table_wise":
            assert len(shards) == 1, f"{name}: {shards}"
        elif sharding_type in ("row_wise", "table_row_wise"):
            assert holders == set(range(WORLD)), f"{name}: rows not split over ranks: {shards}"
            assert all(off[1] == 0 and shape[1] == dim for _, off, shape in shards), shards
        else:  # column_wise, table_column_wise: blocks of 128 columns, all rows
            assert all(off[0] == 0 and shape[0] == rows for _, off, shape in shards), shards
            assert len(shards) == max(1, dim // 128), f"{name}: {shards}"
            if len(shards) > 1:
                assert holders == set(range(WORLD)), f"{name}: columns on one rank: {shards}"
    assert spread == set(range(WORLD)), f"every table on rank(s) {spread} only"


@pytest.mark.parametrize("sharding_type", TYPES)
def test_sharded_step_matches_unsharded(ranks: list[dict], sharding_type: str) -> None:
    res = [ranks[r][sharding_type] for r in range(WORLD)]
    for r in range(WORLD):
        assert "error" not in res[r], f"rank {r}:\n{res[r]['error']}"
    assert res[0]["sharding_types"] == [sharding_type]
    _check_layout(sharding_type, [res[r]["loaded"] for r in range(WORLD)])

    _, _, initial = _inputs()
    for r in range(WORLD):  # the reference's weights were loaded into every shard
        for i in range(len(TABLES)):
            for offsets, t in res[r]["loaded"][f"t{i}"]:
                (r0, c0) = (0, 0) if offsets == "replica" else offsets
                assert torch.equal(t, initial[i][r0:r0 + t.shape[0], c0:c0 + t.shape[1]]), \
                    f"t{i}: shard at {offsets} on rank {r} not loaded"
    dp = sharding_type == "data_parallel"
    for r in range(WORLD):  # only data_parallel tables are left to the dense optimizer
        assert res[r]["dense_params"] == (sorted(f"t{i}" for i in range(len(TABLES))) if dp
                                          else []), f"rank {r}: {res[r]['dense_params']}"
        if dp:
            for i in range(len(TABLES)):
                assert torch.equal(res[r]["after_backward"][f"t{i}"][0][1], initial[i]), \
                    f"t{i}: the fused optimizer moved a data_parallel table on rank {r}"

    for r in range(WORLD):  # forward on each rank's half of the batch
        assert set(res[r]["forward"]) == set(res[r]["ref_forward"]) == {
            f"f{i}" for i in range(len(TABLES))}
        for f, expected in res[r]["ref_forward"].items():
            torch.testing.assert_close(res[r]["forward"][f], expected, rtol=0, atol=ATOL,
                                       msg=lambda m: f"rank {r} forward {f}: {m}")

    for i, (rows, dim) in enumerate(TABLES):
        name = f"t{i}"
        expected = res[0]["ref_updated"][i]
        assert (expected - initial[i]).abs().max() > 100 * ATOL, f"{name}: reference did not move"
        per_rank = [res[r]["updated"][name] for r in range(WORLD)]
        if dp:  # every replica took the same step
            for r in range(WORLD):
                torch.testing.assert_close(per_rank[r][0][1], expected, rtol=0, atol=ATOL,
                                           msg=lambda m: f"{name} replica on rank {r}: {m}")
            continue
        got, _ = _assemble(per_rank, (rows, dim))
        torch.testing.assert_close(got, expected, rtol=0, atol=ATOL,
                                   msg=lambda m: f"{name} after one step: {m}")

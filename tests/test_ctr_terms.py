"""The CTR model terms of issue 29 against slow references: DeepFM's pairwise term (the O(n^2)
sum), the first-order (wide) term (a per-id weight lookup, summed), and the embedding L2 penalty's
gradient (looked-up rows get exactly the penalty's share, other rows nothing), unsharded and
through DistributedModelParallel's fused optimizer."""

import copy

import pytest
import torch
from torchrec.distributed.model_parallel import DistributedModelParallel

from embedtrain.data.reader import ParquetBatchReader
from embedtrain.models.dlrm import (
    FMInteractionArch, LINEAR_DIM, ctr_model, deepfm, dlrm, embedding_penalty)
from embedtrain.models.options import Interaction
from embedtrain.testing import random_ctr_table, write_parquet
from embedtrain.train.ctr import CTRTask
from embedtrain.train.dist import init_process_group
from embedtrain.train.optim import fuse_sparse_optimizer
from embedtrain.train.options import SparseOptimizer

B = 48


@pytest.fixture(scope="module")
def batch_and_spec(tmp_path_factory):
    table, spec = random_ctr_table(rows=B, seed=3)  # s1 is a list feature (0..4 ids per row)
    f = write_parquet(table, tmp_path_factory.mktemp("terms") / "t.parquet")
    return next(iter(ParquetBatchReader([f], spec, B))), spec


def _bags(batch, feature: str) -> list[list[int]]:
    """The ids of each row's bag of ``feature``."""
    jt = batch.sparse_features[feature]
    ids, offsets = jt.values().tolist(), jt.offsets().tolist()
    return [ids[offsets[b]:offsets[b + 1]] for b in range(len(offsets) - 1)]


def test_fm_pairwise_term_equals_the_sum_over_pairs():
    torch.manual_seed(0)
    dense, sparse = torch.randn(5, 6, dtype=torch.float64), torch.randn(5, 4, 6,
                                                                        dtype=torch.float64)
    out = FMInteractionArch(4)(dense_features=dense, sparse_features=sparse)
    v = [dense] + [sparse[:, i] for i in range(4)]
    reference = sum((v[i] * v[j]).sum(dim=1) for i in range(5) for j in range(i + 1, 5))
    torch.testing.assert_close(out[:, -1], reference)
    torch.testing.assert_close(out[:, :-1], torch.cat(v, dim=1))


def test_deepfm_logit_is_the_mlp_plus_fm_plus_first_order(batch_and_spec):
    batch, spec = batch_and_spec
    torch.manual_seed(1)
    model = deepfm(spec, embedding_dim=8, bottom_mlp=[16, 8], top_mlp=[16, 1]).eval()
    for t in model.linear_arch.embedding_bag_collection.embedding_bags.values():
        torch.nn.init.normal_(t.weight)
    logits = model(batch.dense_features, batch.sparse_features).squeeze(-1)
    # the reference, piece by piece
    ebc = model.sparse_arch.embedding_bag_collection.embedding_bags
    lin = model.linear_arch.embedding_bag_collection.embedding_bags
    v_dense = model.dense_arch(batch.dense_features)
    expected = []
    for b in range(B):
        v = [v_dense[b]] + [sum((ebc[f"t_{f.name}"].weight[i] for i in _bags(batch, f.name)[b]),
                                torch.zeros(8)) for f in spec.sparse]
        pairs = sum(v[i] @ v[j] for i in range(len(v)) for j in range(i + 1, len(v)))
        first = sum(lin[f"l_{f.name}"].weight[i, 0] for f in spec.sparse
                    for i in _bags(batch, f.name)[b])
        mlp = model.over_arch.model(torch.cat(v).unsqueeze(0)).squeeze()
        expected.append(mlp + pairs + first)
    torch.testing.assert_close(logits, torch.stack(expected), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("interaction", [Interaction.DOT, Interaction.DCN])
def test_first_order_term_adds_each_ids_weight(batch_and_spec, interaction):
    batch, spec = batch_and_spec
    torch.manual_seed(2)
    plain = ctr_model(spec, interaction, 8, [16, 8], [16, 1]).eval()
    wide = ctr_model(spec, interaction, 8, [16, 8], [16, 1], linear=True).eval()
    missing, unexpected = wide.load_state_dict(plain.state_dict(), strict=False)
    assert not unexpected and all(k.startswith("linear_arch.") for k in missing)
    args = batch.dense_features, batch.sparse_features
    # zero-initialised: an untrained first-order term changes nothing
    torch.testing.assert_close(wide(*args), plain(*args))
    tables = wide.linear_arch.embedding_bag_collection.embedding_bags
    for t in tables.values():
        assert t.weight.shape[1] == LINEAR_DIM
        torch.nn.init.normal_(t.weight)
    weights = {f.name: tables[f"l_{f.name}"].weight[:, 0] for f in spec.sparse}
    first = torch.tensor([sum(float(weights[f.name][i]) for f in spec.sparse
                              for i in _bags(batch, f.name)[b]) for b in range(B)])
    torch.testing.assert_close(wide(*args).squeeze(-1), plain(*args).squeeze(-1) + first)


def _table_grads(model, batch, spec):
    model.zero_grad()
    out = CTRTask(penalty=embedding_penalty).forward(model, batch)
    out.loss.backward()
    return {f.name: model.sparse_arch.embedding_bag_collection.embedding_bags[
        f"t_{f.name}"].weight.grad.clone() for f in spec.sparse}


def test_embedding_l2_gradient_of_looked_up_rows_only(batch_and_spec):
    batch, spec = batch_and_spec
    lam = 0.3
    torch.manual_seed(3)
    plain = dlrm(spec, 8, [16, 8], [16, 1]).train()
    l2 = dlrm(spec, 8, [16, 8], [16, 1], embedding_l2=lam).train()
    l2.load_state_dict(plain.state_dict())
    without, with_l2 = _table_grads(plain, batch, spec), _table_grads(l2, batch, spec)
    assert l2.penalty is None  # taken by the task
    checked_untouched = 0
    for f in spec.sparse:
        weight = plain.sparse_arch.embedding_bag_collection.embedding_bags[f"t_{f.name}"].weight
        expected = torch.zeros_like(weight)
        for bag in _bags(batch, f.name):
            pooled = sum((weight[i] for i in bag), torch.zeros(8))
            for i in bag:  # d/de_i of lam / B * ||sum of the bag||^2
                expected[i] += 2 * lam / B * pooled.detach()
        torch.testing.assert_close(with_l2[f.name] - without[f.name], expected, rtol=1e-4,
                                   atol=1e-6)
        used = {i for bag in _bags(batch, f.name) for i in bag}
        untouched = [r for r in range(weight.shape[0]) if r not in used]
        assert torch.all(with_l2[f.name][untouched] == 0)
        checked_untouched += len(untouched)
    assert checked_untouched > 0    # evaluation has no penalty
    l2.eval()
    l2(batch.dense_features, batch.sparse_features)
    assert embedding_penalty(l2) is None


def test_embedding_l2_reaches_the_fused_sharded_optimizer(batch_and_spec):
    """One SGD step of FBGEMM's fused kernel under DMP (every table table-wise, fused, the
    first-order tables too): looked-up rows move by exactly the penalty's gradient times the
    learning rate more than without it; other rows not at all."""
    import torch.distributed as dist
    from torchrec.distributed.types import ShardingEnv

    from embedtrain.sharding.planner import plan_sharding
    from embedtrain.sharding.sharders import embedding_sharders
    from embedtrain.sharding.types import (
        ClusterConfig, DeviceKind, PlannerOptions, ShardingType)

    batch, spec = batch_and_spec
    init_process_group()
    lam, lr = 0.5, 0.1
    torch.manual_seed(4)
    reference = dlrm(spec, 8, [16, 8], [16, 1], linear=True)
    for t in reference.linear_arch.embedding_bag_collection.embedding_bags.values():
        torch.nn.init.normal_(t.weight)
    start = copy.deepcopy(reference.state_dict())
    cluster = ClusterConfig(name="test-cpu", hosts=1, devices_per_host=1,
                            device=DeviceKind.CPU, ddr_gb=4)

    def step(embedding_l2: float) -> dict[str, torch.Tensor]:
        model = dlrm(spec, 8, [16, 8], [16, 1], device=torch.device("meta"), linear=True,
                     embedding_l2=embedding_l2)
        assert fuse_sparse_optimizer(model, SparseOptimizer.SGD, lr) == 2 * len(spec.sparse)
        plan = plan_sharding(model, cluster, PlannerOptions(
            sharding_types=[ShardingType.TABLE_WISE])).sharding_plan
        dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan,
                                       sharders=embedding_sharders(),
                                       env=ShardingEnv.from_process_group(dist.GroupMember.WORLD))
        dmp.load_state_dict(copy.deepcopy(start))  # (DMP edits the dict it loads)
        out = CTRTask(penalty=embedding_penalty).forward(dmp, batch)
        out.loss.backward()  # the fused optimizer updates the rows here
        return {k: v.local_shards()[0].tensor.clone() for k, v in dmp.state_dict().items()
                if hasattr(v, "local_shards")}

    without, with_l2 = step(0.0), step(lam)
    assert len(without) == 2 * len(spec.sparse)  # every table sharded
    for f in spec.sparse:
        for arch, table, column in (("sparse", "t", slice(None)), ("linear", "l", 0)):
            key = f"{arch}_arch.embedding_bag_collection.embedding_bags.{table}_{f.name}.weight"
            weight = start[key]
            expected = torch.zeros_like(weight)
            for bag in _bags(batch, f.name):
                pooled = sum((weight[i, column] for i in bag), torch.zeros_like(weight[0, column]))
                for i in bag:
                    expected[i, column] -= lr * 2 * lam / B * pooled
            torch.testing.assert_close(with_l2[key] - without[key], expected, rtol=1e-3,
                                       atol=1e-6)
            used = {i for bag in _bags(batch, f.name) for i in bag}
            untouched = [r for r in range(weight.shape[0]) if r not in used]
            torch.testing.assert_close(with_l2[key][untouched], weight[untouched], rtol=0,
                                       atol=0)


def test_first_order_with_dynamic_tables_is_refused(batch_and_spec):
    from embedtrain.models.options import DynamicTable

    _, spec = batch_and_spec
    with pytest.raises(ValueError, match="model.linear: not with dynamic tables"):
        dlrm(spec, 8, [16, 8], [16, 1], device=torch.device("meta"), linear=True,
             dynamic={"t_s0": DynamicTable(capacity=16)})


def _one_rank_state(data, out, pipeline: str) -> tuple[dict, dict]:
    from embedtrain.config import load_config
    from embedtrain.recipes import build_run

    cfg = load_config("configs/dlrm_synthetic.yaml", overrides=[
        f"data.path={data}", "data.batch_size=64", "data.num_workers=0", "model.embedding_dim=8",
        "model.bottom_mlp=[16,8]", "model.top_mlp=[16,1]", "model.interaction=fm",
        "optim.embedding_l2=0.01", "train.max_steps=8", "train.eval_every=4",
        "train.checkpoint_every=0", "train.progress=false", f"train.pipeline={pipeline}"])
    run = build_run(cfg, out)
    summary = run.trainer.fit()
    state = {k: (v.local_shards()[0].tensor if hasattr(v, "local_shards") else v).clone()
             for k, v in run.trainer.model.state_dict().items()}
    return summary, state


def test_deepfm_with_l2_trains_the_same_through_the_pipeline(tmp_path):
    """TorchRec's TrainPipelineSparseDist runs DeepFM's two table collections (embeddings and
    first-order) and the task adds the penalty it read through the pipeline's stand-in: the same
    weights as the plain loop, bit for bit."""
    from embedtrain.testing import tiny_ctr_dataset

    data = tiny_ctr_dataset(tmp_path / "data", rows=1500)
    plain_summary, plain = _one_rank_state(data, tmp_path / "plain", "none")
    piped_summary, piped = _one_rank_state(data, tmp_path / "piped", "sparse_dist")
    assert sorted(piped_summary["pipeline"]["pipelined_modules"]) == [
        "linear_arch.embedding_bag_collection", "sparse_arch.embedding_bag_collection"]
    assert plain.keys() == piped.keys()
    for key, value in plain.items():
        assert torch.equal(value, piped[key]), key
    assert plain_summary["loss"] == piped_summary["loss"]

"""The XC task in the trainer loop: every head learns, a resumed run equals an uninterrupted one,
and the planner sizes the class head."""

import pytest
import torch

from embedtrain.config import load_cluster, load_config
from embedtrain.datagen import XCDataSpec, generate_xc

CLASSES = 300


@pytest.fixture(scope="module")
def xc_data(tmp_path_factory):
    out = tmp_path_factory.mktemp("xc")
    generate_xc(XCDataSpec(classes=CLASSES, rows=12_000, vocab=3_000, noise=0.5, seed=3,
                           rows_per_row_group=2_000), out, progress=False)
    return out


def _cfg(data, *overrides):
    return load_config("configs/xc_synthetic.yaml", overrides=[
        f"data.path={data}", "data.batch_size=128", "data.eval_batch_size=512",
        "data.num_workers=0", "xc.embedding_dim=32", "xc.mlp=[64]", "train.eval_every=0",
        "train.progress=false", *overrides])


@pytest.mark.parametrize("kind", ["full", "partial_fc", "hard_negatives", "adaptive", "mach"])
def test_every_head_learns(xc_data, tmp_path, kind):
    from embedtrain.recipes import build_run

    run = build_run(_cfg(xc_data, f"head.kind={kind}", "head.sample_rate=0.2",
                         "head.refresh_every=10", "train.max_steps=150",
                         "train.checkpoint_every=0"), tmp_path)
    summary = run.trainer.fit(test_data=run.test_data)
    # Zipf(1.1) over 300 classes: always answering the most frequent class scores about 0.17;
    # after 150 steps the heads reach 0.49 (adaptive) to 0.6.
    assert summary["p@1"] > 0.4, summary
    assert summary["oracle_p_at_1"] > summary["p@1"]


def _state(trainer):
    head = trainer.model.module.head
    opt = trainer.optimizer.state_dict()["state"]
    tables = {k: v.local_shards()[0].tensor.clone() if hasattr(v, "local_shards") else v.clone()
              for k, v in trainer.model.state_dict().items() if "embedding_bags" in k}
    return head.weight.detach().clone(), opt, tables


BF16 = ["head.dtype=bf16", "head.optimizer=rowwise_adagrad"]
FACTORED = ["head.dtype=bf16", "head.optimizer=factored_adagrad"]
FP8 = ["head.dtype=fp8", "head.optimizer=factored_adagrad"]
STORED = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}


@pytest.mark.parametrize("precision", [[], BF16, FACTORED, FP8],
                         ids=["fp32", "bf16", "factored", "fp8"])
def test_resume_equals_uninterrupted(xc_data, tmp_path, precision):
    from embedtrain.recipes import build_run

    common = ["head.kind=partial_fc", "head.sample_rate=0.3", "train.checkpoint_every=10",
              *precision]
    whole = build_run(_cfg(xc_data, *common, "train.max_steps=20"), tmp_path / "whole").trainer
    whole.fit()
    part = build_run(_cfg(xc_data, *common, "train.max_steps=10"), tmp_path / "part").trainer
    part.fit()
    at_ten = _state(part)
    resumed = build_run(_cfg(xc_data, *common, "train.max_steps=20"), tmp_path / "part").trainer
    fresh = _state(resumed)
    # The restore happened, at step 10, and brought the part run's weights and optimizer state
    # (a fresh, seeded model would train 20 steps to the same end: the end alone proves nothing).
    assert resumed.resume() == tmp_path / "part" / "checkpoints" / "step_00000010"
    assert resumed.state.step == 10 and resumed.state.epoch == 0
    restored = _state(resumed)
    assert not torch.equal(fresh[0], at_ten[0]) and torch.equal(restored[0], at_ten[0])
    for k in at_ten[2]:
        assert torch.equal(restored[2][k], at_ten[2][k]), k
    for k, state in at_ten[1].items():  # factored: the column profile's sums, restored
        if "columns" in state:
            assert torch.equal(restored[1][k]["columns"], state["columns"]), k
    resumed.fit()
    assert resumed.state.step == 20
    w1, opt1, tables1 = _state(whole)
    w2, opt2, tables2 = _state(resumed)
    assert torch.equal(w1, w2)  # the same Partial FC samples, in the same order
    for k in tables1:
        assert torch.equal(tables1[k], tables2[k]), k
    head_sum = [k for k in opt1 if k.startswith("head.")]
    assert head_sum, list(opt1)
    for k in head_sum:
        assert torch.equal(opt1[k]["sum"].to_local(), opt2[k]["sum"].to_local())
        if "head.optimizer=factored_adagrad" in precision:  # the column profile's sums,
            # stepped on after the restore
            assert torch.equal(opt1[k]["columns"], opt2[k]["columns"])
            assert not torch.equal(opt1[k]["columns"], at_ten[1][k]["columns"])
    if precision:  # bf16/fp8 rows and one float32 accumulator a row, in the checkpoint too
        stored = STORED[precision[0].rsplit("=", 1)[1]]
        assert w1.dtype == stored and opt1[head_sum[0]]["sum"].shape == (CLASSES,)
        import torch.distributed.checkpoint as dcp

        meta = dcp.FileSystemReader(str(tmp_path / "part" / "checkpoints" / "step_00000020")
                                    ).read_metadata()
        assert meta.state_dict_metadata["model.head.weight"].properties.dtype == stored


@pytest.mark.parametrize("dtype, size", [("bf16", 2), ("fp8", 1)])
def test_plan_counts_a_low_precision_head_and_its_rowwise_state(xc_data, tmp_path, dtype, size):
    """The planner's bytes of a bf16 (fp8) head with row-wise Adagrad are what each rank holds: 2
    (1) bytes a weight and one float32 a row, per rank as the slices split them; measured in a
    run."""
    import json

    from embedtrain.recipes import build_run, plan_model

    precision = [f"head.dtype={dtype}", "head.optimizer=rowwise_adagrad"]
    cfg = _cfg(xc_data, "head.kind=partial_fc", *precision)
    report = plan_model(cfg, load_cluster("configs/clusters/cpu-1x2.yaml")).report.to_dict()
    (head,) = [t for t in report["tables"] if t["name"] == "class_head"]
    dim = cfg.xc.mlp[-1]
    assert head["weight_bytes"] == CLASSES * dim * size and head["optimizer_bytes"] == CLASSES * 4
    # ... and so do the shards the plan packs: an fp32 head with full Adagrad against one with
    # row-wise Adagrad differ by the state's bytes alone (TorchRec's estimator would charge the
    # row-wise optimizer it does not know one slot a weight: a 50M-class bf16 head, 12 GiB of
    # weights, refused on this 24 GiB machine as needing 24 GiB)
    packed = [sum(s["ddr_bytes"] + s["hbm_bytes"] for t in plan_model(
        _cfg(xc_data, "head.kind=partial_fc", f"head.optimizer={opt}"),
        load_cluster("configs/clusters/cpu-1x2.yaml")).report.to_dict()["tables"]
        if t["name"] == "class_head" for s in t["shards"]) for opt in ("adagrad", "rowwise_adagrad")]
    assert packed[0] - packed[1] == CLASSES * dim * 4 - CLASSES * 4
    build_run(_cfg(xc_data, "head.kind=partial_fc", *precision, "train.max_steps=2",
                   "train.checkpoint_every=0"), tmp_path)
    (rank,) = json.loads((tmp_path / "plan_vs_measured.json").read_text())["ranks"]
    assert rank["measured_weights"] == rank["estimated_weights"]
    assert rank["measured_optimizer"] == rank["estimated_optimizer"]
    tokens = cfg.xc.embedding_dim * 4 * 3_000  # the token table, float32
    assert rank["measured_weights"] - tokens == CLASSES * dim * size


@pytest.mark.parametrize("sets, message", [
    (["head.dtype=bf16"], "head.dtype: bf16 needs optimizer: rowwise_adagrad "
                             "or factored_adagrad, not adagrad"),
    (["head.dtype=bf16", "head.kind=mach"], "head.dtype: bf16 needs a full, partial_fc "
                                                  "or hard_negatives head, not mach"),
])
def test_bf16_head_refusals_are_one_line(xc_data, tmp_path, sets, message):
    from embedtrain.recipes import build_run

    if "kind=mach" in sets[-1]:
        sets = [*sets, "head.optimizer=rowwise_adagrad"]
    with pytest.raises(ValueError, match=message):
        build_run(_cfg(xc_data, *sets), tmp_path)


def test_plan_sizes_the_class_head(xc_data):
    from embedtrain.recipes import plan_model

    cluster = load_cluster("configs/clusters/cpu-1x2.yaml")
    report = plan_model(_cfg(xc_data, "head.kind=partial_fc"), cluster).report.to_dict()
    (head,) = [t for t in report["tables"] if t["name"] == "class_head"]
    assert head["sharding_type"] == "row_wise"
    rows = [s["rows"] if "rows" in s else s["size"][0] for s in head["shards"]]
    assert rows == [CLASSES // 2, CLASSES // 2]
    assert report["model"]["class_head"]["num_classes"] == CLASSES
    assert any("class head class_head" in w for w in report["warnings"])
    # Each rank scores the global batch against its sampled columns: logits + saved softmax.
    batch = cluster.batch_size_per_rank * 2
    for r in report["ranks"]:
        assert r["memory"]["ddr"]["class_head_logits"] == batch * round(0.1 * CLASSES / 2) * 4 * 2


def test_xc_task_on_ctr_data_is_one_line(tmp_path):
    from embedtrain.datagen import CTRDataSpec, generate_ctr
    from embedtrain.recipes import build_run

    generate_ctr(CTRDataSpec(rows=2_000, seed=1), tmp_path / "ctr")
    with pytest.raises(ValueError, match="task xc needs a classification data set"):
        build_run(_cfg(tmp_path / "ctr"), tmp_path / "run")


# ---- 2 ranks == 1 rank through the sharded model (encoder tables, DDP MLP, head slices) ----

def _slice(batch, lo, hi):
    from torchrec.datasets.utils import Batch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    jt = batch.sparse_features["tokens"]
    offsets = jt.offsets()
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["tokens"], values=jt.values()[offsets[lo]:offsets[hi]], lengths=jt.lengths()[lo:hi])
    return Batch(batch.dense_features[lo:hi], kjt, batch.labels[lo:hi])


def _one_step(rank, world, data, out, kind):
    from embedtrain.data.reader import ParquetBatchReader
    from embedtrain.features import load_dataset_meta
    from embedtrain.recipes.base import local_cluster
    from embedtrain.recipes.xc import XCRecipe

    kind, *options = kind.split("+")  # e.g. "partial_fc+bce": the head and its options
    loss = "bce" if "bce" in options else "softmax"
    index = "clustered" if "clustered" in options else "exact"
    cfg = _cfg(data, f"head.kind={kind}", f"head.loss={loss}", f"head.index={index}",
               "head.sample_rate=1.0", "optim.sparse=sgd",
               "optim.dense=sgd", "optim.momentum=0.0", "head.optimizer=sgd",
               "optim.sparse_lr=0.5", "optim.dense_lr=0.5", "head.lr=0.5")
    meta = load_dataset_meta(data)
    torch.manual_seed(0)
    recipe = XCRecipe(cfg)
    dmp, optimizer, _ = recipe.sharded_model(local_cluster(world, torch.device("cpu"), 64),
                                             torch.device("cpu"), out)
    task = recipe.task()
    # The encoder's initial weights differ with the sharding: make them the same everywhere.
    with torch.no_grad():
        for name, p in dmp.named_parameters():
            if "mlp" in name:
                g = torch.Generator().manual_seed(len(name))
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    tables = dmp.state_dict()["encoder.ebc.embedding_bags.t_tokens.weight"]
    with torch.no_grad():
        for shard in tables.local_shards():
            r0, c0 = shard.metadata.shard_offsets
            rows, cols = shard.tensor.shape
            full = torch.randn(meta.features.sparse[0].num_embeddings, 32,
                               generator=torch.Generator().manual_seed(1)) * 0.1
            shard.tensor.copy_(full[r0:r0 + rows, c0:c0 + cols])
    batch = next(iter(ParquetBatchReader(meta.files("train"), meta.features, 128,
                                         num_workers=0)))
    local = _slice(batch, rank * 128 // world, (rank + 1) * 128 // world)
    loss = task.forward(dmp, local).loss
    loss.backward()
    optimizer.step()
    tables = dmp.state_dict()["encoder.ebc.embedding_bags.t_tokens.weight"]
    head = dmp.module.head
    if hasattr(head, "start"):  # sharded: this rank's slice of classes
        head_state = (head.start, head.weight.detach().clone())
    else:  # replicated (DDP): every parameter
        head_state = (0, torch.cat([p.detach().reshape(-1) for p in head.parameters()])[:, None])
    return {"loss": float(loss), "head": head_state,
            "mlp": {n: p.detach().clone() for n, p in dmp.named_parameters() if "mlp" in n},
            "tables": [(s.metadata.shard_offsets, s.tensor.clone()) for s in tables.local_shards()]}


def _assemble(results):
    if all(r["head"][0] == 0 for r in results):  # replicated: every rank holds all of it
        torch.testing.assert_close(results[0]["head"][1], results[-1]["head"][1])
        head = results[0]["head"][1]
    else:
        head = torch.cat([w for _, w in sorted((r["head"] for r in results),
                                               key=lambda x: x[0])])
    rows = max(o[0] + t.shape[0] for r in results for o, t in r["tables"])
    table = torch.full((rows, 32), float("nan"))
    for r in results:
        for (r0, c0), t in r["tables"]:
            table[r0:r0 + t.shape[0], c0:c0 + t.shape[1]] = t
    return head, table


# +bce: the one-vs-all loss; +clustered: the clustered index (every class is sampled at rate 1,
# but its recall is measured with a collective over the ranks at the rebuild)
HEADS = ["full", "partial_fc", "hard_negatives", "adaptive", "mach", "full+bce", "partial_fc+bce",
         "hard_negatives+bce+clustered"]


def _steps(rank, world, data, out, kinds):
    return {kind: _one_step(rank, world, data, f"{out}/{kind}", kind) for kind in kinds}


@pytest.fixture(scope="module")
def two_rank_steps(xc_data, tmp_path_factory):
    """Every head's one step on one pair of spawned ranks (TorchRec's import is paid once)."""
    from embedtrain.processes import spawn

    out = tmp_path_factory.mktemp("two")
    return spawn(_steps, 2, str(xc_data), str(out), HEADS, timeout=400)


@pytest.mark.slow
@pytest.mark.parametrize("kind", HEADS)
def test_two_ranks_step_like_one(xc_data, two_rank_steps, tmp_path, kind):
    """One SGD step of the sharded model on 2 ranks (tables sharded by the planner, MLP under DDP,
    head split by classes, or replicated under DDP for adaptive/MACH) equals the step on 1 rank
    with the global batch (sampling heads at sample_rate 1: every class takes part)."""
    from embedtrain.train.dist import init_process_group

    two = [rank[kind] for rank in two_rank_steps]
    init_process_group()  # a world of one in this process, as `embedtrain train` makes
    one = _one_step(0, 1, str(xc_data), str(tmp_path / "one"), kind)
    if kind in ("adaptive", "mach"):  # replicated: each rank's local mean, averaged by DDP
        assert (two[0]["loss"] + two[1]["loss"]) / 2 == pytest.approx(one["loss"], rel=1e-6)
    else:  # sharded: the global batch's mean on every rank
        assert two[0]["loss"] == two[1]["loss"] == pytest.approx(one["loss"], rel=1e-6)
    head2, table2 = _assemble(two)
    head1, table1 = _assemble([one])
    torch.testing.assert_close(head2, head1, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(table2, table1, atol=1e-6, rtol=1e-5)
    start = torch.randn(table1.shape, generator=torch.Generator().manual_seed(1)) * 0.1
    assert not torch.equal(table1, start)  # the step did move the tables
    for name in one["mlp"]:
        torch.testing.assert_close(two[0]["mlp"][name], one["mlp"][name], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(two[1]["mlp"][name], one["mlp"][name], atol=1e-6, rtol=1e-5)


def test_hundred_million_class_head_dry_run():
    """configs/xc_100m.yaml on one 8-GPU host: Partial FC fits, the full softmax's logits do not."""
    from embedtrain.sharding.planner import PlanError
    from embedtrain.recipes import plan_model

    cluster = load_cluster("configs/clusters/a100-1x8.yaml")
    report = plan_model(load_config("configs/xc_100m.yaml"), cluster).report.to_dict()
    (head,) = [t for t in report["tables"] if t["name"] == "class_head"]
    assert head["weight_bytes"] == 100_000_000 * 128 * 4
    assert head["optimizer_bytes"] == head["weight_bytes"]  # Adagrad: one value per weight
    rank = report["ranks"][0]["memory"]["hbm"]
    assert rank["class_head_logits"] == 512 * 8 * 1_250_000 * 4 * 2
    assert rank["total"] < rank["capacity"]
    with pytest.raises(PlanError, match="does not fit.*class_head_logits"):
        plan_model(load_config("configs/xc_100m.yaml", ["head.kind=full"]), cluster)


@pytest.fixture(scope="module")
def multi_label_data(tmp_path_factory):
    out = tmp_path_factory.mktemp("xc_multi")
    generate_xc(XCDataSpec(classes=CLASSES, rows=8_000, vocab=3_000, noise=0.5, seed=4,
                           multi_label=True, labels_per_row=(1, 3), rows_per_row_group=2_000),
                out, progress=False)
    return out


@pytest.mark.parametrize("head", [["head.kind=partial_fc"], ["head.kind=mach"],
                                  ["head.kind=partial_fc", "head.loss=bce"],
                                  ["head.kind=hard_negatives", "head.loss=bce",
                                   "head.index=clustered", "head.refresh_every=25"]])
def test_multi_label_heads_learn(multi_label_data, tmp_path, head):
    from embedtrain.recipes import build_run

    run = build_run(_cfg(multi_label_data, *head, "head.sample_rate=0.3",
                         "train.max_steps=100", "train.checkpoint_every=0"), tmp_path)
    summary = run.trainer.fit(test_data=run.test_data)
    assert summary["p@1"] > 0.3, summary
    # PSP@k (propensities from the train split's class counts) is reported beside P@k.
    assert 0 < summary["psp@1"] <= 1 and 0 < summary["psp@5"] <= 1
    if "head.index=clustered" in head:  # rebuilt every 25 steps, its recall measured
        assert [r["step"] for r in summary["index_recall"]] == list(range(0, summary["steps"], 25))
        assert len(summary["index_recall"]) > 1
        assert all(0 <= r["recall"] <= 1 for r in summary["index_recall"])


def test_adaptive_refuses_multi_label_data(multi_label_data, tmp_path):
    from embedtrain.recipes import build_run

    with pytest.raises(ValueError, match="adaptive takes one label per example"):
        build_run(_cfg(multi_label_data, "head.kind=adaptive"), tmp_path)


def test_bce_needs_a_sharded_head(xc_data, tmp_path):
    from embedtrain.recipes import build_run

    with pytest.raises(ValueError, match="head.loss: bce needs a full, partial_fc or "
                                         "hard_negatives head, not mach"):
        build_run(_cfg(xc_data, "head.kind=mach", "head.loss=bce"), tmp_path)

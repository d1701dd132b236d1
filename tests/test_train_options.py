"""Training options: gradient accumulation, bf16 autocast, LR schedules, dense all-reduce hooks."""

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from embedtrain.config import (
    Config,
    DataConfig,
    DenseAllReduce,
    DenseOptimizer,
    LRDecay,
    ModelConfig,
    OptimConfig,
    ShardingConfig,
    SparseOptimizer,
    TrainConfig,
)
from embedtrain.processes import spawn
from embedtrain.sharding.planner import dense_allreduce_bytes
from embedtrain.testing import tiny_ctr_dataset


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return tiny_ctr_dataset(tmp_path_factory.mktemp("opts") / "data", rows=3000)


def _cfg(data, batch, **train) -> Config:
    return Config(
        data=DataConfig(path=str(data), batch_size=batch, eval_batch_size=1024, shuffle=False,
                        num_workers=0),
        model=ModelConfig(embedding_dim=8, bottom_mlp=[16, 8], top_mlp=[16, 1]),
        # Frozen tables (sparse lr 0): micro-batches then see the same model, as a big batch does.
        optim=OptimConfig(sparse=SparseOptimizer.SGD, sparse_lr=0.0, dense=DenseOptimizer.SGD,
                          dense_lr=0.1, momentum=0.0),
        train=TrainConfig(progress=False, **train),
    )


def _dense(trainer) -> dict:
    return {k: v.detach().clone() for k, v in trainer.model.named_parameters()
            if "embedding_bags" not in k}


def test_grad_accumulation_equals_the_big_batch(data, tmp_path):
    from embedtrain.recipes import build_run

    big = build_run(_cfg(data, 256), tmp_path / "big").trainer
    small = build_run(_cfg(data, 128, grad_accumulation=2), tmp_path / "small").trainer
    small.model.load_state_dict(big.model.state_dict())
    before = _dense(small)
    big._train_step(next(iter(big.train_data.iter_epoch(0))))
    batches = small.train_data.iter_epoch(0)
    small._train_step(next(batches))
    assert all(torch.equal(before[k], v) for k, v in _dense(small).items())  # not stepped yet
    small._train_step(next(batches))
    after_big, after_small = _dense(big), _dense(small)
    assert any(not torch.equal(before[k], after_small[k]) for k in before)
    for k in after_big:
        torch.testing.assert_close(after_small[k], after_big[k], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bf16", [True, False])
def test_bf16_dense_runs_the_training_forward_under_autocast(data, tmp_path, bf16):
    """With train.bf16_dense the trainer's training step runs the dense layers in bfloat16 (their
    outputs are bf16 tensors), the loss stays fp32; without it everything is fp32."""
    from embedtrain.recipes import build_run

    trainer = build_run(_cfg(data, 256, bf16_dense=bf16), tmp_path / "bf16").trainer
    seen = {}
    linear = next(m for m in trainer.model.modules() if isinstance(m, torch.nn.Linear))
    hook = linear.register_forward_hook(
        lambda module, args, out: seen.update(dtype=out.dtype,
                                              autocast=torch.is_autocast_enabled("cpu")))
    forward = trainer.task.forward

    def recording(model, batch):
        out = forward(model, batch)
        seen["loss_dtype"] = out.loss.dtype
        return out

    trainer.task.forward = recording
    trainer._train_step(next(iter(trainer.train_data.iter_epoch(0))))
    hook.remove()
    assert seen["autocast"] is bf16
    assert seen["dtype"] == (torch.bfloat16 if bf16 else torch.float32)
    assert seen["loss_dtype"] == torch.float32  # binary cross-entropy is autocast to fp32
    assert trainer.state.step == 1 and torch.isfinite(torch.tensor(trainer.state.loss_sum))


def test_lr_schedule_steps_and_resumes(data, tmp_path):
    from embedtrain.recipes import build_run

    cfg = _cfg(data, 256, checkpoint_every=3)
    cfg.optim = OptimConfig(dense=DenseOptimizer.LAMB, dense_lr=0.01, warmup_steps=4,
                            lr_decay=LRDecay.COSINE, min_lr_ratio=0.1)
    run = build_run(cfg, tmp_path / "sched")
    trainer = run.trainer
    dense = run.trainer.lr_scheduler.optimizer
    lrs = []
    for batch, _ in zip(trainer.train_data.iter_epoch(0), range(3)):
        trainer._train_step(batch)
        lrs.append(dense.param_groups[0]["lr"])
    assert lrs == pytest.approx([0.01 * 2 / 4, 0.01 * 3 / 4, 0.01])  # linear warmup
    trainer.save()
    again = build_run(cfg, tmp_path / "sched").trainer
    assert again.restore()
    assert again.lr_scheduler.last_epoch == trainer.lr_scheduler.last_epoch == 3
    assert again.lr_scheduler.optimizer.param_groups[0]["lr"] == pytest.approx(0.01)


def test_dense_allreduce_bytes_reflect_compression():
    shapes = [(64, 13), (64,), (1, 128)]
    fp32 = dense_allreduce_bytes(shapes, DenseAllReduce.FP32)
    assert fp32 == 4 * (64 * 13 + 64 + 128)
    assert dense_allreduce_bytes(shapes, DenseAllReduce.BF16) == fp32 // 2
    # PowerSGD rank 2: P (64x2) + Q (13x2) for the matrix, (1x2)+(128x2) for the row, vector as is.
    assert dense_allreduce_bytes(shapes, DenseAllReduce.POWERSGD, 2) == 4 * (
        min(64 * 13, 2 * (64 + 13)) + 64 + min(128, 2 * (1 + 128)))


def _hooked_grads(rank, world, data, modes):
    import tempfile

    from embedtrain.recipes import build_run

    results = {}
    for mode in modes:
        cfg = _cfg(data, 256)
        cfg.sharding = ShardingConfig(dense_allreduce=DenseAllReduce(mode))
        trainer = build_run(cfg, tempfile.mkdtemp()).trainer
        grads = []
        for batch, _ in zip(trainer.train_data.iter_epoch(0), range(3)):
            out = trainer.task.forward(trainer.model, batch)
            trainer.optimizer.zero_grad()
            out.loss.backward()
            grads.append({k: p.grad.clone() for k, p in trainer.model.named_parameters()
                          if p.grad is not None and "over_arch" in k})
        ddp = [m for m in trainer.model.modules() if isinstance(m, DistributedDataParallel)]
        results[mode] = {"grads": grads, "hooked": len(ddp)}
    return results


@pytest.mark.slow
def test_dense_allreduce_hooks_on_two_ranks(data):
    modes = ("fp32", "bf16", "powersgd")
    per_rank = spawn(_hooked_grads, 2, data, modes)
    results = {m: [r[m] for r in per_rank] for m in modes}
    for mode, ranks in results.items():
        assert ranks[0]["hooked"] >= 1, mode
        for a, b in zip(ranks[0]["grads"], ranks[1]["grads"]):  # every rank has the same grads
            for k in a:
                torch.testing.assert_close(a[k], b[k], msg=f"{mode} {k}")
    ref, bf16, psgd = (results[m][0]["grads"] for m in ("fp32", "bf16", "powersgd"))
    for k in ref[0]:
        assert not torch.equal(ref[0][k], bf16[0][k])  # compressed on the wire...
        torch.testing.assert_close(bf16[0][k], ref[0][k], rtol=2e-2, atol=1e-3)  # ...closely
    # PowerSGD starts after iteration 2 (plain all-reduce before), then approximates.
    assert all(torch.equal(ref[0][k], psgd[0][k]) for k in ref[0])
    assert any(not torch.allclose(ref[2][k], psgd[2][k]) for k in ref[2])

"""The gated DLRM of examples/custom_interaction, trained from Python alone: a run like any other
(``embedtrain eval``, ``export`` and ``predict`` take its directory, see run.sh)."""

import sys

import embedtrain as et

data, out = sys.argv[1], sys.argv[2]
cfg = et.from_dict(et.Config, {
    "data": {"path": data, "batch_size": 1024, "eval_batch_size": 8192},
    "model": {"_component_": "gated:GatedDLRM", "embedding_dim": 16, "hidden": [64, 32]},
    "train": {"epochs": 1, "eval_every": 20, "checkpoint_every": 40, "progress": False},
})
summary = et.fit(cfg, out)
print(f"test auc {summary['auc']:.4f} after {summary['steps']} steps")

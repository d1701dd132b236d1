"""Typed configs: every shipped YAML loads, builds and plans; typos, wrong types and bad values
name the file and key path; YAML 1.2 numbers; paths relative to the config file."""

import dataclasses
from pathlib import Path

import pytest

from embedtrain.config import (
    Config,
    ConfigError,
    HeadKind,
    Interaction,
    SparseOptimizer,
    TaskKind,
    load_cluster,
    load_config,
    task_family,
    to_dict,
)

from embedtrain.sharding.planner import PlanError

ROOT = Path(__file__).parent.parent
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_load(path):
    cfg = load_config(path)
    assert isinstance(cfg, Config)
    from embedtrain.components import Component, check_keys, resolve

    for key in ("model", "task"):  # a component's keys are its signature's
        spec = getattr(cfg, key)
        if isinstance(spec, Component):
            check_keys(resolve(spec.path, key), spec.keys, key, {"features", "items", "device"})
    if not isinstance(cfg.model, Component):
        # the MLPs list hidden layers; their ends (embedding_dim, the logit) are derived
        assert cfg.model.bottom_mlp[-1] != cfg.model.embedding_dim and cfg.model.top_mlp[-1] != 1


def _write(tmp_path, text):
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return path


def _error(path, overrides=None) -> str:
    with pytest.raises(ConfigError) as err:
        load_config(path, overrides)
    message = str(err.value)
    assert "\n" not in message and str(path) in message
    return message


def test_values_and_overrides(tmp_path):
    path = _write(tmp_path, "model:\n  interaction: dcn\n  bottom_mlp: [8, 4]\noptim:\n  sparse_lr: 1\n")
    cfg = load_config(path, ["train.max_steps=7", "optim.sparse=sgd", "data.path=/x"])
    assert cfg.model.interaction is Interaction.DCN and cfg.model.bottom_mlp == [8, 4]
    assert cfg.optim.sparse_lr == 1.0 and isinstance(cfg.optim.sparse_lr, float)
    assert cfg.train.max_steps == 7 and cfg.optim.sparse is SparseOptimizer.SGD
    assert cfg.data.path == "/x"
    assert to_dict(cfg)["model"]["interaction"] == "dcn"


def test_unknown_key_names_path_and_suggests(tmp_path):
    message = _error(_write(tmp_path, "train:\n  batchsize: 3\n  epochs: 1\n"))
    assert "train.batchsize: unknown key" in message


def test_unknown_key_suggestion(tmp_path):
    message = _error(_write(tmp_path, "train:\n  eval_evry: 3\n"))
    assert "train.eval_evry: unknown key (did you mean 'eval_every'?)" in message


@pytest.mark.parametrize("text, expected", [
    ("train:\n  epochs: two\n", "train.epochs: expected an integer, got str 'two'"),
    ("train:\n  epochs: true\n", "train.epochs: expected an integer, got bool True"),
    ("data:\n  shuffle: 1\n", "data.shuffle: expected true or false"),
    ("model:\n  bottom_mlp: [8, x]\n", "model.bottom_mlp[1]: expected an integer"),
    ("model:\n  interaction: cross\n", "model.interaction: 'cross' is not one of dot, dcn"),
    ("model: 3\n", "model: expected a mapping"),
    ("- a\n- b\n", "top level must be a mapping"),
    ("train: [\n", "invalid YAML"),
])
def test_bad_values(tmp_path, text, expected):
    assert expected in _error(_write(tmp_path, text))


def test_bad_override(tmp_path):
    path = _write(tmp_path, "train: {}\n")
    assert "train.max_step: unknown key (did you mean 'max_steps'?)" in _error(path, ["train.max_step=3"])
    # an empty value names the key, not a path it would leave relative
    assert _error(path, ["data.path="]).endswith(": --set data.path=: no value given (--set "
                                                 "data.path=VALUE; data.path=null clears an "
                                                 "optional key)")


def test_an_empty_config_file_is_an_error(tmp_path):
    assert _error(_write(tmp_path, "")).endswith(": the file is empty (a config names at least its "
                                                 "data; see configs/ for examples)")


def test_missing_file(tmp_path):
    assert "config file not found" in _error(tmp_path / "nope.yaml")


def test_yaml_cannot_execute_code(tmp_path):
    path = _write(tmp_path, "data:\n  path: !!python/object/apply:os.system ['echo pwned']\n")
    assert "invalid YAML" in _error(path)


def _laughs(depth: int) -> str:
    """A "billion laughs" document: each level a list of ten aliases of the one before
    (10**depth strings once expanded), in a list-valued key."""
    lines = ["l0: &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    for i in range(1, depth + 1):
        lines.append(f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]")
    lines.append(f"data: {{path: /tmp/x, batch_size: 8}}\nmodel: {{bottom_mlp: *l{depth}}}")
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("depth", [6, 10, 30])
def test_an_alias_bomb_is_refused_at_once(tmp_path, depth):
    import time

    path = _write(tmp_path, _laughs(depth))
    start = time.perf_counter()
    error = _error(path)
    assert time.perf_counter() - start < 1.0
    assert "aliases expand to more than 100,000 values (refused)" in error and "line 1" in error


def test_an_alias_that_contains_itself_is_refused(tmp_path):
    path = _write(tmp_path, "data: &a {path: /tmp/x, batch_size: 8, more: [*a]}\n")
    assert "aliases expand to more than" in _error(path)


@pytest.mark.parametrize("nested", ["[" * 20_000 + "]" * 20_000, "{a: " * 5_000 + "1" + "}" * 5_000])
def test_a_value_nested_past_the_recursion_limit_is_one_line(tmp_path, nested):
    error = _error(_write(tmp_path, f"data: {nested}\n"))
    assert "invalid YAML: nested deeper than the" in error and "(refused)" in error


def test_a_config_that_is_not_utf8_is_one_line(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_bytes("data: {path: /tmp/caf\u00e9}\n".encode("latin-1"))
    assert "not UTF-8 text (byte 21: 0xe9); save the config file as UTF-8" in _error(path)


def test_a_few_aliases_and_merge_keys_still_load(tmp_path):
    cfg = load_config(_write(tmp_path, """
data: {<<: {batch_size: 64, eval_batch_size: 512}, path: /tmp/x, batch_size: 128}
model: {bottom_mlp: &mlp [16, 8], top_mlp: [16, 1], embedding_dim: 8}
xc: {mlp: *mlp}
"""))
    assert cfg.data.batch_size == 128 and cfg.data.eval_batch_size == 512  # merged, overridden
    assert cfg.xc.mlp == cfg.model.bottom_mlp == [16, 8]


@pytest.mark.parametrize("text,line", [
    ("data: {path: /tmp/x}\ntrain: {max_steps: 5}\ntrain: {epochs: 2}\n", 3),
    ("data: {path: /tmp/x, batch_size: 8, batch_size: 16}\n", 1),
])
def test_duplicate_keys_are_refused_with_their_lines(tmp_path, text, line):
    error = _error(_write(tmp_path, text))
    assert f"(line {line}," in error and "duplicate key" in error and "first at line" in error


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    """A tiny data set of each task family, for the shipped configs that train on local data."""
    from embedtrain.testing import (
        tiny_ctr_dataset, tiny_graph_dataset, tiny_retrieval_dataset, tiny_seq_dataset,
        tiny_xc_dataset)

    root = tmp_path_factory.mktemp("shipped")
    graph = tiny_graph_dataset(root / "graph")
    return {TaskKind.CTR: tiny_ctr_dataset(root / "ctr", rows=3000),
            TaskKind.XC: tiny_xc_dataset(root / "xc"),
            TaskKind.GNN_NODE: graph, TaskKind.GNN_LINK: graph,
            TaskKind.SEQ: tiny_seq_dataset(root / "seq"),
            TaskKind.RETRIEVAL: tiny_retrieval_dataset(root / "retrieval")}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_build_on_meta_and_plan(path, tiny_data):
    """What each shipped config describes is built (on ``meta``: no memory) and planned: its data
    set where the repository has one (configs/datasets/), else a tiny one of its task."""
    from embedtrain.recipes import plan_model

    cfg = load_config(path)
    family = task_family(cfg)
    big = "datasets" in Path(cfg.data.path).parts
    if not big:
        cfg.data.path = str(tiny_data[family])
    cluster = load_cluster(ROOT / "configs/clusters" /
                           ("h100-16x8.yaml" if big else "cpu-1x2.yaml"))
    if cfg.task is TaskKind.GNN_NODE and not cfg.gnn.embedding_dim:  # features only
        with pytest.raises(PlanError, match=r"nothing to plan: the model has no embedding "
                                            r"tables .* holding its whole [0-9.]+ MiB dense"):
            plan_model(cfg, cluster)
        cfg.gnn.embedding_dim = 8  # the same model with a node-id table plans
    report = plan_model(cfg, cluster).report.to_dict()
    assert report["model"]["task"] == family.value
    assert report["tables"] and all(t["shards"] for t in report["tables"])
    assert report["summary"]["peak_rank_memory_bytes"] <= report["summary"][
        "rank_memory_capacity_bytes"]


def test_shipped_config_paths_are_relative_to_the_config_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # any working directory
    cfg = load_config(ROOT / "configs" / "dlrm.yaml")
    assert cfg.data.path == str(ROOT / "configs" / "datasets" / "criteo_1tb")
    assert load_config(ROOT / "configs" / "dlrm_synthetic.yaml").data.path == str(
        ROOT / "data" / "synthetic_ctr")
    # --set paths are the working directory's; absolute paths stay as they are.
    cfg = load_config(ROOT / "configs" / "dlrm.yaml", ["data.path=mine"])
    assert cfg.data.path == str(tmp_path / "mine")
    path = _write(tmp_path, "data:\n  path: /abs/olute\n")
    assert load_config(path).data.path == "/abs/olute"


@pytest.mark.parametrize("text", ["1e-3", "1E-3", "1.0e-3", "+1e-3", "0.001"])
def test_yaml_1_2_floats(tmp_path, text):
    cfg = load_config(_write(tmp_path, f"optim:\n  dense_lr: {text}\n"))
    assert cfg.optim.dense_lr == pytest.approx(0.001)
    cfg = load_config(_write(tmp_path, "optim: {}\n"), [f"optim.dense_lr={text}", "optim.sparse_lr=5E-2"])
    assert cfg.optim.dense_lr == pytest.approx(0.001) and cfg.optim.sparse_lr == 0.05


@pytest.mark.parametrize("text, expected", [
    ("model:\n  embedding_dim: 0\n", "model.embedding_dim: must be a positive multiple of 4, got 0"),
    ("model:\n  embedding_dim: 6\n", "model.embedding_dim: must be a positive multiple of 4, got 6"),
    ("model:\n  top_mlp: [32, 0, 1]\n", "model.top_mlp[1]: must be positive, got 0"),
    ("optim:\n  dense_lr: -1e-3\n", "optim.dense_lr: must be positive, got -0.001"),
    ("optim:\n  sparse_lr: 0\n", "optim.sparse_lr: must be positive, got 0.0"),
    ("data:\n  batch_size: -8\n", "data.batch_size: must be positive, got -8"),
    ("train:\n  epochs: 0\n", "train.epochs: must be positive (or auto), got 0"),
    ("head:\n  sample_rate: 1.5\n", "head.sample_rate: must be in [0, 1], got 1.5"),
    ("gnn:\n  fanouts: [10, 0]\n", "gnn.fanouts[1]: must be positive, or -1 for all"),
    ("gnn:\n  dropout: 1.0\n", "gnn.dropout: must be in [0, 1), got 1.0"),
    ("optim:\n  dense_lr: .nan\n", "optim.dense_lr: must be positive, got nan"),
])
def test_out_of_range_values_are_one_line(tmp_path, text, expected):
    assert expected in _error(_write(tmp_path, text))
    key, _, value = text.replace(":\n    ", ".").replace(":\n  ", ".").strip().partition(": ")
    assert expected in _error(_write(tmp_path, "model: {}\n"), [f"{key}={value}"])  # and through --set


def test_generic_loader_required_keys_mappings_and_extra_keys(tmp_path):
    """config_io's from_dict: a field without default is required, dict[str, X] values are
    checked per key, and ignore_unknown skips keys the reader does not need (metadata.json)."""
    import dataclasses

    from embedtrain.config_io import POSITIVE, config_field, from_dict

    @dataclasses.dataclass
    class Part:
        files: list[str]
        rows: int = config_field(-1)

    @dataclasses.dataclass
    class File:
        label: str
        parts: dict[str, Part]
        size: int = config_field(1, check=POSITIVE)

    f = from_dict(File, {"label": "y", "parts": {"a": {"files": ["x"]}}, "other": 1},
                  source="m.json", ignore_unknown=True)
    assert f.parts["a"] == Part(files=["x"], rows=-1) and f.size == 1
    with pytest.raises(ConfigError, match=r"^m\.json: label: missing$"):
        from_dict(File, {"parts": {}}, source="m.json")
    with pytest.raises(ConfigError, match=r"^m\.json: parts\.a\.files: missing$"):
        from_dict(File, {"label": "y", "parts": {"a": {}}}, source="m.json")
    with pytest.raises(ConfigError, match=r"^m\.json: parts\.a\.rows: expected an integer"):
        from_dict(File, {"label": "y", "parts": {"a": {"files": [], "rows": "3"}}}, source="m.json")
    with pytest.raises(ConfigError, match=r"^m\.json: other: unknown key"):
        from_dict(File, {"label": "y", "parts": {}, "other": 1}, source="m.json")


def test_dataset_metadata_errors_name_the_key(tmp_path):
    """metadata.json goes through the generic loader: missing or mistyped keys are one line."""
    import json

    from embedtrain.features import DatasetError, load_dataset_meta

    good = {"label": "y", "dense": ["d"], "sparse": [{"name": "c", "num_embeddings": 5}],
            "splits": {"train": {"files": ["t.parquet"], "rows": 3}}, "generator": {"x": 1}}
    cases = [({}, None), ({"sparse": [{"name": "c"}]}, r"sparse\[0\]\.num_embeddings: missing"),
             ({"sparse": [{"name": "c", "num_embeddings": 0}]},
              r"sparse\[0\]\.num_embeddings: must be positive"),
             ({"sparse": [{"name": "c", "num_embeddings": 2**70}]},
              r"sparse\[0\]\.num_embeddings: must be positive and fit an int64 id"),
             ({"splits": {"train": {"rows": 3}}}, r"splits\.train\.files: missing"),
             ({"dense_transform": "sqrt"}, r"dense_transform: 'sqrt' is not one of")]
    for i, (change, error) in enumerate(cases):
        root = tmp_path / str(i)
        root.mkdir()
        (root / "metadata.json").write_text(json.dumps({**good, **change}))
        if error is None:
            meta = load_dataset_meta(root)
            assert meta.split_rows == {"train": 3} and meta.extra["generator"] == {"x": 1}
            assert meta.features.sparse[0].num_embeddings == 5
            continue
        with pytest.raises(DatasetError, match=rf"metadata\.json: {error}"):
            load_dataset_meta(root)


def test_saved_run_config_of_an_earlier_version_still_loads(tmp_path):
    """A run's config.yaml written when train.pipeline was a boolean that did nothing loads for
    eval/--resume (the boolean is left out); a config the user writes with it is refused (the
    key now takes none, sparse_dist or semi_sync)."""
    from embedtrain.config import dump_config, load_run_config, to_dict

    cfg = load_config("configs/dlrm_synthetic.yaml")
    saved = tmp_path / "config.yaml"
    dump_config(cfg, saved)
    assert "  pipeline: none\n" in saved.read_text()
    text = saved.read_text().replace("  pipeline: none\n", "  pipeline: true\n", 1)
    saved.write_text(text)
    assert to_dict(load_run_config(saved)) == to_dict(cfg)
    with pytest.raises(ConfigError, match=r"train\.pipeline: .*none.*sparse_dist"):
        load_config(saved)
    piped = tmp_path / "piped.yaml"
    piped.write_text(saved.read_text().replace("pipeline: true", "pipeline: sparse_dist"))
    assert load_run_config(piped).train.pipeline.value == "sparse_dist"  # a value of today


def test_the_head_moved_out_of_the_xc_section(tmp_path):
    """xc.head and xc.top_k are read as head and head.top_k (the seq family's head too), from a
    file and from --set alike: a config or run written before the move loads the same."""
    new = _write(tmp_path, "task: seq\nhead: {kind: partial_fc, top_k: [10]}\n")
    cfg = load_config(new)
    old = tmp_path / "old.yaml"
    old.write_text("task: seq\nxc: {head: {kind: partial_fc}, top_k: [10]}\n")
    assert load_config(old) == cfg
    assert load_config(new, ["xc.head.kind=mach", "xc.top_k=[5]"]).head == dataclasses.replace(
        cfg.head, kind=HeadKind.MACH, top_k=[5])
    both = tmp_path / "both.yaml"
    both.write_text("xc: {head: {kind: mach}}\nhead: {kind: full}\n")
    assert "xc.head (moved to head) and head: give it once, as head" in _error(both)


def test_text_fields_take_numbers_and_single_values_as_text():
    """config_field(text=True): values compared with a column's text read YAML numbers and
    booleans as their text, and one value where a list is expected (a graph split column)."""
    import dataclasses
    from typing import Optional

    from embedtrain.config_io import config_field, from_dict

    @dataclasses.dataclass
    class Split:
        values: Optional[dict[str, list[str]]] = config_field(None, text=True)
        plain: list[str] = config_field(factory=list)

    got = from_dict(Split, {"values": {"train": 0, "valid": [1, 2.5], "test": True}})
    assert got.values == {"train": ["0"], "valid": ["1", "2.5"], "test": ["true"]}
    with pytest.raises(ConfigError, match=r"plain\[0\]: expected a string, got int 0"):
        from_dict(Split, {"plain": [0]})


def test_all_is_a_spelling_of_no_cap():
    # the cap on evaluation batches: "all" (or null) is every batch; 0 is refused, naming "all"
    demo = str(ROOT / "configs" / "dlrm_synthetic.yaml")
    assert load_config(demo, ["train.eval_max_batches=all"]).train.eval_max_batches is None
    assert load_config(demo, ["train.eval_max_batches=4"]).train.eval_max_batches == 4
    with pytest.raises(ConfigError, match=r"train\.eval_max_batches: must be positive \(or all\), "
                                          r"got 0$"):
        load_config(demo, ["train.eval_max_batches=0"])
    with pytest.raises(ConfigError, match="expected an integer"):
        load_config(demo, ["train.eval_max_batches=every"])

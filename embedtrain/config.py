"""Typed configuration: YAML files mapped onto dataclasses, with ``--set a.b=c`` overrides.

Configs are resolved once, at the entry point (the CLI); library code receives the dataclasses (or
the objects built from them), never YAML. Loading uses ``yaml.safe_load`` only, so a config file can
never execute code.

Every problem is reported as a :class:`ConfigError` whose message is one line naming the file and
the dotted key path, e.g. ``configs/dlrm.yaml: train.batch_sise: unknown key (did you mean
'batch_size'?)``. Values are checked where they are read: sizes, rates and counts out of range
(``model.embedding_dim: 0``, ``optim.dense_lr: -1``) are errors of the file and key too.

Numbers follow YAML 1.2: ``1e-3`` and ``1E-3`` are floats (PyYAML's YAML 1.1 resolver reads them
as strings), in files and in ``--set``. Relative paths (``data.path``) in a file are taken
relative to that file's directory, so a config works from any working directory; a path given by
``--set`` is relative to the working directory; a default is left as it is.

Example:
    >>> cfg = load_config("configs/dlrm_synthetic.yaml", overrides=["train.max_steps=10"])
    >>> cfg.train.max_steps
    10
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, TypeVar, Union

import yaml


T = TypeVar("T")


class ConfigError(ValueError):
    """A config problem; ``str(err)`` is one line naming the file and the key path."""


# Checks of single values, run where a file or --set gives them: (test, what the error says).
_POSITIVE = (lambda v: v > 0, "must be positive")
_NON_NEGATIVE = (lambda v: v >= 0, "must be at least 0")
_FRACTION = (lambda v: 0 < v <= 1, "must be in (0, 1]")
_PROBABILITY = (lambda v: 0 <= v < 1, "must be in [0, 1)")
_UNIT = (lambda v: 0 <= v <= 1, "must be in [0, 1]")
_FANOUT = (lambda v: v > 0 or v == -1, "must be positive, or -1 for all neighbours")


def _field(default: Any = dataclasses.MISSING, *, factory: Any = dataclasses.MISSING,
           check: Optional[tuple[Callable[[Any], bool], str]] = None, path: bool = False) -> Any:
    """A config field; ``check`` applies to the value (each element of a list), ``path`` marks
    a file path resolved against the config file's directory."""
    metadata = {"check": check, "path": path}
    if factory is not dataclasses.MISSING:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


class TaskKind(enum.Enum):
    CTR = "ctr"  # click-through rate: DLRM / DCNv2 (section ``model``)
    XC = "xc"  # extreme classification: encoder + class head (section ``xc``)
    GNN_NODE = "gnn_node"  # node classification with GraphSAGE on sampled neighbourhoods (``gnn``)
    GNN_LINK = "gnn_link"  # link prediction with GraphSAGE on sampled neighbourhoods (``gnn``)


class Interaction(enum.Enum):
    """How a DLRM combines its dense and sparse features."""

    DOT = "dot"  # DLRM's pairwise dot products
    DCN = "dcn"  # DCNv2 low-rank cross layers


class SparseOptimizer(enum.Enum):
    """Optimizers fused into the embedding backward pass (FBGEMM TBE)."""

    ROWWISE_ADAGRAD = "rowwise_adagrad"
    ADAGRAD = "adagrad"
    SGD = "sgd"
    ADAM = "adam"


class DenseOptimizer(enum.Enum):
    ADAM = "adam"
    ADAGRAD = "adagrad"
    SGD = "sgd"
    LAMB = "lamb"  # Adam with a layer-wise trust ratio, for large batches
    LARS = "lars"  # SGD-momentum with a layer-wise trust ratio, for large batches


class LRDecay(enum.Enum):
    """Learning-rate decay after the linear warmup."""

    NONE = "none"
    COSINE = "cosine"
    STEP = "step"


class DenseAllReduce(enum.Enum):
    """How the dense gradients are all-reduced (DDP communication hooks)."""

    FP32 = "fp32"  # plain all-reduce
    BF16 = "bf16"  # compress to bfloat16 for the wire (half the bytes)
    FP16 = "fp16"  # compress to float16
    POWERSGD = "powersgd"  # low-rank PowerSGD compression (with error feedback)


@dataclass
class DataConfig:
    """Where the data set lives and how it is batched.

    ``path`` is a directory holding ``metadata.json`` (written by ``embedtrain datagen`` or
    ``embedtrain ingest``); relative to the config file's directory when the file gives it,
    to the working directory when ``--set`` does.
    """

    path: str = _field("data/synthetic_ctr", path=True)
    batch_size: int = _field(2048, check=_POSITIVE)
    eval_batch_size: int = _field(8192, check=_POSITIVE)
    shuffle: bool = True
    # Leave out an epoch's last, partial step (counted in summary.json's dropped_rows_per_epoch);
    # false: every row once per epoch, the last step padded where the ranks' shares differ.
    drop_last: bool = False
    shuffle_buffer_rows: int = _field(262_144, check=_POSITIVE)  # rows mixed before batches are cut
    # background loader threads per rank (0: read in the training thread)
    num_workers: int = _field(2, check=_NON_NEGATIVE)
    prefetch_batches: int = _field(8, check=_POSITIVE)  # batches the loader may hold ready


@dataclass
class ModelConfig:
    """DLRM / DCNv2 architecture; all embedding tables share ``embedding_dim``."""

    interaction: Interaction = Interaction.DOT
    embedding_dim: int = _field(16, check=_POSITIVE)
    bottom_mlp: list[int] = _field(factory=lambda: [64, 16], check=_POSITIVE)
    top_mlp: list[int] = _field(factory=lambda: [128, 64, 1], check=_POSITIVE)
    dcn_num_layers: int = _field(3, check=_POSITIVE)
    dcn_low_rank_dim: int = _field(64, check=_POSITIVE)


class HeadKind(enum.Enum):
    """The extreme-classification head (see ``embedtrain.models.class_head``)."""

    FULL = "full"  # exact softmax, classes split across ranks
    PARTIAL_FC = "partial_fc"  # positives + uniform negatives at sample_rate, per rank
    HARD_NEGATIVES = "hard_negatives"  # positives + nearest classes from a refreshed index
    ADAPTIVE = "adaptive"  # adaptive softmax over frequency-sorted classes (single-label)
    MACH = "mach"  # R hashings of the classes into B buckets, R small heads


class Margin(enum.Enum):
    """Margin on the positives' logits; not ``none``: features and class weights normalised."""

    NONE = "none"
    COSFACE = "cosface"  # s * (cos - m)
    ARCFACE = "arcface"  # s * cos(theta + m)


class Pooling(enum.Enum):
    SUM = "sum"
    MEAN = "mean"


class HeadOptimizer(enum.Enum):
    """Optimizer of a sharded class head (sparse-capable: sampled heads update sampled rows)."""

    ADAGRAD = "adagrad"
    SGD = "sgd"


@dataclass
class HeadConfig:
    """The class head of an XC model and its optimizer."""

    kind: HeadKind = HeadKind.FULL
    # partial_fc; hard_negatives' extra uniform sample (0: none)
    sample_rate: float = _field(0.1, check=_UNIT)
    hard_negatives: int = _field(10, check=_NON_NEGATIVE)  # nearest classes per example and rank
    refresh_every: int = _field(100, check=_POSITIVE)  # hard_negatives: steps between rebuilds
    margin: Margin = Margin.NONE
    margin_value: float = _field(0.35, check=_NON_NEGATIVE)  # m (CosFace ~0.35, ArcFace ~0.5)
    scale: float = _field(30.0, check=_POSITIVE)  # s, logit scale of the normalised heads
    cutoffs: list[int] = _field(factory=list, check=_POSITIVE)  # adaptive; empty: chosen from C
    div_value: float = _field(4.0, check=_POSITIVE)  # adaptive: dimension divisor per cluster
    mach_buckets: int = _field(0, check=_NON_NEGATIVE)  # mach: B (0: about sqrt(C), >= 64)
    mach_repetitions: int = _field(4, check=_POSITIVE)  # mach: R
    optimizer: HeadOptimizer = HeadOptimizer.ADAGRAD  # sharded heads (others: optim.dense)
    lr: float = _field(0.05, check=_POSITIVE)


@dataclass
class XCConfig:
    """Extreme classification: bag-of-ids encoder (+ dense features) -> MLP -> class head."""

    embedding_dim: int = _field(64, check=_POSITIVE)  # token tables' dimension
    pooling: Pooling = Pooling.MEAN
    # last: the feature dimension D
    mlp: list[int] = _field(factory=lambda: [256, 128], check=_POSITIVE)
    head: HeadConfig = field(default_factory=HeadConfig)
    top_k: list[int] = _field(factory=lambda: [1, 5], check=_POSITIVE)  # P@k, nDCG@k, recall@k


class NegativeSampling(enum.Enum):
    UNIFORM = "uniform"  # negatives drawn uniformly over the nodes
    DEGREE = "degree"  # proportional to degree^0.75


@dataclass
class GNNConfig:
    """GraphSAGE on sampled neighbourhoods: node-id table + features -> one SAGEConv per hop."""

    model: str = "sage"  # sage, or mlp: the same layers on the node alone (a no-graph baseline)
    # neighbours per hop (-1: all)
    fanouts: list[int] = _field(factory=lambda: [15, 10], check=_FANOUT)
    # empty: the training fanouts
    eval_fanouts: list[int] = _field(factory=list, check=_FANOUT)
    hidden: list[int] = _field(factory=lambda: [128, 128], check=_POSITIVE)  # one SAGEConv a hop
    embedding_dim: int = _field(32, check=_NON_NEGATIVE)  # node-id table width (0: features only)
    aggr: str = "mean"  # SAGEConv aggregation: mean, max or sum
    dropout: float = _field(0.0, check=_PROBABILITY)
    weighted: bool = False  # sample neighbours by edge weight
    # link prediction: the node embedding size scored by dot products
    out_dim: int = _field(64, check=_POSITIVE)
    negatives: int = _field(1, check=_POSITIVE)  # link prediction: negatives per positive edge
    negative_sampling: NegativeSampling = NegativeSampling.UNIFORM
    link_ks: list[int] = _field(factory=lambda: [1, 3, 10], check=_POSITIVE)  # Hits@K


@dataclass
class OptimConfig:
    sparse: SparseOptimizer = SparseOptimizer.ROWWISE_ADAGRAD
    sparse_lr: float = _field(0.05, check=_POSITIVE)
    dense: DenseOptimizer = DenseOptimizer.ADAM
    dense_lr: float = _field(1e-3, check=_POSITIVE)
    weight_decay: float = _field(0.0, check=_NON_NEGATIVE)
    momentum: float = _field(0.9, check=_PROBABILITY)  # sgd and lars
    warmup_steps: int = _field(0, check=_NON_NEGATIVE)  # linear warmup of the dense lr
    lr_decay: LRDecay = LRDecay.NONE
    lr_step_size: int = _field(1000, check=_POSITIVE)  # steps between decays (lr_decay: step)
    lr_gamma: float = _field(0.1, check=_POSITIVE)  # factor per decay (lr_decay: step)
    # floor of the cosine decay, as a fraction of dense_lr
    min_lr_ratio: float = _field(0.0, check=_UNIT)


@dataclass
class TrainConfig:
    epochs: int = _field(1, check=_POSITIVE)
    # stop early after this many steps (overrides epochs)
    max_steps: Optional[int] = _field(None, check=_POSITIVE)
    # steps between validation evaluations; 0: only at the end
    eval_every: int = _field(500, check=_NON_NEGATIVE)
    # cap on validation batches per evaluation
    eval_max_batches: Optional[int] = _field(None, check=_POSITIVE)
    # steps between checkpoints; 0: only at the end
    checkpoint_every: int = _field(1000, check=_NON_NEGATIVE)
    keep_checkpoints: int = _field(2, check=_POSITIVE)
    seed: int = 0
    progress: bool = True
    grad_accumulation: int = _field(1, check=_POSITIVE)  # micro-batches per dense optimizer step
    bf16_dense: bool = False  # run the dense part under bfloat16 autocast
    pipeline: bool = True  # TorchRec's TrainPipelineSparseDist where the device supports it


class ShardingType(enum.Enum):
    """How one embedding table (or class head) is split across ranks (TorchRec's names)."""

    TABLE_WISE = "table_wise"
    ROW_WISE = "row_wise"
    COLUMN_WISE = "column_wise"
    TABLE_ROW_WISE = "table_row_wise"
    TABLE_COLUMN_WISE = "table_column_wise"
    DATA_PARALLEL = "data_parallel"


class ComputeKernel(enum.Enum):
    """Where a shard's rows live and which kernel looks them up (TorchRec's names)."""

    DENSE = "dense"  # plain tensor; only for data_parallel
    FUSED = "fused"  # FBGEMM TBE with the optimizer fused, rows in device memory (HBM)
    FUSED_UVM = "fused_uvm"  # rows in host memory (UVM), read over PCIe
    FUSED_UVM_CACHING = "fused_uvm_caching"  # rows in host memory, hot rows cached in HBM


class CommPrecision(enum.Enum):
    """Precision of the embedding all-to-all (TorchRec qcomms); lower halves the bytes sent."""

    FP32 = "fp32"
    FP16 = "fp16"
    BF16 = "bf16"


@dataclass
class TableConstraint:
    """Constraints for the tables whose names match ``tables`` (names or globs, e.g. ``t_C*``).

    Empty lists mean "no constraint"; ``pooling_factor`` overrides the one measured from data.
    """

    tables: list[str] = field(default_factory=list)
    sharding_types: list[ShardingType] = field(default_factory=list)
    compute_kernels: list[ComputeKernel] = field(default_factory=list)
    # fraction of rows cached in HBM (uvm_caching)
    cache_load_factor: Optional[float] = _field(None, check=_FRACTION)
    pooling_factor: Optional[float] = _field(None, check=_POSITIVE)  # mean ids per example


@dataclass
class ShardingConfig:
    """What the planner may choose from, and how the embedding all-to-all is encoded."""

    # Empty: all but data_parallel, which is used only where listed (globally or per table): it
    # replicates the table, all-reduces its gradient every step and hands it to the dense optimizer.
    sharding_types: list[ShardingType] = field(default_factory=list)
    compute_kernels: list[ComputeKernel] = field(default_factory=list)  # empty: all
    tables: list[TableConstraint] = field(default_factory=list)
    forward_comm_precision: CommPrecision = CommPrecision.FP32
    backward_comm_precision: CommPrecision = CommPrecision.FP32
    pooling_factors_from_data: bool = True  # measure mean ids per example from the train split
    dense_allreduce: DenseAllReduce = DenseAllReduce.FP32
    powersgd_rank: int = _field(2, check=_POSITIVE)  # matrix rank of PowerSGD's approximation
    # extra partitions the planner's local search may try
    search_budget: int = _field(48, check=_NON_NEGATIVE)


@dataclass
class Config:
    """The whole training config: one section per concern."""

    task: TaskKind = TaskKind.CTR
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    xc: XCConfig = field(default_factory=XCConfig)
    gnn: GNNConfig = field(default_factory=GNNConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    sharding: ShardingConfig = field(default_factory=ShardingConfig)


class DeviceKind(enum.Enum):
    CUDA = "cuda"
    CPU = "cpu"


@dataclass
class ClusterConfig:
    """A target cluster for planning and training (``configs/clusters/*.yaml``).

    Memory sizes are GiB per device; bandwidths are GB/s (1 GB = 2^30 bytes, as TorchRec's
    planner counts), so a 25 Gbit/s network is ``inter_host_gb_per_s: 2.9``.
    """

    name: str = "local"
    hosts: int = 1
    devices_per_host: int = 1
    device: DeviceKind = DeviceKind.CUDA
    hbm_gb: float = 80.0  # device memory per GPU (unused for cpu)
    ddr_gb: float = 128.0  # host memory per device (per rank)
    hbm_bandwidth_gb_per_s: float = 897.0  # device memory bandwidth
    ddr_bandwidth_gb_per_s: float = 51.0  # host memory bandwidth
    intra_host_gb_per_s: float = 600.0  # between devices of one host (NVLink)
    inter_host_gb_per_s: float = 12.5  # between hosts, per device (network)
    batch_size_per_rank: int = 512
    reserved_fraction: float = 0.1  # device memory kept free: allocator, activations, context

    @property
    def world_size(self) -> int:
        return self.hosts * self.devices_per_host


def check_world_size(cfg: Config, world_size: int, source: str = "") -> None:
    """The global batches split evenly over ``world_size`` ranks (checked before launching).

    Raises:
        ConfigError: naming ``source`` (the config file, if given) and the key.
    """
    prefix = f"{source}: " if source else ""
    for key in ("batch_size", "eval_batch_size"):
        value = getattr(cfg.data, key)
        if value % world_size:
            raise ConfigError(f"{prefix}data.{key}: {value} (the global batch) does not split "
                              f"evenly over {world_size} ranks; use a multiple of {world_size}")


# Config keys a resumed run may change: how long it trains and how often it evaluates and
# checkpoints, and loader knobs that do not change the batches. Anything else (the model, the
# data, the optimizer, the batches) would make the resumed run something else.
RESUME_SAFE_KEYS = frozenset({
    "train.epochs", "train.max_steps", "train.eval_every", "train.eval_max_batches",
    "train.checkpoint_every", "train.keep_checkpoints", "train.progress", "train.pipeline",
    "data.num_workers", "data.prefetch_batches", "data.eval_batch_size",
})


def load_cluster(path: str | os.PathLike, overrides: Optional[list[str]] = None) -> ClusterConfig:
    """Reads a cluster description (``configs/clusters/*.yaml``); errors as in :func:`load_config`."""
    cluster = load_dataclass(path, ClusterConfig, overrides)
    for key in ("hosts", "devices_per_host", "batch_size_per_rank"):
        if getattr(cluster, key) <= 0:
            raise ConfigError(f"{path}: {key}: must be positive, got {getattr(cluster, key)}")
    for key in ("hbm_gb", "ddr_gb", "hbm_bandwidth_gb_per_s", "ddr_bandwidth_gb_per_s",
                "intra_host_gb_per_s", "inter_host_gb_per_s"):
        if getattr(cluster, key) <= 0:
            raise ConfigError(f"{path}: {key}: must be positive, got {getattr(cluster, key)}")
    if not 0 <= cluster.reserved_fraction < 1:
        raise ConfigError(f"{path}: reserved_fraction: must be in [0, 1), got "
                          f"{cluster.reserved_fraction}")
    return cluster


def load_config(path: str | os.PathLike, overrides: Optional[list[str]] = None) -> Config:
    """Reads a YAML training config file into a :class:`Config`.

    Args:
        path: the YAML file.
        overrides: ``key.path=value`` strings; values are parsed as YAML scalars/lists
            (``train.max_steps=10``, ``model.bottom_mlp=[32,16]``).

    Returns:
        The resolved config.

    Raises:
        ConfigError: missing/unreadable file, invalid YAML, unknown key, wrong type or value.
    """
    return load_dataclass(path, Config, overrides)


def load_dataclass(
    path: str | os.PathLike, cls: type[T], overrides: Optional[list[str]] = None
) -> T:
    """Reads a YAML file into dataclass ``cls`` (any config-like dataclass, e.g. an ingest spec).

    Supported field types: ``int``, ``float``, ``bool``, ``str``, enums, ``Optional[...]``,
    ``list[...]`` and nested dataclasses (also inside lists). Errors as in :func:`load_config`.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    try:
        raw = yaml.load(path.read_text(), Loader=SafeLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{path}: invalid YAML{where}: {problem}") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections, got {type(raw).__name__}")
    _resolve_paths(cls, raw, path.resolve().parent)
    for item in overrides or []:
        _apply_override(raw, item, path, cls)
    return from_dict(cls, raw, source=str(path))


class SafeLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` with YAML 1.2's float rule: ``1e-3``, ``1E-3``, ``5e4`` are floats."""


SafeLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                  |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
                  |[-+]?\.[0-9_]+(?:[eE][-+]?[0-9]+)?
                  |[-+]?\.(?:inf|Inf|INF)
                  |\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."))


def parse_scalar(text: str) -> Any:
    """A ``--set`` value as YAML (1.2 floats); text that is not valid YAML stays a string."""
    try:
        return yaml.load(text, Loader=SafeLoader) if text.strip() else ""
    except yaml.YAMLError:
        return text


def _fields_and_hints(cls: type) -> tuple[dict[str, Any], dict[str, type]]:
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    return fields, typing.get_type_hints(cls)


def _resolve_paths(cls: type, raw: Any, base: Path) -> None:
    """Makes the relative paths ``raw`` gives (fields marked ``path``) relative to ``base``."""
    if not isinstance(raw, dict):
        return  # from_dict reports it
    fields, hints = _fields_and_hints(cls)
    for key, value in raw.items():
        f = fields.get(key)
        if f is None:
            continue
        if f.metadata.get("path") and isinstance(value, str) and value:
            raw[key] = _absolute(value, base)
        elif dataclasses.is_dataclass(hints[key]):
            _resolve_paths(hints[key], value, base)


def _absolute(value: str, base: Path) -> str:
    expanded = Path(os.path.expanduser(value))
    return str(expanded if expanded.is_absolute() else Path(os.path.normpath(base / expanded)))


def changed_keys(old: Any, new: Any, prefix: str = "") -> dict[str, tuple[Any, Any]]:
    """``{key path: (old value, new value)}`` of every field that differs between two configs."""
    out: dict[str, tuple[Any, Any]] = {}
    if dataclasses.is_dataclass(old) and type(old) is type(new):
        for f in dataclasses.fields(old):
            out.update(changed_keys(getattr(old, f.name), getattr(new, f.name),
                                    f"{prefix}{f.name}."))
        return out
    if old != new:
        out[prefix.rstrip(".")] = (to_dict(old), to_dict(new))
    return out


def from_dict(cls: type, data: Any, source: str = "<config>", prefix: str = "") -> Any:
    """Builds dataclass ``cls`` from plain data, checking keys and types recursively."""
    if not isinstance(data, dict):
        where = prefix.rstrip(".") or "<top>"
        raise ConfigError(f"{source}: {where}: expected a mapping, got {_describe(data)}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in data.items():
        key_path = f"{prefix}{key}"
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else f" (known: {', '.join(fields)})"
            raise ConfigError(f"{source}: {key_path}: unknown key{hint}")
        kwargs[key] = _convert(hints[key], value, source, key_path)
        check = fields[key].metadata.get("check")
        if check is not None:
            _check(kwargs[key], check, source, key_path)
    return cls(**kwargs)


def _check(value: Any, check: tuple[Callable[[Any], bool], str], source: str,
           key_path: str) -> None:
    if value is None:
        return
    test, what = check
    for i, v in enumerate(value) if isinstance(value, list) else [(None, value)]:
        if isinstance(v, float) and not math.isfinite(v) or not test(v):
            where = key_path if i is None else f"{key_path}[{i}]"
            raise ConfigError(f"{source}: {where}: {what}, got {v!r}")


def to_dict(obj: Any) -> Any:
    """Plain-data view of a config (enums as their values), suitable for YAML/JSON."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def dump_config(cfg: Any, path: str | os.PathLike) -> None:
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))


def _convert(tp: Any, value: Any, source: str, key_path: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _convert(inner, value, source, key_path)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, source, prefix=f"{key_path}.")
    if origin is list:
        (inner,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise _type_error(source, key_path, "a list", value)
        return [_convert(inner, v, source, f"{key_path}[{i}]") for i, v in enumerate(value)]
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        allowed = [m.value for m in tp]
        if value not in allowed:
            raise ConfigError(
                f"{source}: {key_path}: {value!r} is not one of {', '.join(map(str, allowed))}"
            )
        return tp(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise _type_error(source, key_path, "true or false", value)
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _type_error(source, key_path, "an integer", value)
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _type_error(source, key_path, "a number", value)
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise _type_error(source, key_path, "a string", value)
        return value
    raise TypeError(f"config type {tp!r} at {key_path} is not supported")  # a bug in this module


def _type_error(source: str, key_path: str, expected: str, value: Any) -> ConfigError:
    return ConfigError(f"{source}: {key_path}: expected {expected}, got {_describe(value)}")


def _describe(value: Any) -> str:
    if value is None:
        return "null"
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"


def _apply_override(raw: dict, item: str, path: Path, cls: Optional[type] = None) -> None:
    key, sep, text = item.partition("=")
    if not sep or not key:
        raise ConfigError(f"--set {item!r}: expected key.path=value")
    value = parse_scalar(text)
    node = raw
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{path}: {'.'.join(parts[: i + 1])}: --set {key}: not a section")
        node = child
        cls = _section(cls, part)
    if cls is not None and isinstance(value, str) and value:
        f = _fields_and_hints(cls)[0].get(parts[-1])
        if f is not None and f.metadata.get("path"):  # --set paths: the working directory's
            value = _absolute(value, Path.cwd())
    node[parts[-1]] = value


def _section(cls: Optional[type], name: str) -> Optional[type]:
    """The dataclass of section ``name`` of ``cls`` (None when unknown: from_dict reports it)."""
    if cls is None or not dataclasses.is_dataclass(cls):
        return None
    fields, hints = _fields_and_hints(cls)
    if name not in fields or not dataclasses.is_dataclass(hints[name]):
        return None
    return hints[name]

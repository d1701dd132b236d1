"""Typed configuration: YAML files mapped onto dataclasses, with ``--set a.b=c`` overrides.

Configs are resolved once, at the entry point (the CLI); library code receives the dataclasses (or
the objects built from them), never YAML. Loading uses ``yaml.safe_load`` only, so a config file can
never execute code.

Every problem is reported as a :class:`ConfigError` whose message is one line naming the file and
the dotted key path, e.g. ``configs/dlrm.yaml: train.batch_sise: unknown key (did you mean
'batch_size'?)``.

Example:
    >>> cfg = load_config("configs/dlrm_synthetic.yaml", overrides=["train.max_steps=10"])
    >>> cfg.train.max_steps
    10
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, TypeVar, Union

import yaml


T = TypeVar("T")


class ConfigError(ValueError):
    """A config problem; ``str(err)`` is one line naming the file and the key path."""


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
    ``embedtrain ingest``); a relative path is taken relative to the working directory.
    """

    path: str = "data/synthetic_ctr"
    batch_size: int = 2048
    eval_batch_size: int = 8192
    shuffle: bool = True
    drop_last: bool = True
    shuffle_buffer_rows: int = 262_144  # rows mixed together before batches are cut
    num_workers: int = 2  # background loader threads per rank (0: read in the training thread)
    prefetch_batches: int = 8  # assembled batches the loader may hold ready for training


@dataclass
class ModelConfig:
    """DLRM / DCNv2 architecture; all embedding tables share ``embedding_dim``."""

    interaction: Interaction = Interaction.DOT
    embedding_dim: int = 16
    bottom_mlp: list[int] = field(default_factory=lambda: [64, 16])
    top_mlp: list[int] = field(default_factory=lambda: [128, 64, 1])
    dcn_num_layers: int = 3
    dcn_low_rank_dim: int = 64


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
    sample_rate: float = 0.1  # partial_fc; hard_negatives' extra uniform sample (0: none)
    hard_negatives: int = 10  # hard_negatives: nearest classes per example and rank
    refresh_every: int = 100  # hard_negatives: steps between index rebuilds
    margin: Margin = Margin.NONE
    margin_value: float = 0.35  # m (CosFace ~0.35, ArcFace ~0.5)
    scale: float = 30.0  # s, logit scale of the normalised heads
    cutoffs: list[int] = field(default_factory=list)  # adaptive; empty: chosen from C
    div_value: float = 4.0  # adaptive: dimension divisor per tail cluster
    mach_buckets: int = 0  # mach: B (0: about sqrt(C), at least 64)
    mach_repetitions: int = 4  # mach: R
    optimizer: HeadOptimizer = HeadOptimizer.ADAGRAD  # sharded heads (others: optim.dense)
    lr: float = 0.05


@dataclass
class XCConfig:
    """Extreme classification: bag-of-ids encoder (+ dense features) -> MLP -> class head."""

    embedding_dim: int = 64  # token tables' dimension
    pooling: Pooling = Pooling.MEAN
    mlp: list[int] = field(default_factory=lambda: [256, 128])  # last: the feature dimension D
    head: HeadConfig = field(default_factory=HeadConfig)
    top_k: list[int] = field(default_factory=lambda: [1, 5])  # P@k, nDCG@k, recall@k


class NegativeSampling(enum.Enum):
    UNIFORM = "uniform"  # negatives drawn uniformly over the nodes
    DEGREE = "degree"  # proportional to degree^0.75


@dataclass
class GNNConfig:
    """GraphSAGE on sampled neighbourhoods: node-id table + features -> one SAGEConv per hop."""

    model: str = "sage"  # sage, or mlp: the same layers on the node alone (a no-graph baseline)
    fanouts: list[int] = field(default_factory=lambda: [15, 10])  # neighbours per hop (-1: all)
    eval_fanouts: list[int] = field(default_factory=list)  # empty: the training fanouts
    hidden: list[int] = field(default_factory=lambda: [128, 128])  # one SAGEConv per hop
    embedding_dim: int = 32  # node-id table width (0: features only)
    aggr: str = "mean"  # SAGEConv aggregation: mean, max or sum
    dropout: float = 0.0
    weighted: bool = False  # sample neighbours by edge weight
    out_dim: int = 64  # link prediction: the node embedding size scored by dot products
    negatives: int = 1  # link prediction: negatives per positive edge
    negative_sampling: NegativeSampling = NegativeSampling.UNIFORM
    link_ks: list[int] = field(default_factory=lambda: [1, 3, 10])  # Hits@K


@dataclass
class OptimConfig:
    sparse: SparseOptimizer = SparseOptimizer.ROWWISE_ADAGRAD
    sparse_lr: float = 0.05
    dense: DenseOptimizer = DenseOptimizer.ADAM
    dense_lr: float = 1e-3
    weight_decay: float = 0.0
    momentum: float = 0.9  # sgd and lars
    warmup_steps: int = 0  # linear warmup of the dense learning rate
    lr_decay: LRDecay = LRDecay.NONE
    lr_step_size: int = 1000  # steps between decays (lr_decay: step)
    lr_gamma: float = 0.1  # factor per decay (lr_decay: step)
    min_lr_ratio: float = 0.0  # floor of the cosine decay, as a fraction of dense_lr


@dataclass
class TrainConfig:
    epochs: int = 1
    max_steps: Optional[int] = None  # stop early after this many steps (overrides epochs)
    eval_every: int = 500  # steps between validation evaluations; 0: only at the end
    eval_max_batches: Optional[int] = None  # cap on validation batches per evaluation
    checkpoint_every: int = 1000  # steps between checkpoints; 0: only at the end
    keep_checkpoints: int = 2
    seed: int = 0
    progress: bool = True
    grad_accumulation: int = 1  # micro-batches per dense optimizer step
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
    cache_load_factor: Optional[float] = None  # fraction of rows cached in HBM (uvm_caching)
    pooling_factor: Optional[float] = None  # mean ids per example for this table


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
    powersgd_rank: int = 2  # matrix rank of PowerSGD's approximation
    search_budget: int = 48  # extra partitions the planner's local search may try


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
        raw = yaml.safe_load(path.read_text())
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
    for item in overrides or []:
        _apply_override(raw, item, path)
    return from_dict(cls, raw, source=str(path))


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
    return cls(**kwargs)


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


def _apply_override(raw: dict, item: str, path: Path) -> None:
    key, sep, text = item.partition("=")
    if not sep or not key:
        raise ConfigError(f"--set {item!r}: expected key.path=value")
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        value = text
    node = raw
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{path}: {'.'.join(parts[: i + 1])}: --set {key}: not a section")
        node = child
    node[parts[-1]] = value

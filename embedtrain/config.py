"""The training config schema: one dataclass per section of ``configs/*.yaml``.

Only the recipes (:mod:`embedtrain.recipes`) and the CLI read it: they turn its sections into the
plain arguments and typed specs that models, data, graph, sharding and the trainer take. Each
choice (enum) lives in the layer that gives it meaning and is imported from there; loading
(safe YAML, ``--set a.b=c`` overrides, one-line ``file: key.path`` errors, YAML 1.2 floats,
config-relative paths) is the generic :mod:`embedtrain.config_io`.

Example:
    >>> cfg = load_config("configs/dlrm_synthetic.yaml", overrides=["train.max_steps=10"])
    >>> cfg.train.max_steps
    10
"""

from __future__ import annotations

import dataclasses
import enum
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from embedtrain.config_io import (  # noqa: F401  (ConfigError ... to_dict: the CLI's imports)
    Component,
    FANOUT,
    NON_NEGATIVE,
    POSITIVE,
    PROBABILITY,
    UNIT,
    ConfigError,
    changed_keys,
    config_field,
    dump_config,
    load_dataclass,
    parse_scalar,
    read_yaml,
    to_dict,
)
from embedtrain.graph.types import NegativeSampling
from embedtrain.models.options import (
    Aggregation,
    DynamicTable,
    Eviction,
    GNNModel,
    HeadDtype,
    HeadKind,
    HeadLoss,
    Interaction,
    Margin,
    NegativeIndex,
    Pooling,
    Rounding,
    SeqModel,
    TableKind,
    mlp_sizes,
    replicated_head_refusal,
)
from embedtrain.sharding.types import (  # noqa: F401  (ClusterConfig, DeviceKind: cluster files)
    ClusterConfig,
    CommPrecision,
    ComputeKernel,
    DenseAllReduce,
    DeviceKind,
    PlannerOptions,
    ShardingType,
    TableConstraint,
)
from embedtrain.train.options import (
    SIZED, DenseOptimizer, HeadOptimizer, LRDecay, PipelineKind, Selection, SparseOptimizer,
    sized_schedule)

__all__ = [
    "Aggregation", "ClusterConfig", "CommPrecision", "ComputeKernel", "Config", "ConfigError",
    "DataConfig", "DenseAllReduce", "DenseOptimizer", "DeviceKind", "DynamicTable", "Eviction",
    "GNNConfig", "GNNModel",
    "HeadConfig", "HeadDtype", "HeadKind", "HeadLoss", "HeadOptimizer", "Interaction", "LRDecay", "Margin",
    "ModelConfig", "NegativeIndex", "NegativeSampling", "OptimConfig", "PipelineKind", "Pooling",
    "RESUME_SAFE_KEYS", "RETIRED_KEYS", "Rounding", "Selection", "SeqConfig", "SeqModel",
    "ShardingConfig", "ShardingType", "SparseOptimizer", "TableConstraint", "TableKind",
    "TableSpec", "TaskKind", "TrainConfig", "XCConfig", "changed_keys", "check_world_size", "dump_config", "load_cluster",
    "load_config", "load_run_config", "parse_scalar", "to_dict", "with_derived_sizes",
]


class TaskKind(enum.Enum):
    CTR = "ctr"  # click-through rate: DLRM / DCNv2 (section ``model``)
    XC = "xc"  # extreme classification: encoder + class head (section ``xc``)
    GNN_NODE = "gnn_node"  # node classification with GraphSAGE on sampled neighbourhoods (``gnn``)
    GNN_LINK = "gnn_link"  # link prediction with GraphSAGE on sampled neighbourhoods (``gnn``)
    SEQ = "seq"  # next item from a user's history: sequence encoder (``seq``) + ``head``
    RETRIEVAL = "retrieval"  # query and item towers (``model``: a component), in-batch softmax


@dataclass
class DataConfig:
    """Where the data set lives and how it is batched.

    ``path`` is a directory holding ``metadata.json`` (written by ``embedtrain datagen`` or
    ``embedtrain ingest``); relative to the config file's directory when the file gives it,
    to the working directory when ``--set`` does.
    """

    # the data set: a folder holding metadata.json (embedtrain datagen or ingest writes it)
    path: str = config_field("data/synthetic_ctr", path=True)
    partitions: Optional[list[str]] = None  # of a partitioned data set: read these (default all)
    # examples per training step over all ranks (the global batch, split evenly over them)
    batch_size: int = config_field(2048, check=POSITIVE)
    # examples per evaluation batch over all ranks (split evenly, as batch_size)
    eval_batch_size: int = config_field(8192, check=POSITIVE)
    # permute the row groups and mix rows in the shuffle buffer, seeded by (train.seed, epoch)
    shuffle: bool = True
    # Leave out an epoch's last, partial step (counted in summary.json's dropped_rows_per_epoch);
    # false: every row once per epoch, the last step padded where the ranks' shares differ.
    drop_last: bool = False
    # rows mixed before batches are cut
    shuffle_buffer_rows: int = config_field(262_144, check=POSITIVE)
    # background loader threads per rank (0: read in the training thread); auto: for parquet,
    # none on a CPU-only rank whose torch threads take every core (reading between steps, with
    # one idle-class thread reading ahead), else 2; the GNN loader: 2
    num_workers: Optional[int] = config_field(None, check=NON_NEGATIVE, none_spelled="auto")
    prefetch_batches: int = config_field(8, check=POSITIVE)  # batches the loader may hold ready


@dataclass
class ModelConfig:
    """DLRM / DCNv2 / DeepFM architecture; all embedding tables share ``embedding_dim``."""

    # how the features are combined: dot (DLRM), dcn (DCNv2) or fm (DeepFM)
    interaction: Interaction = Interaction.DOT
    # FBGEMM's table-batched kernels take widths in multiples of 4
    embedding_dim: int = config_field(16, check=(lambda v: v > 0 and v % 4 == 0,
                                                 "must be a positive multiple of 4"))
    # the bottom MLP ends at embedding_dim, the top one at 1 (the logit): each end is appended
    # where the list does not end with it already (models.options.mlp_sizes)
    bottom_mlp: list[int] = config_field(factory=lambda: [64], check=POSITIVE)
    # the top MLP's layers, over the interaction's output (ends at the logit, 1)
    top_mlp: list[int] = config_field(factory=lambda: [128, 64], check=POSITIVE)
    # interaction dcn: cross layers
    dcn_num_layers: int = config_field(3, check=POSITIVE)
    # interaction dcn: rank of each cross layer's low-rank weight
    dcn_low_rank_dim: int = config_field(64, check=POSITIVE)
    # dropout after each hidden layer of the bottom and top MLPs (0: none)
    dropout: float = config_field(0.0, check=PROBABILITY)
    # a first-order (wide) term: one weight per id, summed into the logit; None: on for
    # interaction fm (DeepFM has it), off for dot and dcn
    linear: Optional[bool] = None


@dataclass
class HeadConfig:
    """The class head of the classification families (``xc``: its classes, ``seq``: the items),
    its optimizer and the k of its top-k metrics."""

    # full, partial_fc, hard_negatives (sharded over the ranks), adaptive or mach (replicated)
    kind: HeadKind = HeadKind.FULL
    # P@k, nDCG@k, recall@k, PSP@k (xc); HR@k, NDCG@k (seq); the top-k predict writes
    top_k: list[int] = config_field(factory=lambda: [1, 5], check=POSITIVE)
    # partial_fc's share of each slice sampled (0: the batch's positives alone, in-batch
    # negatives); hard_negatives' extra uniform sample (0: none)
    sample_rate: float = config_field(0.1, check=UNIT)
    # nearest classes per example and rank
    hard_negatives: int = config_field(10, check=NON_NEGATIVE)
    refresh_every: int = config_field(100, check=POSITIVE)  # hard_negatives: steps between rebuilds
    # cosface or arcface: a margin on the positives' logits, features and rows normalised
    margin: Margin = Margin.NONE
    margin_value: float = config_field(0.35, check=NON_NEGATIVE)  # m (CosFace ~0.35, ArcFace ~0.5)
    scale: float = config_field(30.0, check=POSITIVE)  # s, logit scale of the normalised heads
    # adaptive; empty: chosen from C
    cutoffs: list[int] = config_field(factory=list, check=POSITIVE)
    div_value: float = config_field(4.0, check=POSITIVE)  # adaptive: dimension divisor per cluster
    mach_buckets: int = config_field(0, check=NON_NEGATIVE)  # mach: B (0: about sqrt(C), >= 64)
    mach_repetitions: int = config_field(4, check=POSITIVE)  # mach: R
    # sharded heads' training loss: softmax, or bce (one-vs-all over positives + the step's
    # negatives: all classes for full, the sample for partial_fc / hard_negatives)
    loss: HeadLoss = HeadLoss.SOFTMAX
    # hard_negatives: exact (blocked top-k over the slice) or clustered (k-means lists, sub-linear)
    index: NegativeIndex = NegativeIndex.EXACT
    index_clusters: int = config_field(0, check=NON_NEGATIVE)  # clustered: lists (0: ~sqrt)
    index_probe: int = config_field(0, check=NON_NEGATIVE)  # clustered: lists searched (0: 1/4)
    # partial_fc with softmax: subtract from each sampled class's logit the log of its odds of
    # being in the step's sample (from the train split's label frequencies): the log-q correction
    sample_correction: bool = False
    optimizer: HeadOptimizer = HeadOptimizer.ADAGRAD  # sharded heads (others: optim.dense)
    # learning rate of the sharded heads' optimizer
    lr: float = config_field(0.05, check=POSITIVE)
    # sharded heads' storage of the class rows: fp32, or bf16 (2 bytes a weight, no fp32 copy) or
    # fp8 (float8 e4m3, 1 byte; both need optimizer rowwise_adagrad or factored_adagrad), whose
    # updated rows are rounded back by `rounding`
    dtype: HeadDtype = HeadDtype.FP32
    # dtype bf16 / fp8: how updated rows are rounded back (stochastic: unbiased)
    rounding: Rounding = Rounding.STOCHASTIC

    def __post_init__(self) -> None:
        """Keys that only go together, refused when the config is loaded (so ``embedtrain
        tune`` refuses a space that can draw them before any trial starts)."""
        refusal = replicated_head_refusal(self.kind, self.dtype, self.margin, self.loss)
        if refusal:
            raise ValueError(refusal)
        if self.dtype is not HeadDtype.FP32 and self.optimizer not in (
                HeadOptimizer.ROWWISE_ADAGRAD, HeadOptimizer.FACTORED_ADAGRAD):
            raise ValueError(f"dtype: {self.dtype.value} needs optimizer: rowwise_adagrad or "
                             f"factored_adagrad, not {self.optimizer.value} (they keep one "
                             f"float32 a row and round the updated rows back; adagrad's state "
                             f"would be a float32 copy of the head)")

    @property
    def corrects_sample(self) -> bool:
        """Whether ``sample_correction`` applies: only partial_fc with softmax samples classes;
        with another head it is ignored, with a line at the start of the run."""
        return (self.sample_correction and self.kind is HeadKind.PARTIAL_FC
                and self.loss is HeadLoss.SOFTMAX)


@dataclass
class XCConfig:
    """Extreme classification: bag-of-ids encoder (+ dense features) -> MLP -> class head."""

    embedding_dim: int = config_field(64, check=POSITIVE)  # token tables' dimension
    # how a row's token embeddings are pooled into one vector: mean or sum
    pooling: Pooling = Pooling.MEAN
    # last: the feature dimension D
    mlp: list[int] = config_field(factory=lambda: [256, 128], check=POSITIVE)
    # dropout after each hidden layer of the encoder's MLP (0: none)
    dropout: float = config_field(0.0, check=PROBABILITY)
    # PSP@k's propensity model (Jain et al. 2016): A and B (the XC repository's defaults)
    propensity_a: float = config_field(0.55, check=POSITIVE)
    # PSP@k's propensity model: B (see propensity_a)
    propensity_b: float = config_field(1.5, check=NON_NEGATIVE)


@dataclass
class SeqConfig:
    """Sequential recommendation: item table -> causal encoder over the history -> the ``head``
    section's class head over every item (``head.top_k``: HR@k, NDCG@k)."""

    model: SeqModel = SeqModel.SASREC  # sasrec | hstu (HSTU blocks: pointwise, gated attention)
    dim: int = config_field(64, check=POSITIVE)       # item table and encoder width
    layers: int = config_field(2, check=POSITIVE)     # self-attention blocks
    heads: int = config_field(2, check=POSITIVE)      # attention heads (dim divisible by them)
    # dropout in the encoder's blocks, in training only
    dropout: float = config_field(0.2, check=PROBABILITY)
    # dropout on the attention weights (0: SASRec's blocks take torch's fused causal attention)
    attention_dropout: float = config_field(0.0, check=PROBABILITY)
    # evaluation ranks only items outside each history (a target in its history is then a miss)
    exclude_history: bool = False


@dataclass
class GNNConfig:
    """GraphSAGE on sampled neighbourhoods: node-id table + features -> one SAGEConv per hop."""

    # sage (SAGEConv), gcn (GCNConv, mean-normalised), gat (GATConv), mlp: the same layers on
    # the node alone (a no-graph baseline), or appnp: those layers on each node, then a step of
    # personalised-PageRank propagation a hop (predict, then propagate; any number of layers)
    model: GNNModel = GNNModel.SAGE
    alpha: float = config_field(0.1, check=PROBABILITY)  # appnp: the teleport probability
    heads: int = config_field(4, check=POSITIVE)  # gat: attention heads a layer (concatenated)
    # neighbours per hop (-1: all)
    fanouts: list[int] = config_field(factory=lambda: [15, 10], check=FANOUT)
    # empty: the training fanouts
    eval_fanouts: list[int] = config_field(factory=list, check=FANOUT)
    # one SAGEConv a hop
    hidden: list[int] = config_field(factory=lambda: [128, 128], check=POSITIVE)
    # node-id table width (0: features only)
    embedding_dim: int = config_field(32, check=NON_NEGATIVE)
    aggr: Aggregation = Aggregation.MEAN  # SAGEConv aggregation: mean, max or sum
    # dropout between the layers, in training only
    dropout: float = config_field(0.0, check=PROBABILITY)
    weighted: bool = False  # sample neighbours by edge weight
    # link prediction: the node embedding size scored by dot products
    out_dim: int = config_field(64, check=POSITIVE)
    negatives: int = config_field(1, check=POSITIVE)  # link prediction: negatives per positive edge
    # link prediction: how negatives are drawn: uniform, or by degree^0.75
    negative_sampling: NegativeSampling = NegativeSampling.UNIFORM
    link_ks: list[int] = config_field(factory=lambda: [1, 3, 10], check=POSITIVE)  # Hits@K


@dataclass
class OptimConfig:
    # the embedding tables' optimizer, fused into their backward pass (FBGEMM)
    sparse: SparseOptimizer = SparseOptimizer.ROWWISE_ADAGRAD
    # learning rate of the embedding tables
    sparse_lr: float = config_field(0.05, check=POSITIVE)
    # the optimizer of the dense layers (and of data-parallel tables and replicated heads)
    dense: DenseOptimizer = DenseOptimizer.ADAM
    # learning rate of the dense optimizer (warmup_steps and lr_decay shape it)
    dense_lr: float = config_field(1e-3, check=POSITIVE)
    # the dense optimizer's weight decay (it does not reach the tables: see embedding_l2)
    weight_decay: float = config_field(0.0, check=NON_NEGATIVE)
    # L2 penalty on the embeddings a training batch looks up (task ctr): lambda * mean over
    # the batch's examples of the squared norms of their pooled embeddings, added to the loss
    embedding_l2: float = config_field(0.0, check=NON_NEGATIVE)
    # learning rate of the first-order tables (model.linear); None: sparse_lr / 10
    linear_lr: Optional[float] = config_field(None, check=POSITIVE)
    momentum: float = config_field(0.9, check=PROBABILITY)  # sgd and lars
    warmup_steps: int = config_field(0, check=NON_NEGATIVE)  # linear warmup of the dense lr
    # decay of the dense lr after the warmup: none, cosine (to min_lr_ratio) or step
    lr_decay: LRDecay = LRDecay.NONE
    lr_step_size: int = config_field(1000, check=POSITIVE)  # steps between decays (lr_decay: step)
    lr_gamma: float = config_field(0.1, check=POSITIVE)  # factor per decay (lr_decay: step)
    # floor of the cosine decay, as a fraction of dense_lr
    min_lr_ratio: float = config_field(0.0, check=UNIT)


@dataclass
class TrainConfig:
    # passes over the training split; auto: at least 1,000 steps (at most 100 passes), or
    # max_steps' worth (the sizing: embedtrain/train/state.py)
    epochs: Optional[int] = config_field(None, check=POSITIVE, none_spelled="auto")
    # stop after this many steps (overrides epochs)
    max_steps: Optional[int] = config_field(None, check=POSITIVE)
    # steps between validation evaluations; 0: only at the end; auto: 4 a pass, at most 500
    # steps apart
    eval_every: Optional[int] = config_field(None, check=NON_NEGATIVE, none_spelled="auto")
    # cap on validation batches per evaluation; all (or null): every batch of the split
    eval_max_batches: Optional[int] = config_field(None, check=POSITIVE, none_spelled="all")
    # steps between checkpoints; 0: only at the end
    checkpoint_every: int = config_field(1000, check=NON_NEGATIVE)
    # the newest checkpoints kept (and the best one, with select: best)
    keep_checkpoints: int = config_field(2, check=POSITIVE)
    # seeds the model's initialisation, the shuffle and the samplers
    seed: int = 0
    # start from a finished run's selected checkpoint (weights, optimizer state; grown tables)
    warm_start: Optional[str] = config_field(None, path=True)
    # a progress bar on a terminal (false: status lines, see status_every_s)
    progress: bool = True
    # without a progress bar (progress false, or stderr not a terminal): seconds between status
    # lines (step, examples/s, loss, time left; also one at each epoch's end); 0: none
    status_every_s: float = config_field(30.0, check=NON_NEGATIVE)
    # micro-batches per dense optimizer step
    grad_accumulation: int = config_field(1, check=POSITIVE)
    bf16_dense: bool = False  # run the dense part under bfloat16 autocast
    # which checkpoint the final (test) metrics come from: last, or best on validation; auto:
    # best on a small data set (a pass under 1,000 steps) when epochs and max_steps are auto,
    # else last
    select: Optional[Selection] = config_field(None, none_spelled="auto")
    # validation metric that picks the best checkpoint (default: the task's main metric)
    select_metric: Optional[str] = None
    # stop after this many evaluations without a better select_metric (0: never); auto: three
    # passes' worth on a small data set when epochs and max_steps are auto, else never
    early_stopping_patience: Optional[int] = config_field(None, check=NON_NEGATIVE,
                                                          none_spelled="auto")
    # the training step: none (the loop), sparse_dist (TorchRec's TrainPipelineSparseDist: the
    # next batch's input all-to-all overlaps this one's compute) or semi_sync (task ctr)
    pipeline: PipelineKind = PipelineKind.NONE
    # torch intra-op threads of each rank (default: the cores this process may use divided by
    # the ranks on this machine; env EMBEDTRAIN_THREADS also sets it; see embedtrain/runtime.py)
    threads_per_rank: Optional[int] = config_field(None, check=POSITIVE)

    def sized(self, steps_per_epoch: int) -> "TrainConfig":
        """This section with ``epochs``, ``eval_every``, ``select`` and
        ``early_stopping_patience`` left auto sized to a training split of ``steps_per_epoch``
        batches (:func:`embedtrain.train.options.sized_schedule`, as the trainer sizes them)."""
        return dataclasses.replace(self, **sized_schedule(
            {k: getattr(self, k) for k in SIZED}, self.max_steps, steps_per_epoch))


@dataclass
class TableSpec:
    """How the embedding tables named by ``tables`` (names or globs, e.g. ``t_C*`` or ``t_node``;
    later entries win) map ids to rows: ``static`` (the data set's ids are the rows) or
    ``dynamic`` (raw ids remapped collision-free to ``capacity`` rows, with eviction; see
    :mod:`embedtrain.tables.dynamic`). Tables no entry names are static.
    """

    # the tables this entry is for: names or globs (t_*, t_node)
    tables: list[str] = field(default_factory=list)
    # static (ids are rows) or dynamic (raw ids remapped to capacity rows)
    kind: TableKind = TableKind.DYNAMIC
    # dynamic: rows of the whole table (one per row-wise shard is its default row)
    capacity: int = config_field(0, check=NON_NEGATIVE)
    eviction: Eviction = Eviction.LRU  # dynamic: which ids a full table gives up
    # dynamic: steps between admissions (until then a new id looks up the default row)
    eviction_interval: int = config_field(1, check=POSITIVE)
    ttl_steps: int = config_field(0, check=NON_NEGATIVE)  # eviction ttl: steps without a lookup

    def dynamic_table(self, where: str) -> DynamicTable:
        """The model's description of a dynamic table (``where``: this entry's key, for errors)."""
        if self.capacity < 2:
            raise ConfigError(f"{where}.capacity: a dynamic table needs a capacity of at least 2 "
                              f"rows, got {self.capacity}")
        if self.eviction is Eviction.TTL and self.ttl_steps <= 0:
            raise ConfigError(f"{where}.ttl_steps: eviction ttl needs ttl_steps > 0")
        if self.eviction is Eviction.TTL and self.ttl_steps < self.eviction_interval:
            raise ConfigError(f"{where}.ttl_steps: {self.ttl_steps} is shorter than the "
                              f"eviction_interval ({self.eviction_interval}): ids would be "
                              f"admitted and expire in the same round")
        if self.eviction is not Eviction.TTL and self.ttl_steps:
            raise ConfigError(f"{where}.ttl_steps: only for eviction: ttl (this entry is "
                              f"{self.eviction.value})")
        return DynamicTable(self.capacity, self.eviction, self.eviction_interval, self.ttl_steps)


# The ``sharding`` section is the planner's own options (it echoes them in plan.json).
ShardingConfig = PlannerOptions


@dataclass
class Config:
    """The whole training config: one section per concern."""

    # the task family, or a task by import path with its own keys ({_component_:
    # embedtrain.tasks:Regression}, or one's own): it runs in the family its class's ``family``
    # attribute names (default ctr; task_family)
    task: TaskKind = config_field(TaskKind.CTR, component=True)
    data: DataConfig = field(default_factory=DataConfig)
    # the CTR model: the built-in DLRM / DCNv2 / DeepFM's keys, or a model of one's own by
    # import path with its keys ({_component_: package.module:Name, ...}: its signature's)
    model: ModelConfig = config_field(factory=ModelConfig, component=True)
    xc: XCConfig = field(default_factory=XCConfig)
    # the class head of xc (over its classes) and seq (over the items)
    head: HeadConfig = field(default_factory=HeadConfig)
    gnn: GNNConfig = field(default_factory=GNNConfig)
    seq: SeqConfig = field(default_factory=SeqConfig)
    # optimizers and learning rates: the tables' (sparse), the dense layers', the schedule
    optim: OptimConfig = field(default_factory=OptimConfig)
    # the run: its length, evaluations, checkpoints, which checkpoint reports, threads
    train: TrainConfig = field(default_factory=TrainConfig)
    sharding: ShardingConfig = field(default_factory=ShardingConfig)
    tables: list[TableSpec] = field(default_factory=list)  # static (default) or dynamic tables
    # metric loggers, each a component with its own keys (embedtrain.train.loggers:TensorBoard,
    # :MLflow, or one's own), built on rank 0 with the run directory
    loggers: list[Component] = field(default_factory=list)


def task_family(cfg: Config) -> TaskKind:
    """The family ``cfg.task`` runs in: the kind given, or a task component's class's
    ``family`` attribute (``"ctr"`` where it has none).

    Raises:
        ConfigError: the component does not import, or names no family (one line).
    """
    if not isinstance(cfg.task, Component):
        return cfg.task
    from embedtrain.components import resolve

    family = getattr(resolve(cfg.task.path, "task"), "family", "ctr")
    try:
        return TaskKind(family)
    except ValueError:
        raise ConfigError(f"task: {cfg.task.path}: family {family!r} is not one of "
                          f"{', '.join(k.value for k in TaskKind)}") from None


def dynamic_tables(cfg: Config, names: list[str]) -> dict[str, DynamicTable]:
    """The dynamic tables among the model's tables ``names``, by ``cfg.tables`` (later entries
    win; a pattern that matches no table is an error, as a typo would otherwise change nothing).

    Raises:
        ConfigError: naming the ``tables[i]`` key.
    """
    import fnmatch

    out: dict[str, DynamicTable] = {}
    for i, spec in enumerate(cfg.tables):
        where = f"tables[{i}]"
        if not spec.tables:
            raise ConfigError(f"{where}.tables: name the tables (or globs, e.g. t_*) it is for")
        for pattern in spec.tables:
            matched = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
            if not matched:
                shown = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
                raise ConfigError(f"{where}.tables: {pattern!r} matches no table (tables: "
                                  f"{shown})")
            for name in matched:
                if spec.kind is TableKind.STATIC:
                    out.pop(name, None)
                else:
                    out[name] = spec.dynamic_table(where)
    if out:
        if cfg.train.pipeline is not PipelineKind.NONE:
            raise ConfigError("train.pipeline: dynamic tables run in the plain loop only "
                              "(train.pipeline: none); TorchRec's pipelines have not been checked "
                              "with managed-collision tables here")
    return out


def check_world_size(cfg: Config, world_size: int, source: str = "") -> None:
    """The global batches split evenly over ``world_size`` ranks, and every row-wise shard of a
    dynamic table has a row for ids besides its default row (checked before launching).

    Raises:
        ConfigError: naming ``source`` (the config file, if given) and the key.
    """
    prefix = f"{source}: " if source else ""
    for i, spec in enumerate(cfg.tables):
        if spec.kind is TableKind.DYNAMIC and spec.capacity >= 2:
            # row-wise: blocks of ceil(rows / ranks), the last shard what is left; every shard
            # keeps its last row as the default row and needs one more for an id
            block = -(-spec.capacity // world_size)
            last = spec.capacity - block * (world_size - 1)
            if min(block, last) < 2:
                raise ConfigError(
                    f"{prefix}tables[{i}].capacity: {spec.capacity} rows over {world_size} "
                    f"ranks leave a shard of {min(block, last)} row(s) (each keeps one default "
                    f"row); use at least {2 * world_size}, best a multiple of {world_size}")
    for key in ("batch_size", "eval_batch_size"):
        value = getattr(cfg.data, key)
        if value % world_size:
            raise ConfigError(f"{prefix}data.{key}: {value} (the global batch) does not split "
                              f"evenly over {world_size} ranks; use a multiple of {world_size}")


def with_derived_sizes(cfg: Config) -> Config:
    """``cfg`` with the MLPs' derived ends written out (:func:`~embedtrain.models.options.
    mlp_sizes`): the sizes a run builds, by which two configs compare (a resume of a run whose
    config wrote them out, with one that leaves them to be derived, changes nothing)."""
    m = cfg.model
    if not isinstance(m, ModelConfig):  # a component: its own keys, nothing derived here
        return cfg
    bottom, top = mlp_sizes(m.embedding_dim, m.bottom_mlp, m.top_mlp)
    return dataclasses.replace(cfg, model=dataclasses.replace(m, bottom_mlp=bottom, top_mlp=top))


# Config keys a resumed run may change: how long it trains and how often it evaluates and
# checkpoints, and loader knobs that do not change the batches. Anything else (the model, the
# data, the optimizer, the batches) would make the resumed run something else.
RESUME_SAFE_KEYS = frozenset({
    "train.epochs", "train.max_steps", "train.eval_every", "train.eval_max_batches",
    "train.checkpoint_every", "train.keep_checkpoints", "train.progress", "train.pipeline",
    "train.threads_per_rank",
    "data.num_workers", "data.prefetch_batches", "data.eval_batch_size", "loggers",
})


MAX_RANKS = 16_384  # the largest cluster a plan is made for (a topology holds every device)


def load_cluster(path: str | os.PathLike, overrides: Optional[list[str]] = None) -> ClusterConfig:
    """Reads a cluster description (``configs/clusters/*.yaml``); errors as in
    :func:`load_config`."""
    cluster = load_dataclass(path, ClusterConfig, overrides, drop_keys=("defaults",))
    if cluster.world_size > MAX_RANKS:  # before a topology of that many devices is built
        raise ConfigError(f"{path}: hosts x devices_per_host = {cluster.world_size:,} ranks: more "
                          f"than embedtrain plans for ({MAX_RANKS:,})")
    _check_cluster_named(path, cluster, overrides or [])
    return cluster


def _check_cluster_named(path, cluster: ClusterConfig, overrides: list[str]) -> None:
    """A cluster file names its device kind and its memory per device (else a file of only
    ``name: x`` would plan for an 80 GB GPU), or asks for the defaults with ``defaults: true``."""
    raw = read_yaml(Path(path), "cluster file") or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: a cluster file is a mapping of keys, got {type(raw).__name__}")
    if raw.get("defaults") is True:
        return
    memory = "hbm_gb" if cluster.device is DeviceKind.CUDA else "ddr_gb"
    given = set(raw) | {o.split("=", 1)[0] for o in overrides}
    missing = [k for k in ("device", memory) if k not in given]
    if missing:
        raise ConfigError(f"{path}: {' and '.join(missing)}: not given; a cluster file names its "
                          f"device kind and memory per device (e.g. device: cuda, hbm_gb: 80), "
                          f"or says defaults: true to plan for {cluster.device.value} with "
                          f"{getattr(cluster, memory):g} GB ({memory})")


# Values earlier versions wrote into a run's config.yaml that no longer mean anything (a saved run
# still loads for eval and --resume): key -> (why they went, which values).
# A test returning a string refuses the value with it.
RETIRED_KEYS: dict[str, tuple[str, Callable[[Any], bool | str]]] = {
    "train.pipeline": ("a boolean that did nothing (the plain loop always ran); now none, "
                       "sparse_dist or semi_sync", lambda value: isinstance(value, bool)),
    "recipe": ("a Recipe subclass by import path, replaced by components",
               lambda value: value is None or "a recipe class is no longer read: name the model "
               "and the task as components (model: {_component_: package.module:Name, ...}, "
               "task: {_component_: ...}; ARCHITECTURE.md, 'Add a model')"),
}
DROPPED = {k: test for k, (_, test) in RETIRED_KEYS.items()}


# keys that moved: read where an earlier version (or a config written for it) gave them
MOVED_KEYS = {"xc.head": "head", "xc.top_k": "head.top_k"}


def load_run_config(path: str | os.PathLike) -> Config:
    """A run directory's saved ``config.yaml``, also one written by an earlier version (its
    :data:`RETIRED_KEYS` values are left out, its :data:`MOVED_KEYS` read where they moved)."""
    return load_dataclass(path, Config, drop_keys=DROPPED, moved_keys=MOVED_KEYS)


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
    return load_dataclass(path, Config, overrides, drop_keys={"recipe": DROPPED["recipe"]},
                          moved_keys=MOVED_KEYS)

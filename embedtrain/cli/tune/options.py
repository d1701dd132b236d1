"""The settings of a search (``embedtrain tune``'s options), torch- and Ray-free."""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass
from typing import Any, Optional

from embedtrain.runtime import usable_cores


class Scheduler(enum.Enum):
    """How trials are stopped early."""

    ASHA = "asha"  # asynchronous successive halving on the validation metric
    NONE = "none"  # every trial trains to its end


class Engine(enum.Enum):
    """Where trials run."""

    LOCAL = "local"  # a Ray instance of this machine, started by the command; one trial at a time
    RAY = "ray"  # a running Ray cluster; trials side by side


# ASHA's default grace period, in passes over the training data before a trial can be stopped
# (a trial reports its passes with each evaluation): fewer judged trials on their first few
# batches (on 2,400 labelled nodes, every trial's accuracy after two steps was 0.36-0.46)
GRACE_PASSES = 1


@dataclass(frozen=True)
class SearchOptions:
    """How to search.

    Attributes:
        trials: configurations to try.
        seed: of the sampler (the same seed draws the same configurations).
        scheduler: how trials are stopped early.
        grace_steps: ASHA's grace period, in training steps: no trial is stopped before it;
            None: :data:`GRACE_PASSES` passes over the data.
        reduction_factor: ASHA's: about 1 in this many trials goes on at each rung.
        engine: where trials run.
        address: the cluster of ``Engine.RAY`` (None: ``RAY_ADDRESS``, else ``auto``).
        cpus_per_trial: ``Engine.RAY``: CPUs (and torch threads) per trial.
        gpus_per_trial: GPUs per trial.
        max_concurrent: ``Engine.RAY``: trials at once (0: as many as fit).
    """

    trials: int
    seed: int = 0
    scheduler: Scheduler = Scheduler.ASHA
    grace_steps: Optional[int] = None
    reduction_factor: int = 3
    engine: Engine = Engine.LOCAL
    address: Optional[str] = None
    cpus_per_trial: int = 1
    gpus_per_trial: float = 0.0
    max_concurrent: int = 0

    def search_settings(self) -> dict[str, Any]:
        """What a resumed search must keep (the rest says where it runs)."""
        keep = ("trials", "seed", "scheduler", "grace_steps", "reduction_factor")
        return {k: v.value if isinstance(v, enum.Enum) else v
                for k, v in asdict(self).items() if k in keep}

    def grace(self) -> tuple[str, float]:
        """ASHA's time attribute and grace period: ``("step", grace_steps)``, or
        :data:`GRACE_PASSES` ``passes`` (a trial reports the passes over its training data
        with each evaluation)."""
        if self.grace_steps is None:
            return "passes", GRACE_PASSES
        return "step", self.grace_steps

    def describe_grace(self) -> str:
        attr, n = self.grace()
        return f"{n:,} steps" if attr == "step" else f"{n:g} pass{'es' if n != 1 else ''}"

    def trial_cpus(self) -> int:
        """CPUs (and torch threads) of each trial: all of this machine's with ``local``."""
        return usable_cores() if self.engine is Engine.LOCAL else self.cpus_per_trial

"""The search space of ``embedtrain tune``: a YAML file over dotted config keys.

Each key is one that ``--set`` takes and maps to a fixed value or to exactly one distribution:

```yaml
optim.sparse_lr: {loguniform: [0.005, 0.2]}   # log-uniform between lo and hi (lo > 0)
optim.dense_lr: {uniform: [0.0005, 0.003]}    # uniform between lo and hi
model.embedding_dim: {choice: [8, 16]}        # one of the values (lists too: [[64, 16], [32, 16]])
optim.warmup_steps: {randint: [0, 100]}       # an integer in [lo, hi): hi excluded, as numpy's
train.max_steps: 400                          # fixed for every trial
```

The file is read with PyYAML's safe loader (with YAML 1.2's numbers, as configs are: ``1e-3``
is a float). Nothing here imports torch or Ray: :meth:`SearchParam.to_ray` imports Ray Tune
when called. :func:`check_space` loads the config once with every fixed value and once with each
end of every distribution (each value of a choice) through the project's config loader, so a key
the schema does not have, a wrong type or an out-of-range value stops the search before any
trial starts, in one line naming the space file and the key.

Example:
    >>> space = load_space("configs/tune/ctr_space.yaml")
    >>> space = check_space(space, "configs/dlrm_synthetic.yaml", overrides=[])
    >>> space.keys
    ['optim.sparse_lr', 'optim.dense_lr', 'model.embedding_dim']
    >>> space.overrides({"optim.sparse_lr": 0.02})
    ['optim.sparse_lr=0.02']
"""

from __future__ import annotations

import enum
import itertools
import json
import math
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional


from embedtrain.config import ConfigError, load_config, to_dict
from embedtrain.config_io import read_yaml


class Distribution(enum.Enum):
    """How a searched key's values are drawn (Ray Tune's function of the same name)."""

    CHOICE = "choice"
    UNIFORM = "uniform"
    LOGUNIFORM = "loguniform"
    RANDINT = "randint"


_NAMES = ", ".join(d.value for d in Distribution)


@dataclass(frozen=True)
class SearchParam:
    """One searched key.

    Attributes:
        key: the dotted config key (``optim.sparse_lr``).
        distribution: how its values are drawn.
        values: a choice's values; ``(lo, hi)`` for the others.
    """

    key: str
    distribution: Distribution
    values: tuple[Any, ...]

    @property
    def log_scale(self) -> bool:
        """Whether the values spread on a log scale (plotted so)."""
        return self.distribution is Distribution.LOGUNIFORM

    def describe(self) -> str:
        """``choice [8, 16]``, ``loguniform [0.005, 0.2]``: for messages."""
        return f"{self.distribution.value} {json.dumps(list(self.values))}"

    def to_ray(self) -> Any:
        """The Ray Tune search domain (``tune.choice(...)``, ``tune.loguniform(lo, hi)``, ...)."""
        from ray import tune

        if self.distribution is Distribution.CHOICE:
            return tune.choice(list(self.values))
        return getattr(tune, self.distribution.value)(*self.values)


@dataclass(frozen=True)
class SearchSpace:
    """A parsed space file.

    Attributes:
        path: the file.
        params: the searched keys, in the file's order.
        fixed: keys with one value for every trial (applied like ``--set``).
    """

    path: Path
    params: tuple[SearchParam, ...]
    fixed: dict[str, Any] = field(default_factory=dict)

    @property
    def keys(self) -> list[str]:
        """The searched keys."""
        return [p.key for p in self.params]

    def param(self, key: str) -> SearchParam:
        return next(p for p in self.params if p.key == key)

    def fixed_overrides(self) -> list[str]:
        """The fixed values as ``--set`` overrides."""
        return as_overrides(self.fixed)

    def overrides(self, values: dict[str, Any]) -> list[str]:
        """A trial's values of the searched keys as ``--set`` overrides, in the file's order."""
        return as_overrides({k: values[k] for k in self.keys if k in values})

    def param_space(self) -> dict[str, Any]:
        """Ray Tune's ``param_space``: searched key -> its domain."""
        return {p.key: p.to_ray() for p in self.params}

    def to_dict(self) -> dict[str, Any]:
        """Plain data of the space (written into the search directory; compared on resume)."""
        return {"params": {p.key: {p.distribution.value: list(p.values)} for p in self.params},
                "fixed": dict(self.fixed)}


def as_overrides(values: dict[str, Any]) -> list[str]:
    """``{key: value}`` as ``--set`` strings; values in JSON, which the config loader's YAML
    reads back as they were (strings quoted, lists and floats exact). A mapping sets each of its
    keys under ``key`` (``model: {choice: [{embedding_dim: 8, bottom_mlp: [64, 8]}, ...]}``:
    keys that must change together, the rest of the section kept)."""
    out = []
    for key, value in values.items():
        if isinstance(value, dict):
            out += as_overrides({f"{key}.{k}": v for k, v in value.items()})
        else:
            out.append(f"{key}={json.dumps(value)}")
    return out


def load_space(path: str | os.PathLike) -> SearchSpace:
    """Reads and checks a space file (distributions and their bounds; not yet the keys, see
    :func:`check_space`).

    Raises:
        ConfigError: one line naming the file and the key.
    """
    path = Path(path)
    raw = read_yaml(path, "search space file")
    if not isinstance(raw, dict) or not raw:
        got = "nothing" if raw is None or raw == {} else type(raw).__name__
        raise ConfigError(f"{path}: expected a mapping of dotted config keys to values or "
                          f"distributions (e.g. optim.sparse_lr: {{loguniform: [0.005, 0.2]}}), "
                          f"got {got}")
    params, fixed = [], {}
    for key, value in raw.items():
        if not isinstance(key, str) or not key:
            raise ConfigError(f"{path}: {key!r}: keys are dotted config keys (e.g. "
                              "optim.sparse_lr), as --set takes them")
        if isinstance(value, dict):
            params.append(_param(path, key, value))
        else:
            fixed[key] = value
    if not params:
        raise ConfigError(f"{path}: no key to search: give at least one key a distribution "
                          f"({_NAMES}), e.g. optim.sparse_lr: {{loguniform: [0.005, 0.2]}}")
    return SearchSpace(path, tuple(params), fixed)


def _param(path: Path, key: str, spec: dict) -> SearchParam:
    where = f"{path}: {key}"
    known = [name for name in spec if name in Distribution._value2member_map_]
    unknown = [name for name in spec if name not in Distribution._value2member_map_]
    if unknown:
        hint = (f"; keys are dotted, e.g. {key}.{unknown[0]}: ..." if not known and "." not in key
                else "")
        raise ConfigError(f"{where}: unknown distribution {unknown[0]!r} (one of {_NAMES}; a "
                          f"mapping value cannot be fixed in a space file, use --set){hint}")
    if len(known) != 1:
        raise ConfigError(f"{where}: give exactly one of {_NAMES}, got "
                          f"{len(known)} ({', '.join(known) or 'none'})")
    dist = Distribution(known[0])
    args = spec[known[0]]
    if dist is Distribution.CHOICE:
        if not isinstance(args, list) or not args:
            raise ConfigError(f"{where}: choice: expected a non-empty list of values, got "
                              f"{_show(args)}")
        return SearchParam(key, dist, tuple(args))
    if not (isinstance(args, list) and len(args) == 2):
        raise ConfigError(f"{where}: {dist.value}: expected [lo, hi], got {_show(args)}")
    lo, hi = args
    integer = dist is Distribution.RANDINT
    for name, v in (("lo", lo), ("hi", hi)):
        ok = isinstance(v, int) if integer else isinstance(v, (int, float)) and math.isfinite(v)
        if isinstance(v, bool) or not ok:
            what = "an integer" if integer else "a finite number"
            raise ConfigError(f"{where}: {dist.value}: {name} must be {what}, got {_show(v)}")
    if lo >= hi:
        excluded = " (hi is excluded: [lo, hi))" if integer else ""
        raise ConfigError(f"{where}: {dist.value}: lo must be below hi, got [{lo}, {hi}]"
                          f"{excluded}")
    if dist is Distribution.LOGUNIFORM and lo <= 0:
        raise ConfigError(f"{where}: loguniform: lo must be positive, got {lo}")
    return SearchParam(key, dist, (lo, hi))


def check_space(space: SearchSpace, config: str | os.PathLike, overrides: list[str]
                ) -> SearchSpace:
    """Loads ``config`` with ``overrides``, the fixed values and each probe of every searched key
    (a choice's every value, the two ends of a range as floats; ``randint``'s ``lo`` and its
    last integer, ``hi - 1``) through :func:`embedtrain.config.load_config`; then the probes of
    the searched keys together (:func:`_check_together`), so that a space whose keys' values
    cannot be combined is refused before any trial starts.

    Returns:
        The space with each choice's values as the loader resolved them (a path made absolute,
        as ``--set`` makes it).

    Raises:
        ConfigError: an error of the loader, as one line naming the space file and the key (or
            the two keys that cannot be combined).
    """
    for key, value in space.fixed.items():
        _load(space, config, [*overrides, *as_overrides({key: value})], key, None)
    base = [*overrides, *space.fixed_overrides()]
    params, probes = [], []
    for p in space.params:
        if p.distribution is Distribution.CHOICE:
            values = tuple(_given(v, _load(space, config, base + as_overrides({p.key: v}),
                                           p.key, p)) for v in p.values)
            p = SearchParam(p.key, p.distribution, values)
            probe = list(p.values)
        elif p.distribution is Distribution.RANDINT:
            lo, hi = p.values
            probe = [lo, hi - 1]
        else:  # uniform and loguniform draw floats, also between integer bounds
            probe = [float(v) for v in p.values]
        for v in probe if p.distribution is not Distribution.CHOICE else ():
            _load(space, config, base + as_overrides({p.key: v}), p.key, p)
        params.append(p)
        probes.append([(p.key, v) for v in probe])
    _check_together(space, config, base, probes)
    return SearchSpace(space.path, tuple(params), dict(space.fixed))


# the most combinations of the searched keys' probes loaded; a larger space is checked on this
# many combinations drawn with a fixed seed (every pair of two keys' probes first)
COMBINATIONS = 256


def _check_together(space: SearchSpace, config: str | os.PathLike, base: list[str],
                    probes: list[list[tuple[str, Any]]]) -> None:
    """Loads the config with combinations of the keys' probes (all of them up to
    :data:`COMBINATIONS`; else every pair of two keys' probes, then a seeded sample of whole
    combinations); the first that fails is reduced to the two keys that fail together, if two
    do, and refused in one line naming them and their values."""
    if len(probes) < 2:
        return
    if math.prod(len(p) for p in probes) <= COMBINATIONS:
        combos: Iterable[tuple[tuple[str, Any], ...]] = itertools.product(*probes)
    else:
        pairs = (c for a, b in itertools.combinations(probes, 2) for c in itertools.product(a, b))
        rng = random.Random(0)
        sample = (tuple(rng.choice(p) for p in probes) for _ in range(COMBINATIONS))
        combos = itertools.chain(pairs, sample)
    for combo in combos:
        try:
            load_config(config, base + as_overrides(dict(combo)))
        except ConfigError as e:
            culprits = next((pair for pair in itertools.combinations(combo, 2)
                             if _fails(config, base, pair)), combo)
            text = str(e)
            text = text[len(f"{config}: "):] if text.startswith(f"{config}: ") else text
            values = " with ".join(f"{k}={_show(v)}" for k, v in culprits)
            raise ConfigError(f"{space.path}: {', '.join(k for k, _ in culprits)}: cannot be "
                              f"combined: {values}: {text} (give these keys as one choice of "
                              f"mappings, or fix one of them)") from None


def _fails(config: str | os.PathLike, base: list[str], items: tuple[tuple[str, Any], ...]
           ) -> bool:
    try:
        load_config(config, base + as_overrides(dict(items)))
    except ConfigError:
        return True
    return False


def _given(value: Any, resolved: Any) -> Any:
    """A choice's value as the loader resolved it; of a mapping, only the keys it sets (the
    others stay the config's, whatever is set after it)."""
    if isinstance(value, dict) and isinstance(resolved, dict):
        return {k: _given(v, resolved[k]) for k, v in value.items()}
    return resolved


def _load(space: SearchSpace, config: str | os.PathLike, items: list[str], key: str,
          param: Optional[SearchParam]) -> Any:
    """Loads the config with ``items``; the resolved value of ``key`` (plain data)."""
    try:
        cfg = load_config(config, items)
    except ConfigError as e:
        text = str(e)
        prefix = f"{config}: "
        text = text[len(prefix):] if text.startswith(prefix) else text
        text = text[len(key) + 2:] if text.startswith(f"{key}: ") else text
        source = f" (from {param.describe()})" if param is not None else ""
        if param is not None and param.distribution in (Distribution.UNIFORM,
                                                        Distribution.LOGUNIFORM) \
                and "expected an integer" in text:
            source += f"; {param.distribution.value} draws floats: use randint or choice"
        raise ConfigError(f"{space.path}: {key}: {text}{source}") from None
    return to_dict(config_value(cfg, key))


def config_value(cfg: Any, key: str) -> Any:
    """The value at dotted ``key`` of a loaded config (sections are dataclasses or dicts)."""
    node = cfg
    for part in key.split("."):
        node = node[part] if isinstance(node, dict) else getattr(node, part)
    return node


def _show(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."

"""YAML files onto typed dataclasses: the generic loader behind every config-like file.

Training configs (:mod:`embedtrain.config`), cluster files, ingestion specs
(:mod:`pipelines.tabular.spec` and the other families') and the data sets' ``metadata.json`` all
load through :func:`load_dataclass` / :func:`from_dict`: ``yaml`` safe loading only (a file can
never execute code), unknown keys, wrong types and values out of range reported as one
:class:`ConfigError` line naming the file and the dotted key path, e.g.
``configs/dlrm.yaml: train.batch_sise: unknown key (did you mean 'batch_size'?)``.

A dataclass field declares its check and whether it is a path with :func:`config_field`; the
check runs where a file or ``--set`` gives the value. Numbers follow YAML 1.2: ``1e-3`` and
``1E-3`` are floats (PyYAML's YAML 1.1 resolver reads them as strings), in files and in
``--set``. Relative paths in a file are taken relative to that file's directory, so a config
works from any working directory; a path given by ``--set`` is relative to the working
directory; a default is left as it is.

This module imports nothing of embedtrain: any layer may use it for its own typed specs.

Example:
    >>> @dataclass
    ... class Spec:
    ...     rows: int = config_field(10, check=POSITIVE)
    >>> load_dataclass("spec.yaml", Spec, overrides=["rows=20"]).rows
    20
"""

from __future__ import annotations

import dataclasses
import datetime
import difflib
import enum
import math
import os
import re
import reprlib
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional, TypeVar, Union

import yaml


T = TypeVar("T")


class ConfigError(ValueError):
    """A config problem; ``str(err)`` is one line naming the file and the key path."""


# Checks of single values, run where a file or --set gives them: (test, what the error says).
POSITIVE = (lambda v: v > 0, "must be positive")
NON_NEGATIVE = (lambda v: v >= 0, "must be at least 0")
FRACTION = (lambda v: 0 < v <= 1, "must be in (0, 1]")
PROBABILITY = (lambda v: 0 <= v < 1, "must be in [0, 1)")
UNIT = (lambda v: 0 <= v <= 1, "must be in [0, 1]")
FANOUT = (lambda v: v > 0 or v == -1, "must be positive, or -1 for all neighbours")


def config_field(default: Any = dataclasses.MISSING, *, factory: Any = dataclasses.MISSING,
                 check: Optional[tuple[Callable[[Any], bool], str]] = None,
                 path: bool = False, text: bool = False, component: bool = False,
                 none_spelled: Optional[str] = None) -> Any:
    """A config field; ``check`` applies to the value (each element of a list), ``path`` marks
    a file path resolved against the config file's directory. ``text``: the field's strings
    also accept YAML numbers and booleans, as their text (``0`` -> ``"0"``, ``true`` ->
    ``"true"``), and a single value where a list of them is expected (values compared with a
    data column's text, e.g. a split column's). ``component``: the section may instead be a
    :class:`Component` (``{_component_: package.module:Name, ...its keys}``). ``none_spelled``: a
    word that means the field's ``None`` (``eval_max_batches: all``), and the error of a value the
    check refuses names it."""
    metadata = {"check": check, "path": path, "text": text, "component": component,
                "none_spelled": none_spelled}
    if factory is not dataclasses.MISSING:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)



COMPONENT_KEY = "_component_"
COMPONENT_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


@dataclass
class Component:
    """A section given as a callable by import path and its own keys (``{_component_:
    package.module:Name, key: value, ...}``); the keys are checked against the callable's
    signature when it is built (:func:`embedtrain.components.build`), not by a schema."""

    path: str
    keys: dict[str, Any] = field(default_factory=dict)


def _component(value: dict, source: str, key_path: str) -> Component:
    path = value[COMPONENT_KEY]
    if not isinstance(path, str) or not COMPONENT_PATH.match(path):
        raise ConfigError(f"{source}: {key_path}.{COMPONENT_KEY}: expected an import path "
                          f"package.module:Name, got {_describe(path)}")
    keys = {k: v for k, v in value.items() if k != COMPONENT_KEY}
    bad = next((k for k in keys if not isinstance(k, str) or not k.isidentifier()), None)
    if bad is not None:
        raise ConfigError(f"{source}: {key_path}: {bad!r} is not a keyword argument name")
    return Component(path, keys)


def convert(tp: Any, value: Any, key_path: str) -> Any:
    """``value`` checked and converted to type ``tp`` as a config field of that type would be.

    Raises:
        ConfigError: ``<key_path>: expected ...`` in one line.
    """
    try:
        return _convert(tp, value, "", key_path)
    except ConfigError as e:
        raise ConfigError(str(e).removeprefix(": ")) from None


def read_yaml(path: Path, what: str = "config file") -> Any:
    """The YAML document in ``path`` (PyYAML's safe loader with YAML 1.2's numbers).

    Raises:
        ConfigError: ``"<path>: <what> not found"``, invalid YAML (with its line and column) or
            an unreadable file, in one line.
    """
    if not path.is_file():
        raise ConfigError(f"{path}: {what} not found")
    try:
        return yaml.load(path.read_text(), Loader=SafeLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{path}: invalid YAML{where}: {problem}") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start:,}: {e.object[e.start]:#04x}); "
                          f"save the {what} as UTF-8") from None


def load_dataclass(
    path: str | os.PathLike, cls: type[T], overrides: Optional[list[str]] = None,
    drop_keys: Iterable[str] | Mapping[str, Callable[[Any], bool]] = (),
    moved_keys: Optional[Mapping[str, str]] = None,
) -> T:
    """Reads a YAML file into dataclass ``cls`` (any config-like dataclass, e.g. an ingest spec).

    Supported field types: ``int``, ``float``, ``bool``, ``str``, enums, ``Optional[...]``,
    ``list[...]``, ``dict[str, ...]`` and nested dataclasses (also inside lists and dicts).
    ``drop_keys`` (dotted paths) are removed from the file's data before it is read: keys an
    older version wrote that no longer exist (a saved run's ``config.yaml``); as a mapping, a key
    is removed only when its value satisfies the key's test (a key whose old values went), and
    refused when the test returns a string (the reason).
    ``moved_keys`` (old dotted path -> new) are read where they moved, in the file and in
    ``overrides`` alike (one given both ways is an error).

    Raises:
        ConfigError: missing/unreadable file, invalid YAML, unknown key, wrong type or value.
    """
    path = Path(path)
    raw = read_yaml(path)
    if raw is None:
        raise ConfigError(f"{path}: the file is empty (a config names at least its data; see "
                          "configs/ for examples)")
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections, got "
                          f"{type(raw).__name__}")
    tests = drop_keys if isinstance(drop_keys, Mapping) else dict.fromkeys(drop_keys)
    for key, test in tests.items():
        node, last = _parent(raw, key)
        verdict = True if node is None or test is None else test(node[last])
        if isinstance(verdict, str):
            raise ConfigError(f"{path}: {key}: {verdict}")
        if node is not None and verdict:
            del node[last]
    for old, new in (moved_keys or {}).items():
        node, last = _parent(raw, old)
        if node is not None:
            *to, leaf = new.split(".")
            target = raw
            for part in to:
                target = target.setdefault(part, {})
            if leaf in target:
                raise ConfigError(f"{path}: {old} (moved to {new}) and {new}: give it once, as "
                                  f"{new}")
            target[leaf] = node.pop(last)
    _resolve_paths(cls, raw, path.resolve().parent)
    for item in overrides or []:
        key = item.split("=", 1)[0]
        for old, new in (moved_keys or {}).items():
            if key == old or key.startswith(old + "."):
                item = new + item[len(old):]
        _apply_override(raw, item, path, cls)
    return from_dict(cls, raw, source=str(path))


def _parent(raw: dict, dotted: str) -> tuple[Optional[dict], str]:
    """The mapping holding ``dotted``'s last part and that part, or ``(None, part)`` when the
    data has no such key."""
    *parents, last = dotted.split(".")
    node = raw
    for part in parents:
        node = node.get(part) if isinstance(node, dict) else None
    return (node, last) if isinstance(node, dict) and last in node else (None, last)


MAX_YAML_VALUES = 100_000  # values a document may hold once its aliases are expanded


class SafeLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` with YAML 1.2's float rule (``1e-3``, ``1E-3``, ``5e4`` are floats),
    duplicate keys refused (YAML says a mapping's keys are unique; PyYAML keeps the last), and
    aliases bounded: a document whose aliases expand to more than :data:`MAX_YAML_VALUES`
    values ("billion laughs") or that contains itself is refused before anything walks it."""

    def get_single_data(self) -> Any:
        try:
            return super().get_single_data()
        except RecursionError:  # PyYAML parses and builds nested values recursively
            raise yaml.YAMLError(f"nested deeper than the {sys.getrecursionlimit():,} levels "
                                 "Python's recursion allows (refused)") from None

    def compose_document(self) -> Any:
        node = super().compose_document()
        if _expanded_size(node, {}) > MAX_YAML_VALUES:
            raise yaml.composer.ComposerError(
                None, None, f"its aliases expand to more than {MAX_YAML_VALUES:,} values "
                "(refused)", node.start_mark)
        return node

    def construct_mapping(self, node: Any, deep: bool = False) -> dict:
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, Any] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue  # merged keys may be overridden: YAML's merge rule
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.setdefault(key, key_node.start_mark)
                except TypeError:
                    continue  # an unhashable key: the constructor reports it
                if first is not key_node.start_mark:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {key!r} (first at line {first.line + 1})",
                        key_node.start_mark)
        return super().construct_mapping(node, deep)


def _expanded_size(node: Any, sizes: dict[int, int]) -> int:
    """Values under ``node`` with every alias expanded, each shared node sized once (a node
    that contains itself counts as too many)."""
    known = sizes.get(id(node))
    if known is not None:
        return known
    if not isinstance(node, (yaml.SequenceNode, yaml.MappingNode)):
        return 1
    sizes[id(node)] = MAX_YAML_VALUES + 1  # while it is being sized: a cycle is too large
    children = (node.value if isinstance(node, yaml.SequenceNode)
                else [n for pair in node.value for n in pair])
    total = 1
    for child in children:
        total += _expanded_size(child, sizes)
        if total > MAX_YAML_VALUES:
            break
    sizes[id(node)] = total
    return total


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


def with_absolute_paths(cfg: T, base: Optional[str | os.PathLike] = None) -> T:
    """``cfg`` with its relative paths (fields marked ``path``) made absolute against ``base``
    (default: the working directory), as a config file's are when it is loaded: what a run
    records, so that its ``config.yaml`` names the same files from anywhere."""
    raw = to_dict(cfg)
    _resolve_paths(type(cfg), raw, Path(base) if base is not None else Path.cwd())
    return from_dict(type(cfg), raw)


def _absolute(value: str, base: Path) -> str:
    expanded = Path(os.path.expanduser(value))
    return str(expanded if expanded.is_absolute() else Path(os.path.normpath(base / expanded)))


def changed_keys(old: Any, new: Any, prefix: str = "") -> dict[str, tuple[Any, Any]]:
    """``{key path: (old value, new value)}`` of every field that differs between two configs."""
    out: dict[str, tuple[Any, Any]] = {}
    if isinstance(old, Component) and isinstance(new, Component):  # key by key, as a section
        old, new = to_dict(old), to_dict(new)
        for key in dict.fromkeys([*old, *new]):
            if old.get(key) != new.get(key):
                out[f"{prefix}{key}"] = (old.get(key), new.get(key))
        return out
    if dataclasses.is_dataclass(old) and type(old) is type(new):
        for f in dataclasses.fields(old):
            out.update(changed_keys(getattr(old, f.name), getattr(new, f.name),
                                    f"{prefix}{f.name}."))
        return out
    if old != new:
        out[prefix.rstrip(".")] = (to_dict(old), to_dict(new))
    return out


def from_dict(cls: type, data: Any, source: str = "<config>", prefix: str = "",
              ignore_unknown: bool = False) -> Any:
    """Builds dataclass ``cls`` from plain data, checking keys and types recursively.

    A field without a default is required (``key: missing``). A section's ``__post_init__``
    may refuse values that cannot go together by raising ``ValueError("key: why")``: it becomes
    the one-line :class:`ConfigError` of ``prefix`` + that key. ``ignore_unknown`` skips keys
    ``cls`` does not have at this level (a file that carries more than the reader needs, such
    as ``metadata.json``); otherwise they are errors.
    """
    if not isinstance(data, dict):
        where = prefix.rstrip(".") or "<top>"
        raise ConfigError(f"{source}: {where}: expected a mapping, got {_describe(data)}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in data.items():
        key_path = f"{prefix}{key}"
        if key not in fields and ignore_unknown:
            continue
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else f" (known: {', '.join(fields)})"
            raise ConfigError(f"{source}: {key_path}: unknown key{hint}")
        if (fields[key].metadata.get("component") and isinstance(value, dict)
                and COMPONENT_KEY in value):
            kwargs[key] = _component(value, source, key_path)
            continue
        spelled = fields[key].metadata.get("none_spelled")
        if spelled is not None and value == spelled:
            kwargs[key] = None
            continue
        kwargs[key] = _convert(hints[key], value, source, key_path,
                               text=fields[key].metadata.get("text", False))
        check = fields[key].metadata.get("check")
        if check is not None:
            if spelled is not None:
                check = (check[0], f"{check[1]} (or {spelled})")
            _check(kwargs[key], check, source, key_path)
    for name, f in fields.items():
        if (name not in kwargs and f.default is dataclasses.MISSING
                and f.default_factory is dataclasses.MISSING):
            raise ConfigError(f"{source}: {prefix}{name}: missing")
    try:
        return cls(**kwargs)
    except ValueError as e:  # a section's own check of its keys together (its __post_init__)
        raise ConfigError(f"{source}: {prefix}{e}") from None


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
    if isinstance(obj, Component):
        return {COMPONENT_KEY: obj.path, **to_dict(obj.keys)}
    if dataclasses.is_dataclass(obj):
        return {f.name: _spelled(f, getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def _spelled(f: dataclasses.Field, value: Any) -> Any:
    """A field's value as data: its ``none_spelled`` word for None (``epochs: auto``)."""
    if value is None and f.metadata.get("none_spelled"):
        return f.metadata["none_spelled"]
    return to_dict(value)


def dump_config(cfg: Any, path: str | os.PathLike) -> None:
    from embedtrain.utils import write_atomic

    write_atomic(path, yaml.safe_dump(to_dict(cfg), sort_keys=False))


def _convert(tp: Any, value: Any, source: str, key_path: str, text: bool = False) -> Any:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _convert(inner, value, source, key_path, text)
    if tp is Component:
        if not isinstance(value, dict) or COMPONENT_KEY not in value:
            raise _type_error(source, key_path, f"a mapping with {COMPONENT_KEY}", value)
        return _component(value, source, key_path)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, source, prefix=f"{key_path}.")
    if origin is dict:
        key_type, inner = typing.get_args(tp)
        if not isinstance(value, dict):
            raise _type_error(source, key_path, "a mapping", value)
        return {_convert(key_type, k, source, key_path): _convert(inner, v, source,
                                                                  f"{key_path}.{k}", text)
                for k, v in value.items()}
    if origin is list:
        (inner,) = typing.get_args(tp)
        if text and value is not None and not isinstance(value, (list, dict)):
            value = [value]  # one value where a list of them is expected
        if not isinstance(value, list):
            raise _type_error(source, key_path, "a list", value)
        return [_convert(inner, v, source, f"{key_path}[{i}]", text)
                for i, v in enumerate(value)]
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
        if text and isinstance(value, bool):
            return "true" if value else "false"
        if text and isinstance(value, (int, float)):
            return str(value)
        if text and isinstance(value, datetime.date):  # YAML's unquoted dates, as written
            return value.isoformat()
        if not isinstance(value, str):
            raise _type_error(source, key_path, "a string", value)
        return value
    raise TypeError(f"config type {tp!r} at {key_path} is not supported")  # a bug in this module


def _type_error(source: str, key_path: str, expected: str, value: Any) -> ConfigError:
    return ConfigError(f"{source}: {key_path}: expected {expected}, got {_describe(value)}")


_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxlist, _SHORT.maxdict, _SHORT.maxstring, _SHORT.maxother = 3, 12, 8, 80, 80


def _describe(value: Any) -> str:
    if value is None:
        return "null"
    text = _SHORT.repr(value)  # never the whole value: an expanded alias can be huge
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"


def _apply_override(raw: dict, item: str, path: Path, cls: Optional[type] = None) -> None:
    key, sep, text = item.partition("=")
    if not sep or not key:
        raise ConfigError(f"--set {item!r}: expected key.path=value")
    if not text.strip():
        raise ConfigError(f"{path}: --set {key}=: no value given (--set {key}=VALUE; {key}=null "
                          "clears an optional key)")
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

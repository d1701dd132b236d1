"""Components: a config section given as a callable by import path, with its own keys.

``model: {_component_: mypkg.gated:GatedDLRM, hidden: 128}`` names a callable (a class or a
function) and the keyword arguments it is called with; embedtrain adds what it owns (the data
set's ``features``, the ``device`` to build on) where the signature takes them. The keys are the
callable's: checked against its signature and annotations before it is called (an unknown key
is one line with a did-you-mean, a wrong type one line naming the key), so a new model adds no
key to a global schema. As torchtune's ``_component_``, but checked before anything is built.

The module is imported from the Python path or the current directory (as ``python -m`` would),
only when a config or code names it, never from a data file.

Example:
    >>> spec = Component("torch.nn:Linear", {"in_features": 4, "out_features": 2})
    >>> build(spec, "model")
    Linear(in_features=4, out_features=2, bias=True)
"""

from __future__ import annotations

import collections.abc
import difflib
import enum
import importlib
import inspect
import os
import sys
import traceback
import types
import typing
from pathlib import Path
from typing import Any, Callable

from embedtrain.config_io import Component, ConfigError, convert

__all__ = ["Component", "build", "resolve"]


def resolve(path: str, key: str) -> Callable[..., Any]:
    """The object ``path`` names (``package.module:Name``), imported; ``key`` is the config key
    that names it, for the messages.

    Raises:
        ConfigError: one line: the module does not import (or raises while importing), or has no
            such name.
    """
    module_name, _, name = path.partition(":")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())  # after everything installed: it cannot shadow a package
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"{key}: {path}: cannot import {module_name} ({e}); is its folder on "
                          "PYTHONPATH or the current directory?") from None
    except Exception as e:  # noqa: BLE001 - the user's module failed while importing: one line
        where = (f"{e.filename}, line {e.lineno}" if isinstance(e, SyntaxError)
                 else _raised_where(e, module_name))
        raise ConfigError(f"{key}: {path}: importing {module_name} raised "
                          f"{type(e).__name__}: {e} ({where})") from None
    found = module
    for part in name.split("."):
        found = getattr(found, part, None)
        if found is None:
            raise ConfigError(f"{key}: {path}: no such name in {module.__file__}")
    return found


def _raised_where(e: BaseException, module_name: str) -> str:
    """``file, line N`` of the deepest frame of ``e``'s traceback in the module's file."""
    frames = traceback.extract_tb(e.__traceback__)
    top = module_name.split(".")[-1]
    ours = [f for f in frames if Path(f.filename).stem == top] or frames[-1:]
    return f"{ours[-1].filename}, line {ours[-1].lineno}" if ours else module_name


def build(spec: Component, key: str, **given: Any) -> Any:
    """Calls ``spec``'s callable with its keys, checked, and those of ``given`` (what embedtrain
    supplies: ``features``, ``device``) that its signature takes.

    Raises:
        ConfigError: one line naming ``key.<name>``: an unknown key (did you mean ...?), a key
            embedtrain supplies, a wrong type, a required key missing.
    """
    fn = resolve(spec.path, key)
    if not callable(fn):
        raise ConfigError(f"{key}: {spec.path}: a {type(fn).__name__}, not a class or function")
    kwargs = check_keys(fn, spec.keys, key, set(given))
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature: its keys only
        return fn(**kwargs)
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    supplied = {k: v for k, v in given.items() if takes_any or k in params}
    return fn(**supplied, **kwargs)


def check_keys(fn: Callable[..., Any], keys: dict[str, Any], key: str,
               supplied: set[str]) -> dict[str, Any]:
    """``keys`` checked against ``fn``'s signature and converted by its annotations."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature: nothing to check against
        return dict(keys)
    hints = _hints(fn)
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    named = [n for n, p in params.items()
             if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and n not in supplied]
    out = {}
    for name, value in keys.items():
        if name in supplied:
            raise ConfigError(f"{key}.{name}: supplied by embedtrain (the data set's), not a key")
        if name not in named and not takes_any:
            close = difflib.get_close_matches(name, named, n=1)
            hint = f"did you mean '{close[0]}'?" if close else f"it takes: {', '.join(named)}"
            raise ConfigError(f"{key}.{name}: unknown key of {_name(fn)} ({hint})")
        tp = _checkable(hints.get(name))
        out[name] = value if tp is None else convert(tp, value, f"{key}.{name}")
    missing = [n for n in named if n not in keys and params[n].default is params[n].empty]
    if missing:
        raise ConfigError(f"{key}.{missing[0]}: missing (a required argument of {_name(fn)})")
    return out


def _name(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', fn)}"


def _hints(fn: Callable[..., Any]) -> dict[str, Any]:
    target = fn.__init__ if isinstance(fn, type) else fn
    try:
        return typing.get_type_hints(target)
    except Exception:  # noqa: BLE001 - an annotation that does not resolve: not checked
        return {}


def _checkable(tp: Any) -> Any:
    """The annotation as a type the config loader converts (``Sequence[int]``, ``tuple[int,
    ...]``: ``list[int]``), or None where it cannot (``Any``, unions of several types)."""
    if tp is None or tp is Any:
        return None
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        if len(inner) != 1 or _checkable(inner[0]) is None:
            return None
        return typing.Optional[_checkable(inner[0])]
    if origin in (list, tuple, collections.abc.Sequence):
        item = args[0] if args else None
        inner = _checkable(item)
        if inner is None or (origin is tuple and not (len(args) == 2 and args[1] is ...)):
            return None
        return list[inner]
    if origin is dict and len(args) == 2:
        inner = _checkable(args[1])
        return None if inner is None else dict[args[0], inner]
    if isinstance(tp, type) and (tp in (int, float, bool, str) or issubclass(tp, enum.Enum)):
        return tp
    return None

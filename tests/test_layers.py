"""The import rules of ARCHITECTURE.md, enforced: every import of every module, also inside functions.

The rules are read from the table under "## Import rules" in ARCHITECTURE.md (layer, its
modules, the layers it may import), so the document and the check cannot drift apart. Each
``import``/``from ... import`` of embedtrain or pipelines in ``embedtrain/`` and ``pipelines/``
is resolved to the layer of its target and checked against the importer's row.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OURS = ("embedtrain", "pipelines")


def _rules() -> tuple[list[tuple[str, str]], dict[str, set[str]]]:
    """``([(module pattern, layer)], {layer: layers it may import})`` from ARCHITECTURE.md."""
    text = (ROOT / "ARCHITECTURE.md").read_text()
    section = text.split("## Import rules", 1)[1].split("\n## ", 1)[0]
    patterns, allowed = [], {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[1].startswith("`"):
            continue
        layer, modules, may = cells
        for module in re.findall(r"`([\w.*]+)`", modules):
            patterns.append((module, layer))
        allowed[layer] = {x.strip() for x in may.split(",") if x.strip() not in ("", "-", "—")}
    return patterns, allowed


def _layer(module: str, patterns: list[tuple[str, str]]) -> str | None:
    """The layer of ``module``: the most specific pattern that matches it."""
    best, length = None, -1
    for pattern, layer in patterns:
        base = pattern[:-2] if pattern.endswith(".*") else pattern
        hit = module == base or (pattern.endswith(".*") and module.startswith(base + "."))
        if hit and len(base) > length:
            best, length = layer, len(base)
    return best


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> list[tuple[int, str]]:
    """``(line, imported module)`` of every import of embedtrain/pipelines in ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = _module_name(path).rsplit(".", 0 if path.name == "__init__.py" else 1)[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            out.append((node.lineno, name))
            # ``from embedtrain.graph import types``: the submodule is what is imported
            out += [(node.lineno, f"{name}.{a.name}") for a in node.names
                    if (ROOT / Path(*f"{name}.{a.name}".split("."))).with_suffix(".py").exists()]
    return [(line, name) for line, name in out if name.split(".")[0] in OURS]


def _sources() -> list[Path]:
    return sorted(p for top in OURS for p in (ROOT / top).rglob("*.py"))


def violations() -> list[str]:
    patterns, allowed = _rules()
    found = []
    for path in _sources():
        importer = _module_name(path)
        layer = _layer(importer, patterns)
        if layer is None:
            found.append(f"{path.relative_to(ROOT)}: module {importer} is in no layer of "
                         f"ARCHITECTURE.md's import rules")
            continue
        for line, target in _imports(path):
            target_layer = _layer(target, patterns)
            if target_layer is None or target_layer == layer:
                continue  # a package __init__ (e.g. ``embedtrain``) or the layer itself
            if target_layer not in allowed[layer]:
                found.append(f"{path.relative_to(ROOT)}:{line}: {layer} ({importer}) imports "
                             f"{target_layer} ({target})")
    return found


def test_rules_cover_every_layer():
    patterns, allowed = _rules()
    assert len(allowed) >= 12, allowed  # the table was found and parsed
    layers = {layer for _, layer in patterns}
    assert layers == set(allowed)
    for may in allowed.values():
        assert may <= layers, may - layers  # no typo in a "may import" cell


def test_imports_follow_the_layer_rules():
    found = violations()
    assert not found, "imports against ARCHITECTURE.md's rules:\n" + "\n".join(found)


@pytest.mark.parametrize("importer,target,ok", [
    ("embedtrain/models/xc.py", "embedtrain.train.xc_metrics", False),  # models -> train
    ("embedtrain/models/xc.py", "embedtrain.config", False),  # models -> the config schema
    ("embedtrain/sharding/planner.py", "embedtrain.models.xc", False),
    ("embedtrain/data/reader.py", "embedtrain.sharding.planner", False),
    ("embedtrain/train/trainer.py", "embedtrain.train.optim", False),  # trainer: task, ckpt, dir
    ("embedtrain/train/optim.py", "embedtrain.config", False),
    ("pipelines/ingest.py", "embedtrain.models.dlrm", False),
    ("embedtrain/recipes/ctr.py", "embedtrain.config", True),
    ("embedtrain/models/gnn.py", "embedtrain.graph.sampler", True),
    ("embedtrain/train/trainer.py", "embedtrain.train.checkpoint", True),
])
def test_the_rules_say_what_is_allowed(importer, target, ok):
    """The rules themselves: the imports the issue forbids are forbidden, the layering allowed."""
    patterns, allowed = _rules()
    layer = _layer(_module_name(ROOT / importer), patterns)
    target_layer = _layer(target, patterns)
    assert (target_layer == layer or target_layer in allowed[layer]) is ok


def test_a_forbidden_import_is_found(tmp_path, monkeypatch):
    """An import against the rules added to a module is reported with file, line and layers."""
    source = ROOT / "embedtrain" / "models" / "dlrm.py"
    text = source.read_text() + "\n\ndef _bad():\n    from embedtrain.train import trainer\n"
    original = Path.read_text
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k:
                        text if self == source else original(self, *a, **k))
    found = violations()
    assert any(f.startswith("embedtrain/models/dlrm.py:") and "imports trainer" in f
               for f in found), found

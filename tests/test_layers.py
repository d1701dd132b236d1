"""The import rules of ARCHITECTURE.md, enforced: every import of every module, also inside functions.

The rules are read from the table under "## Import rules" in ARCHITECTURE.md (layer, its
modules, the layers it may import), so the document and the check cannot drift apart. Each
``import``/``from ... import`` of embedtrain or pipelines in ``embedtrain/`` and ``pipelines/``
is resolved to the layer of its target and checked against the importer's row.

Also the modules' size and import graph: no module of ``embedtrain/`` or ``pipelines/`` is over
:data:`MAX_LINES` lines, and the modules of ``embedtrain/`` and of ``pipelines/`` import each other
without a cycle (module-level and function-level imports alike).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OURS = ("embedtrain", "pipelines")
MAX_LINES = 600  # a longer module is split where its code has seams


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
    ("pipelines/tabular/passes.py", "embedtrain.models.dlrm", False),
    ("pipelines/xc/passes.py", "pipelines.engines.ray", False),  # a job: the interface only
    ("pipelines/engines/ray.py", "pipelines.tabular.passes", False),  # an engine: no job
    ("pipelines/xc/passes.py", "pipelines.tabular.transforms", False),  # a family: no other
    ("pipelines/graph/read.py", "pipelines.tabular.spec", False),
    ("pipelines/tabular/read.py", "pipelines.xc.read", False),
    ("pipelines/xc/read.py", "pipelines.core.inputs", True),  # what families share is core
    ("embedtrain/recipes/ctr.py", "embedtrain.config", True),
    ("embedtrain/models/gnn.py", "embedtrain.graph.sampler", True),
    ("embedtrain/train/trainer.py", "embedtrain.train.checkpoint", True),
    # the process helpers (spawn, free_port, exit_process) are utilities: the calibration, the
    # training code and the tests share them, and they import nothing of embedtrain
    ("embedtrain/processes.py", "embedtrain.train.dist", False),
    ("embedtrain/sharding/calibrate.py", "embedtrain.processes", True),
    ("embedtrain/train/dist.py", "embedtrain.processes", True),
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


def long_modules() -> list[str]:
    """``"path: N lines"`` of every module of ``embedtrain/`` and ``pipelines/`` over MAX_LINES."""
    counts = {path: len(path.read_text().splitlines()) for path in _sources()}
    return [f"{path.relative_to(ROOT)}: {n} lines" for path, n in counts.items() if n > MAX_LINES]


def import_graph(top: str) -> dict[str, list[str]]:
    """Module -> the other modules of package ``top`` it imports (also inside functions)."""
    paths = [p for p in _sources() if _module_name(p).split(".")[0] == top]
    modules = {_module_name(p) for p in paths}
    return {_module_name(p): sorted({t for _, t in _imports(p)} & modules - {_module_name(p)})
            for p in paths}


def import_cycles(graph: dict[str, list[str]]) -> list[list[str]]:
    """One cycle ``[a, b, ..., a]`` per import that closes one (a depth-first search's back
    edges), in a fixed order."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []
    cycles = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for target in graph[module]:
            if state.get(target) == 1:
                cycles.append(path[path.index(target):] + [target])
            elif target not in state:
                visit(target)
        path.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)
    return cycles


def test_no_module_is_over_the_line_limit():
    found = long_modules()
    assert not found, (f"modules over {MAX_LINES} lines (split them where the code has "
                       "seams):\n" + "\n".join(found))


@pytest.mark.parametrize("top", OURS)
def test_no_import_cycle(top):
    cycles = import_cycles(import_graph(top))
    assert not cycles, f"import cycles among the modules of {top}/:\n" + "\n".join(
        " -> ".join(cycle) for cycle in cycles)


def _with_text(monkeypatch, texts: dict[Path, str]) -> None:
    """``Path.read_text`` of the files in ``texts`` gives that text instead."""
    original = Path.read_text
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k:
                        texts[self] if self in texts else original(self, *a, **k))


def test_a_long_module_is_found(monkeypatch):
    """A module grown past MAX_LINES is reported with its path and line count; one at exactly
    MAX_LINES is not."""
    long, full = ROOT / "embedtrain" / "utils.py", ROOT / "embedtrain" / "features.py"
    _with_text(monkeypatch, {long: "x = 1\n" * (MAX_LINES + 1), full: "x = 1\n" * MAX_LINES})
    found = long_modules()
    assert f"embedtrain/utils.py: {MAX_LINES + 1} lines" in found, found
    assert not any(f.startswith("embedtrain/features.py") for f in found), found


def test_an_import_cycle_is_found(monkeypatch):
    """Two modules of pipelines/ importing each other (one of them inside a function) are
    reported as a path ``a -> b -> a``."""
    a, b = [p for p in _sources()
            if _module_name(p).startswith("pipelines.") and p.name != "__init__.py"][:2]
    name_a, name_b = _module_name(a), _module_name(b)
    _with_text(monkeypatch, {
        a: a.read_text() + f"\n\ndef _late():\n    import {name_b}\n",
        b: b.read_text() + f"\nfrom {name_a} import __doc__ as _doc\n"})
    cycles = [c for c in import_cycles(import_graph("pipelines")) if {name_a, name_b} <= set(c)]
    assert cycles, import_graph("pipelines")
    assert cycles[0] in ([name_a, name_b, name_a], [name_b, name_a, name_b]), cycles


def _recipe_chains(source_dir: Path) -> list[str]:
    """``module: Class(Base)`` of every class in ``source_dir`` that derives from a recipe
    other than ``Recipe`` itself (a family subclassing another family)."""
    classes: dict[str, tuple[str, list[str]]] = {}
    for path in sorted(source_dir.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "")
                         for b in node.bases]
                classes[node.name] = (path.name, bases)

    def is_recipe(name: str) -> bool:
        return name == "Recipe" or any(is_recipe(b) for b in classes.get(name, ("", []))[1])

    return [f"{module}: {name}({', '.join(bases)})" for name, (module, bases) in classes.items()
            if any(b != "Recipe" and is_recipe(b) for b in bases)]


def test_families_are_composed_not_inherited(tmp_path):
    # every built-in recipe subclasses Recipe directly; what families share are parts
    # (TabularData, ClassHeads, graph targets), not base classes
    assert _recipe_chains(ROOT / "embedtrain" / "recipes") == []
    (tmp_path / "a.py").write_text("class Recipe: pass\nclass XC(Recipe): pass\n")
    (tmp_path / "b.py").write_text("from a import XC\nclass Seq(XC): pass\n")
    assert _recipe_chains(tmp_path) == ["b.py: Seq(XC)"]


def _collective_imports(source_dir: Path) -> list[str]:
    """``file:line: module`` of every import in ``source_dir``'s modules of ``torch.distributed``
    or of a class head's or dynamic table's internals (their collectives and autograd): an
    architecture reaches a head only through ``embedtrain.heads.build``."""
    found = []
    for path in sorted(source_dir.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                if name.startswith("torch.distributed") or (
                        name.startswith("embedtrain.heads.") and name != "embedtrain.heads.build"):
                    found.append(f"{path.name}:{node.lineno}: {name}")
    return found


def test_architectures_hold_no_collective(tmp_path):
    # models/ is plain modules (TorchRec's modules/); the sharded heads' collectives live in
    # heads/, the dynamic tables' in tables/ (TorchRec's distributed/)
    assert _collective_imports(ROOT / "embedtrain" / "models") == []
    (tmp_path / "m.py").write_text("import torch.distributed as dist\n"
                                   "from embedtrain.heads.ops import gather\n"
                                   "from embedtrain.heads.build import build_head\n")
    assert _collective_imports(tmp_path) == ["m.py:1: torch.distributed",
                                             "m.py:2: embedtrain.heads.ops"]

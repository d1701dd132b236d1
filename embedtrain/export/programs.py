"""What a model holds, read without its family: its embedding tables (:func:`model_tables`)
and its dense program (:func:`export_program`, :func:`aot_package`).

:mod:`embedtrain.export.export` writes a run's export from these; :mod:`embedtrain.export.nodes`
and the serving benchmark list tables with :func:`model_tables`.
"""

from __future__ import annotations

import io
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from embedtrain.export.manifest import ExportError
from embedtrain.export.tables import checkpoint_tensors, load_tensors
from embedtrain.train.checkpoint import CheckpointError
from embedtrain.tables.dynamic import EmbeddingBags
from embedtrain.heads.build import HEAD_TABLE
from embedtrain.utils import write_atomic, writing

PROGRAM_FILE, SCRIPT_FILE, AOT_FILE = "dense.pt2", "dense.ts", "dense.aoti.pt2"


@dataclass
class TableSpec:
    """One embedding table of the model: its name, checkpoint key, features, shape, pooling."""

    name: str
    key: str
    features: list[str]
    rows: int
    dim: int
    pooling: str
    remap: Optional[str] = None  # dynamic tables: the checkpoint key of the remapper


def model_tables(model: nn.Module) -> list[TableSpec]:
    """Every ``EmbeddingBagCollection`` table of ``model``, with its checkpoint key (and, for a
    dynamic table, its remapper's), in the model's feature order; then every
    ``EmbeddingCollection`` table (per-position lookups, pooling ``none``)."""
    from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
    from torchrec.modules.mc_modules import MCHManagedCollisionModule

    modules = dict(model.named_modules())
    out = []
    for path, module in modules.items():
        if not isinstance(module, EmbeddingBagCollection):
            continue
        # a ManagedCollisionEmbeddingBagCollection's tables: <owner>._embedding_module
        owner = path[:-len("._embedding_module")] if path.endswith("._embedding_module") \
            else None
        for c in module.embedding_bag_configs():
            remap = None
            if owner is not None:
                mcm = f"{owner}._managed_collision_collection._managed_collision_modules." \
                      f"{c.name}"
                if isinstance(modules.get(mcm), MCHManagedCollisionModule):
                    remap = f"model.{mcm}"
            out.append(TableSpec(c.name, f"model.{path}.embedding_bags.{c.name}.weight",
                                  list(c.feature_names), c.num_embeddings, c.embedding_dim,
                                  c.pooling.name.lower(), remap))
    # per-position lookups (a sequence encoder's item table): pooling none
    for path, module in modules.items():
        if isinstance(module, EmbeddingCollection):
            for c in module.embedding_configs():
                if c.name == HEAD_TABLE:  # the class head's planning placeholder: the head
                    continue
                out.append(TableSpec(c.name, f"model.{path}.embeddings.{c.name}.weight",
                                      list(c.feature_names), c.num_embeddings, c.embedding_dim,
                                      "none"))
    # EmbeddingBags holds static and dynamic tables in two collections, but pools (and the
    # sparse arch stacks) them in its configs' order: list them in that order
    for path, module in modules.items():
        if isinstance(module, EmbeddingBags):
            order = {c.name: i for i, c in enumerate(module.embedding_bag_configs())}
            prefix = f"model.{path}."
            places = [i for i, t in enumerate(out) if t.key.startswith(prefix)]
            ordered = sorted((out[i] for i in places), key=lambda t: order[t.name])
            for i, t in zip(places, ordered):
                out[i] = t
    return out


def export_program(module: nn.Module, example: tuple, out: Path) -> tuple[str, str]:
    """``module`` as a ``torch.export`` program with a dynamic batch dimension
    (``torch.export.save``), or TorchScript (``torch.jit.trace``) where export fails; checked
    against ``module`` on ``example``. Returns (file name, format).

    The program is saved to memory, then written with Python's file writes (:func:`_write`):
    torch's archive writer aborts the process when the disk fills."""
    with torch.no_grad():
        expected = module(*example)
        batch = torch.export.Dim("batch")
        data = io.BytesIO()
        try:
            program = torch.export.export(module, example,
                                          dynamic_shapes=tuple({0: batch} for _ in example))
            torch.export.save(program, data)
            file, kind, loaded = PROGRAM_FILE, "torch.export", program.module()
        except Exception:  # noqa: BLE001 - an op torch.export cannot trace: TorchScript
            traced = torch.jit.trace(module, example)
            data = io.BytesIO()
            torch.jit.save(traced, data)
            file, kind, loaded = SCRIPT_FILE, "torchscript", traced
        _write(out / file, data)
        got = loaded(*example)
    if not torch.allclose(got, expected, rtol=1e-5, atol=1e-6):
        raise ExportError(f"{out / file}: the exported program does not reproduce the model "
                          f"(max difference {(got - expected).abs().max():.3g})")
    return file, kind


def aot_package(module: nn.Module, example: tuple, out: Path, progress: bool = False) -> str:
    """Compiles the ``torch.export`` program written in ``out`` (:data:`PROGRAM_FILE`, its batch
    dimension dynamic) with AOTInductor into :data:`AOT_FILE`, loads it back and checks it
    against ``module`` on ``example`` and on its first row alone. Returns the file name."""
    from torch._inductor import aoti_compile_and_package, aoti_load_package

    path = out / AOT_FILE
    if progress:
        print("compiling the dense program with AOTInductor (up to a minute)...",
              file=sys.stderr, flush=True)
    try:
        data = io.BytesIO()  # written by _write (torch's archive writer aborts on a full disk)
        aoti_compile_and_package(torch.export.load(out / PROGRAM_FILE), package_path=data)
    except Exception as e:  # noqa: BLE001 - no C++ compiler, an op without a kernel: one line
        why = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ExportError(f"{path}: AOTInductor could not compile the dense program: "
                          f"{why[:300]}") from None
    _write(path, data)
    try:
        package = aoti_load_package(str(path))
    except Exception as e:  # noqa: BLE001 - a package this machine cannot load: one line
        why = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ExportError(f"{path}: AOTInductor could not compile the dense program: "
                          f"{why[:300]}") from None
    with torch.no_grad():
        for inputs in (example, tuple(x[:1] for x in example)):
            expected, got = module(*inputs), package(*(x.contiguous() for x in inputs))
            same = got.shape == expected.shape
            if not (same and torch.allclose(got, expected, rtol=1e-5, atol=1e-6)):
                diff = (got - expected).abs().max().item() if same else float("inf")
                raise ExportError(f"{path}: the AOTInductor package does not reproduce the "
                                  f"model on {len(inputs[0])} row(s) (max difference "
                                  f"{diff:.3g})")
    return AOT_FILE


def _write(path: Path, data: io.BytesIO) -> None:
    """``data`` as the file ``path``, whole or not at all; a full disk names ``path``."""
    with writing(path):
        write_atomic(path, data.getbuffer())


def load_program(path: Path, kind: str):
    """An exported program loaded for running: ``torch.export`` (its module), ``torchscript``
    or ``aot`` (an AOTInductor package); one line naming the file when it cannot be."""
    if not path.is_file():
        raise ExportError(f"{path}: the dense program is missing")
    if kind == "torchscript":
        try:
            return torch.jit.load(str(path)).eval()
        except Exception as e:  # noqa: BLE001 - truncated, or not TorchScript
            raise ExportError(f"{path}: not a loadable TorchScript program: {_first_line(e)}") \
                from None
    if kind == "aot":
        from torch._inductor import aoti_load_package

        try:
            package = aoti_load_package(str(path))
        except Exception as e:  # noqa: BLE001 - not a package, or one for another machine
            raise ExportError(f"{path}: not a loadable AOTInductor package: "
                              f"{_first_line(e)}") from None
        # its kernels assume the strides it was compiled with: contiguous inputs
        return lambda *inputs: package(*(x.contiguous() for x in inputs))
    quiet = logging.getLogger("torch.export")  # it logs a corrupt archive's traceback, then
    level = quiet.level  # tries the older format: the one line below says it all
    quiet.setLevel(logging.ERROR)
    try:
        return torch.export.load(path).module()
    except Exception as e:  # noqa: BLE001 - truncated, a raw pickle, a torch.save zip: one line
        raise ExportError(f"{path}: not a loadable torch.export program: {_first_line(e)}") \
            from None
    finally:
        quiet.setLevel(level)


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or ['?'])[0][:300]}"


def load_module(path: str | os.PathLike, module: nn.Module, prefix: str) -> nn.Module:
    """``module``'s parameters and buffers (but those on ``meta``: tables read from an export's
    own files) read from the checkpoint's keys ``prefix + name``; ``module`` in eval mode.

    Raises:
        CheckpointError: a key the checkpoint does not hold (named), or an unreadable one.
    """
    tensors = {prefix + k: v for k, v in module.state_dict().items() if v.device.type != "meta"}
    saved = checkpoint_tensors(path)
    missing = [k for k in tensors if k not in saved]
    if missing:
        raise CheckpointError(f"{path}: has no {missing[0]}; was it written by this run's "
                              "model?")
    load_tensors(path, tensors)
    return module.eval()

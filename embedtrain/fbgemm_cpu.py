"""FBGEMM's CPU embedding kernels bound to the FBGEMM inside torch, so they run JIT-generated.

``fbgemm_gpu``'s CPU operators (the TorchRec tables' forward, backward and fused optimizer step)
call FBGEMM's kernel generators (``fbgemm::GenerateSparseAdaGrad``, ``GenerateEmbeddingSpMDM``,
...). Each generator emits AVX2/AVX-512 code with asmjit where the CPU has it, and otherwise falls
back to FBGEMM's scalar reference loops. Two copies of FBGEMM are in the process: torch's, inside
``libtorch_cpu.so``, and the one ``fbgemm_gpu`` ships as ``fbgemm.so``.

With the verified stack (PyPI's torch 2.14.1, fbgemm-gpu-cpu 1.9.0) ``fbgemm_gpu``'s libraries bind
to its ``fbgemm.so``, and on this project's AMD EPYC (AVX2, FMA) that copy's instruction-set check
(``fbgemm::fbgemmHasAvx2Support``) is false: every kernel is the reference loop (``perf`` shows
``fbgemm::rowwise_sparse_adagrad_ref`` and ``EmbeddingSpMDM_ref``). The table step's backward with
row-wise Adagrad (8 tables of 2^20 x 128, 8,192 bags of 8) took 136-176 ms against 14-17 ms; the
training loop ran at 0.6x. torch's copy detects the CPU. With torch 2.13's CPU build
``libtorch_cpu.so`` was in the process's global symbol scope, so these calls bound to torch's
FBGEMM (``perf`` shows JIT code and ``libtorch_cpu.so``'s ``fbgemm::radix_sort_parallel``); torch
2.14.1's build loads it locally.

:func:`install` restores that binding: when ``fbgemm_gpu`` is first imported (an import hook; so
``import embedtrain`` still imports no torch), ``libtorch_cpu.so``, already loaded by torch, is
promoted to the global scope (``dlopen(RTLD_NOLOAD | RTLD_GLOBAL)``) before ``fbgemm_gpu``'s
libraries load and bind: the instruction-set checks (of ``fbgemm.so`` too) and the generators torch
exports with the same signature bind to torch's copy, the rest stay ``fbgemm.so``'s
(``LD_DEBUG=bindings`` shows each; ``tests/test_fbgemm_cpu.py`` checks the checks' binding).
``embedtrain/__init__.py`` calls it. ``EMBEDTRAIN_FBGEMM=own`` leaves ``fbgemm_gpu``'s own copy in
place; ``embedtrain doctor`` says which one serves the kernels.
"""

from __future__ import annotations

import ctypes
import importlib.abc
import os
import sys
from typing import Any, Optional

ENV = "EMBEDTRAIN_FBGEMM"

# what happened: None (fbgemm_gpu not imported yet), "torch", "own" (asked), or why not
state: Optional[str] = None


def _promote() -> str:
    """Puts torch's ``libtorch_cpu.so`` (already loaded by ``import torch``) in the global symbol
    scope; what was done, for :data:`state`."""
    if os.environ.get(ENV, "torch") == "own":
        return "own"
    import torch

    lib = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    if not os.path.exists(lib):
        return "own (torch has no libtorch_cpu.so)"
    try:
        ctypes.CDLL(lib, mode=os.RTLD_GLOBAL | os.RTLD_NOLOAD)
    except OSError as e:
        return f"own (libtorch_cpu.so could not be promoted: {e})"
    return "torch"


class _BeforeFbgemm(importlib.abc.MetaPathFinder):
    """Runs :func:`_promote` once, when ``fbgemm_gpu`` is about to be imported; finds nothing
    itself (the normal finders import the package)."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> None:
        global state
        if fullname == "fbgemm_gpu":
            sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _BeforeFbgemm)]
            state = _promote()
        return None


def install() -> None:
    """Arranges the binding for the first import of ``fbgemm_gpu`` (a no-op when it already
    happened; where ``fbgemm_gpu`` was imported before ``embedtrain``, :data:`state` says so)."""
    global state
    if "fbgemm_gpu" in sys.modules:
        if state is None:
            state = "own (fbgemm_gpu was imported before embedtrain)"
        return
    if not any(isinstance(f, _BeforeFbgemm) for f in sys.meta_path):
        sys.meta_path.insert(0, _BeforeFbgemm())


def describe() -> str:
    """Which FBGEMM serves ``fbgemm_gpu``'s CPU kernels in this process (imports it), for
    ``embedtrain doctor``."""
    import fbgemm_gpu  # noqa: F401  (the import hook runs here, if it has not yet)
    import torch

    isa = torch.backends.cpu.get_cpu_capability()
    if state == "torch":
        return f"torch's FBGEMM (libtorch_cpu.so; CPU capability {isa})"
    return (f"fbgemm_gpu's own fbgemm.so: {state}; its CPU kernels may be the scalar reference "
            f"loops (CPU capability {isa})")

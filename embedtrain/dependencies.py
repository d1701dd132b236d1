"""Packages that only some commands need, imported on first use with a one-line error if missing.

As Polars' ``polars.dependencies`` does: a module that needs, say, PyG asks for it here when it
is used, so ``import embedtrain`` stays light and a missing package is one line naming what to
install, not a traceback from deep inside a model.

Example:
    >>> pyg_nn = import_optional("torch_geometric.nn", "torch-geometric", "GNN models")
"""

from __future__ import annotations

import importlib
from types import ModuleType


# The stack this release is verified with (requirements/cpu.txt and gpu.txt, the Makefile's
# torchrec): ``embedtrain doctor`` compares the installed versions with it; FBGEMM is either build.
VERIFIED = {"torch": "2.14.1", "fbgemm-gpu-cpu|fbgemm-gpu": "1.9.0", "torchrec": "1.9.2",
            "ray": "2.60.0", "polars": "2.1.0", "pyarrow": "26.0.1", "numpy": "2.4.6"}


class MissingDependency(ImportError):
    """A package a command needs is not installed; ``str(err)`` says what to install."""


def import_optional(module: str, package: str, purpose: str) -> ModuleType:
    """Imports ``module``; raises :class:`MissingDependency` naming ``package`` if it is absent.

    Args:
        module: the module to import (``"torch_geometric.nn"``).
        package: the name to ``pip install`` (``"torch-geometric"``).
        purpose: what needs it, for the message (``"GNN models"``).
    """
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        missing = (e.name or module).split(".")[0]
        if missing != module.split(".")[0]:
            raise  # the package is there, one of *its* dependencies is not: show that
        raise MissingDependency(f"{purpose} need the package {package!r}, which is not "
                                f"installed: pip install {package}") from None

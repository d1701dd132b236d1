"""Shared test set-up: the world-of-one process group some tests create is closed at the end;
``quiet_torchrec`` silences TorchRec's planner logging and warnings for a module that asks.

``build_run`` joins a process group (a world of one, as ``embedtrain train`` does); destroying it
before pytest exits keeps gloo's threads from outliving the interpreter's finalization (see
``embedtrain.processes``).
"""

import logging
import warnings

import pytest


@pytest.fixture
def quiet_torchrec():
    logging.getLogger("torchrec").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


@pytest.fixture(autouse=True, scope="session")
def _close_process_group():
    yield
    from embedtrain.processes import destroy_process_group

    destroy_process_group()

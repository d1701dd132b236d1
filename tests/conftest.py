"""Shared test set-up: the world-of-one process group some tests create is closed at the end.

``build_run`` joins a process group (a world of one, as ``embedtrain train`` does); destroying it
before pytest exits keeps gloo's threads from outliving the interpreter's finalization (see
``embedtrain.train.dist``).
"""

import pytest


@pytest.fixture(autouse=True, scope="session")
def _close_process_group():
    yield
    from embedtrain.train.dist import destroy_process_group

    destroy_process_group()

"""``embedtrain.fbgemm_cpu``: FBGEMM's instruction-set checks, called by ``fbgemm_gpu``'s own
``fbgemm.so``, bind to torch's FBGEMM once ``embedtrain`` is imported first, so its CPU kernels
are JIT-generated rather than the scalar reference loops (the speed is in
``benchmarks/bench_stack.py``); ``EMBEDTRAIN_FBGEMM=own`` and an ``fbgemm_gpu`` imported before
``embedtrain`` leave ``fbgemm.so``'s own, and ``embedtrain.fbgemm_cpu.state`` says which."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

CHECK = "_ZN6fbgemm20fbgemmHasAvx2SupportEv"  # fbgemm::fbgemmHasAvx2Support()


def _bound(code: str, **env: str) -> tuple[str, str]:
    """The library ``fbgemm.so``'s call of :data:`CHECK` binds to, and the module's state."""
    r = subprocess.run([sys.executable, "-c", code + "\nimport embedtrain.fbgemm_cpu as f\n"
                        "print(f.state)"], env={**os.environ, "LD_DEBUG": "bindings", **env},
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    found = re.findall(rf"binding file \S*/fbgemm\.so \[0\] to (\S+) \[0\]: "
                       rf"normal symbol `{CHECK}'", r.stderr)
    assert found, "fbgemm.so does not call the instruction-set check"
    return os.path.basename(found[-1]), r.stdout.strip().splitlines()[-1]


@pytest.mark.slow
def test_the_instruction_set_check_binds_to_torchs_fbgemm():
    assert _bound("import embedtrain, fbgemm_gpu") == ("libtorch_cpu.so", "torch")
    assert _bound("import embedtrain, torchrec") == ("libtorch_cpu.so", "torch")
    assert _bound("import embedtrain, fbgemm_gpu", EMBEDTRAIN_FBGEMM="own") == ("fbgemm.so", "own")
    assert _bound("import fbgemm_gpu, embedtrain") == (
        "fbgemm.so", "own (fbgemm_gpu was imported before embedtrain)")

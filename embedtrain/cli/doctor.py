"""``embedtrain doctor``: the installed stack against the verified one, and what a run here gets.

Prints torch, FBGEMM, TorchRec, Ray, Polars, Arrow and NumPy versions beside the combination this
release is verified with (:data:`embedtrain.dependencies.VERIFIED`), the device, and the cores,
threads and allocator setting a run on this machine would use. Exit status 0 when every package
is the verified version, 1 otherwise (a missing package included); it writes nothing.

Example:
    embedtrain doctor --nproc 2 --json
"""

from __future__ import annotations

import json
import platform
import sys
from importlib import metadata


def register(sub) -> None:
    """Adds the ``doctor`` command to the subparsers ``sub``."""
    p = sub.add_parser("doctor", help="installed versions against the verified stack, the "
                                      "device, the cores and threads a run would use")
    p.add_argument("--nproc", type=int, default=1, metavar="N",
                   help="the ranks a run would start on this machine (default: 1)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead")
    p.set_defaults(func=_doctor)


def _installed(names: str) -> tuple[str, str | None]:
    """The first of ``names`` (``a|b``) that is installed and its version; ``(names, None)``."""
    for name in names.split("|"):
        try:
            return name, metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return names, None


def _device() -> str:
    import torch

    if not torch.cuda.is_available():
        return "cpu (no CUDA device)"
    names = {torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())}
    return f"cuda: {torch.cuda.device_count()} x {', '.join(sorted(names))}"


def _doctor(args) -> int:
    from embedtrain.fbgemm_cpu import describe
    from embedtrain.fbgemm_threads import describe as describe_threads
    from embedtrain.dependencies import VERIFIED
    from embedtrain.runtime import allocator_setting, threads_per_rank, usable_cores

    if args.nproc < 1:
        raise ValueError(f"--nproc: must be at least 1, got {args.nproc}")
    packages = []
    for names, verified in VERIFIED.items():
        name, version = _installed(names)
        public = version and version.split("+")[0]  # 2.13.0+cpu is the 2.13.0 release
        packages.append({"package": name, "installed": version, "verified": verified,
                         "ok": public == verified})
    threads, why = threads_per_rank(ranks=args.nproc)
    __version__ = metadata.version("embedtrain")
    report = {"embedtrain": __version__, "python": platform.python_version(),
              "platform": f"{platform.system()} {platform.machine()}",
              "verified": all(p["ok"] for p in packages), "packages": packages,
              "device": _device(), "cores": usable_cores(), "ranks": args.nproc,
              "threads_per_rank": threads, "threads_from": why, "allocator": allocator_setting(),
              "fbgemm_cpu_kernels": describe(),
              "tbe_cpu_threads": describe_threads(threads)}
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"embedtrain {__version__}, python {report['python']}, {report['platform']}")
        for p in packages:
            said = "ok" if p["ok"] else ("not installed" if p["installed"] is None
                                         else f"differs: verified with {p['verified']}")
            print(f"  {p['package']:<16} {p['installed'] or '-':<12} {said}")
        print("the verified combination" if report["verified"] else
              "not the verified combination: make install (or pip install -r "
              "requirements/cpu.txt) installs it")
        print(f"device: {report['device']}; FBGEMM's CPU kernels: "
              f"{report['fbgemm_cpu_kernels']}; CPU table step: {report['tbe_cpu_threads']}")
        print(f"cores: {report['cores']}; {args.nproc} rank(s) here get {threads} thread(s) "
              f"each ({why}); allocator: {report['allocator']}")
    sys.stdout.flush()
    return 0 if report["verified"] else 1

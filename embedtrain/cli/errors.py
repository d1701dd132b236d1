"""The CLI's one place for errors: bad input as one line and exit status 2, a rank that stopped
because a peer did as one line and exit status 1, anything else a traceback (a bug)."""

from __future__ import annotations

import argparse
import errno
import logging
import os
import sys
import warnings

from embedtrain.config import ConfigError
from embedtrain.dependencies import MissingDependency


class UsageError(Exception):
    """Bad input reported as one line and exit status 2."""


_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
              "Socket Timeout", "Connection refused")


def run_command(args: argparse.Namespace) -> int:
    """Runs ``args.func(args)``: its exit status, or the status of the error it raised (printed).

    ``ValueError`` covers the library's one-line errors (DatasetError, DataError, IngestError,
    model size checks); a checkpoint that cannot be read is one line too.
    """
    try:
        return args.func(args)
    except (ConfigError, UsageError, ValueError, FileNotFoundError, MissingDependency) as e:
        print(f"embedtrain {args.command}:{rank_tag()} error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # the disk or the file system, not the input: one line naming the file
        why = "no space left on device" if e.errno == errno.ENOSPC else (e.strerror or str(e))
        where = f"{e.filename}: " if e.filename else ""
        print(f"embedtrain {args.command}:{rank_tag()} error: {where}{why}", file=sys.stderr)
        return 1
    except RuntimeError as e:
        checkpoint = sys.modules.get("embedtrain.train.checkpoint")  # not imported by datagen
        if checkpoint is not None and isinstance(e, checkpoint.CheckpointError):
            print(f"embedtrain {args.command}:{rank_tag()} error: {e}", file=sys.stderr)
            return 2
        if _peer_failed(e):  # another rank stopped (its own error says why): one line here
            print(f"embedtrain {args.command}:{rank_tag()} error: stopped because another "
                  "rank left the process group (its error says why)", file=sys.stderr)
            return 1
        raise
    except KeyboardInterrupt:
        print(f"embedtrain {args.command}: interrupted", file=sys.stderr)
        return 130


def _peer_failed(e: BaseException) -> bool:
    """Whether ``e`` is a collective failing because a peer rank is gone (several ranks only)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and any(m in str(e) for m in _PEER_GONE)


def rank_tag() -> str:
    """`` [rank R/W]`` in a job of several ranks, else nothing."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return f" [rank {os.environ.get('RANK', '0')}/{world}]" if world > 1 else ""


def quiet_libraries() -> None:
    """TorchRec and FBGEMM log planner tables and warnings at import/shard time; users want the
    run."""
    warnings.filterwarnings("ignore", module="torchrec")
    warnings.filterwarnings("ignore", module="fbgemm_gpu")
    warnings.filterwarnings("ignore", category=UserWarning, module="torch")
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch")  # DCP deprecations
    logging.getLogger().setLevel(logging.ERROR)  # torchrec's sharders warn on the root logger
    logging.getLogger("torchrec").setLevel(logging.ERROR)
    logging.getLogger("torch").setLevel(logging.ERROR)
    logging.getLogger("fbgemm_gpu").setLevel(logging.ERROR)

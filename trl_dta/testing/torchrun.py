"""Launch a multi-process test run (``torchrun``, gloo on CPU), and end its workers so that none aborts.

A worker ends with :func:`exit_worker` once its results are saved. A gloo process whose process group is still
alive when the interpreter shuts down can die there with ``terminate called without an active exception``
(SIGABRT): the group, freed during finalization, releases finished work whose tensors need the interpreter
(pytorch/pytorch#190489). ``destroy_process_group()`` is not enough where anything still holds the group (a
DDP module, a device mesh, a trainer): the group is freed with it, at finalization. Measured 2026-12-03 with
torch 2.13 on the 2-core machine, a two-rank script of 20 all-reduces and an all-gather, 20 runs each unless
said: no destroy, 7 and 8 aborted; destroy, 0 of 30; destroy while a reference to the group is kept, 9;
that reference deleted after the destroy, 0; a final barrier only, 3. These aborts failed CI in four runs
(``test_sharded``, ``test_distributed``), once on a worker that destroyed its group.

DeepSpeed's workers build its CPU shared-memory collective (``deepspeed_shm_comm``) with torch's C++ extension
loader on first use, in ``TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions/py311_cpu``, shared by
every venv and torch version of the user). The loader guards a build with a lock file and waits for it with
no limit: a build killed midway (a timeout, a restarted machine) leaves the lock, and every later DeepSpeed
worker waits on it forever. This hung all five DeepSpeed tests of a CI run on 2026-12-06 (a lock left at
03:43 by a killed run; each test ran into its 600-900 s timeout). So :func:`run_workers` gives the workers a
directory of their own per interpreter and torch version (under ``sys.prefix``, unless the caller sets
``TORCH_EXTENSIONS_DIR``), and removes a lock there older than :data:`STALE_LOCK_S` (a build takes about a
minute on two cores).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ABORT = "terminate called without an active exception"
STALE_LOCK_S = 600.0  # an extension build's lock older than this was left by a killed build


def extensions_dir() -> Path:
    """The workers' ``TORCH_EXTENSIONS_DIR``: one per interpreter (venv) and torch version, its stale build
    locks removed (module docstring)."""
    root = Path(sys.prefix) / "torch_extensions" / f"torch-{torch.__version__}"
    now = time.time()
    for lock in root.glob("*/lock"):
        age = now - lock.stat().st_mtime
        if age > STALE_LOCK_S:
            print(
                f"run_workers: removing {lock}, a build lock {age:.0f} s old (a killed build's)",
                file=sys.stderr,
            )
            lock.unlink(missing_ok=True)
    return root


def run_workers(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True, **kwargs)``. Workers get
    ``OPENBLAS_NUM_THREADS=1`` (a solver's BLAS threads beside torch's, on two cores) and
    ``PYTHONFAULTHANDLER=1`` (a rank that dies of a signal prints its Python stacks) and
    ``TORCH_EXTENSIONS_DIR=extensions_dir()`` (DeepSpeed's op builds; module docstring) unless set."""
    env = {"OPENBLAS_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1", **kwargs.pop("env", {})}
    if "TORCH_EXTENSIONS_DIR" not in env:
        env["TORCH_EXTENSIONS_DIR"] = str(extensions_dir())
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, **kwargs)
    if result.returncode != 0 and ABORT in result.stderr:
        print(
            f"run_workers: a rank aborted ({ABORT!r}): does the worker end with exit_worker()? "
            "(trl_dta/testing/torchrun.py)",
            file=sys.stderr,
        )
    return result


def exit_worker(status: int = 0) -> None:
    """End a worker whose results are saved: wait for the other ranks (their last collectives need this one),
    then exit with ``status`` without the interpreter's shutdown, where a live process group can abort (module
    docstring). Also ends DeepSpeed's workers, which may abort there too."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)

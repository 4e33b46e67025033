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
"""

from __future__ import annotations

import os
import subprocess
import sys

import torch.distributed as dist

ABORT = "terminate called without an active exception"


def run_workers(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True, **kwargs)``. Workers get
    ``OPENBLAS_NUM_THREADS=1`` (a solver's BLAS threads beside torch's, on two cores) and
    ``PYTHONFAULTHANDLER=1`` (a rank that dies of a signal prints its Python stacks) unless set."""
    env = {"OPENBLAS_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1", **kwargs.pop("env", {})}
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

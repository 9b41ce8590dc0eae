"""Multi-process (multi-host) runs: `jax.distributed.initialize` from flags or the usual settings.

Every process runs the same command; together they see every process's devices (`jax.devices()`),
and a ``--mesh`` spans them all (`medusa_jax.sharding`). Each process loads the same weights and
data and builds the same global batch, and keeps only its own devices' shards
(`sharding.put`); process 0 writes the metrics and the exported heads, and every process takes
part in the Orbax checkpoints. On CPUs the processes talk through JAX's CPU collectives (gloo).

Settings, flag first, then environment:
  coordinator address  --coordinator HOST:PORT   JAX_COORDINATOR_ADDRESS
  process count        --num-processes N         JAX_NUM_PROCESSES
  process id           --process-id I            JAX_PROCESS_ID
With none of them set the run is single-process (nothing is initialised). On clusters that JAX
detects itself (SLURM, Open MPI, Kubernetes, Cloud TPU), ``--coordinator auto`` lets JAX find
all three.
"""
from __future__ import annotations

import os
from typing import Optional

import jax

ENV = {"coordinator": "JAX_COORDINATOR_ADDRESS", "num_processes": "JAX_NUM_PROCESSES",
       "process_id": "JAX_PROCESS_ID"}


def add_args(p) -> None:
    """The --coordinator / --num-processes / --process-id flags (train.py)."""
    g = p.add_argument_group("multi-process (multi-host) runs: every process runs the same command")
    g.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                   help=f"address of process 0's coordinator service (default ${ENV['coordinator']}); 'auto': "
                        "let JAX detect the cluster (SLURM, Open MPI, Kubernetes, TPU); unset: one process")
    g.add_argument("--num-processes", type=int, default=None, metavar="N",
                   help=f"how many processes take part (default ${ENV['num_processes']})")
    g.add_argument("--process-id", type=int, default=None, metavar="I",
                   help=f"this process's id, 0..N-1 (default ${ENV['process_id']}); process 0 writes the outputs")


def _setting(value, name: str, cast=str):
    if value is not None:
        return value
    raw = os.environ.get(ENV[name])
    if raw in (None, ""):
        return None
    try:
        return cast(raw)
    except ValueError:
        raise ValueError(f"${ENV[name]}={raw!r} is not a valid {name.replace('_', ' ')}") from None


def initialize(coordinator: Optional[str] = None, num_processes: Optional[int] = None,
               process_id: Optional[int] = None) -> bool:
    """Join a multi-process run when one is configured (arguments, else the environment above).

    Must run before anything else touches JAX's backend. Returns True when
    `jax.distributed.initialize` was called, False for a single-process run.
    Raises ValueError for a partial or inconsistent configuration (a coordinator without a process
    count or id, an id outside 0..N-1), naming what is missing.
    """
    coordinator = _setting(coordinator, "coordinator")
    num_processes = _setting(num_processes, "num_processes", int)
    process_id = _setting(process_id, "process_id", int)
    if coordinator is None:
        if num_processes is not None or process_id is not None:
            raise ValueError("a process count or id was given without a coordinator: add --coordinator HOST:PORT "
                             f"(or ${ENV['coordinator']})")
        return False

    if coordinator == "auto":
        jax.distributed.initialize()
        return True
    missing = [f for f, v in (("--num-processes", num_processes), ("--process-id", process_id)) if v is None]
    if missing:
        raise ValueError(f"--coordinator {coordinator} also needs {' and '.join(missing)} (or "
                         f"${ENV['num_processes']} / ${ENV['process_id']})")
    if num_processes < 1 or not 0 <= process_id < num_processes:
        raise ValueError(f"process id {process_id} is outside 0..{num_processes - 1} ({num_processes} processes)")
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id)
    return True

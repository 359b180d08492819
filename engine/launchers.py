"""Which launcher started this process, read from its environment: the rank, the number of
ranks, the rank on its machine, and how the ranks talk (their host channel).

- ``mpiexec`` (MPICH's or Intel MPI's hydra: ``PMI_RANK``, ``PMI_SIZE`` and hydra's
  ``MPI_LOCALNRANKS``; Open MPI: ``OMPI_COMM_WORLD_*``): the host channel is MPI.
- ``srun`` with PMI (``--mpi=pmi2`` or ``pmix``: ``SLURM_PROCID``, ``SLURM_NTASKS``,
  ``SLURM_LOCALID``, ``SLURM_STEP_ID``, and ``PMI_*`` or ``PMIX_RANK``): MPI.
- ``srun`` without PMI, with ``MASTER_ADDR`` and ``MASTER_PORT`` set: torch.distributed
  (gloo), with srun's rank and size.
- ``torchrun`` (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``):
  torch.distributed (gloo).
- none of these: a world of one.

Where MPI runs, MPI tells the rank and size, and what a launcher's variables say must agree
with it (``mismatch_with_mpi``). Slurm's variables count only inside a job step
(``SLURM_STEP_ID``: ``srun`` sets it, a batch script's own process has ``SLURM_PROCID`` and
``SLURM_NTASKS`` without it), and not under ``mpiexec``, which inside an allocation starts its
per-node proxies with ``srun`` (its ranks then see the proxies' ``SLURM_PROCID`` and
``SLURM_NTASKS``, the node's index and count). Likewise under ``torchrun`` (which sets
``TORCHELASTIC_RUN_ID``) started by ``srun`` once per node, the ``SLURM_*`` variables are the
agents', not the ranks'.

Reading the environment imports nothing; ``engine.distributed`` opens the channel.
"""
import os
from dataclasses import dataclass

MPI_VARIABLES = ("PMI_SIZE", "PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE")
MPIEXEC_MARKS = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_SIZE")   # hydra's, Open MPI's mpirun's
SLURM_STEP_MARKS = ("SLURM_STEP_ID", "SLURM_STEPID")          # set by srun, for its tasks
TORCHRUN_MARK = "TORCHELASTIC_RUN_ID"


@dataclass(frozen=True)
class Launch:
    """What started this process. ``rank``, ``size`` and ``local_rank`` are the launcher's
    (None where MPI tells them, or a variable is not set); ``variables`` names what each
    was read from, for messages."""
    launcher: str            # "mpiexec", "srun", "torchrun" or "none"
    channel: str             # "mpi", "torch" or "none" (a world of one)
    rank: int = None
    size: int = None
    local_rank: int = None
    variables: tuple = ()    # (rank's, size's, local rank's variable names)
    master: tuple = None     # (MASTER_ADDR, MASTER_PORT) for the torch channel


def detect(environ=None):
    """The ``Launch`` of this process, from ``environ`` (``os.environ``). Raises
    ``RuntimeError`` naming the variables when they are malformed or contradict each other
    (a rank outside its world, a torchrun world without its master)."""
    environ = os.environ if environ is None else environ
    torch_style = _torch_style(environ)
    slurm = _slurm_step(environ)
    if any(name in environ for name in MPI_VARIABLES):
        launcher = ("srun" if slurm and not any(name in environ for name in MPIEXEC_MARKS)
                    else "mpiexec")
        rank, size, local = slurm if launcher == "srun" else (None, None, None)
        return Launch(launcher, "mpi", rank, size, local,
                      ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"))
    if torch_style is not None:
        rank, size, local = torch_style
        if slurm and TORCHRUN_MARK not in environ and slurm[:2] != (rank, size):
            raise RuntimeError(
                f"RANK={rank} and WORLD_SIZE={size} contradict srun's SLURM_PROCID="
                f"{slurm[0]} and SLURM_NTASKS={slurm[1]}: set RANK and WORLD_SIZE from "
                "them, or leave both unset and let srun's variables count")
        return _torch_launch("torchrun", environ, rank, size, local,
                             ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    if slurm and slurm[1] > 1:
        if "MASTER_ADDR" not in environ or "MASTER_PORT" not in environ:
            raise RuntimeError(
                f"srun started SLURM_NTASKS={slurm[1]} tasks (this one SLURM_PROCID="
                f"{slurm[0]}) but no MPI process-management interface reached them: run "
                "srun --mpi=pmi2 (or pmix; srun --mpi=list shows which), or set MASTER_ADDR "
                "and MASTER_PORT (rank 0's host and a free port) for torch.distributed")
        return _torch_launch("srun", environ, *slurm,
                             ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"))
    return Launch("none", "none", 0, 1, None)


def mismatch_with_mpi(launch, environ, mpi_rank, mpi_size):
    """The one line saying how this rank's launcher variables contradict MPI's rank and
    size, or None when they agree (or there are none to compare)."""
    environ = os.environ if environ is None else environ
    compared = []
    if launch.launcher == "srun":
        compared.append((("SLURM_PROCID", launch.rank), ("SLURM_NTASKS", launch.size)))
    torch_style = _torch_style(environ)
    if torch_style is not None:
        compared.append((("RANK", torch_style[0]), ("WORLD_SIZE", torch_style[1])))
    for (rank_name, rank), (size_name, size) in compared:
        if (rank, size) != (mpi_rank, mpi_size):
            return (f"{rank_name}={rank} and {size_name}={size} contradict MPI's rank "
                    f"{mpi_rank} of {mpi_size} (started by {launch.launcher}): every launcher "
                    "variable must describe the same world; unset the stale ones")
    return None


def _integer(environ, name):
    text = environ.get(name)
    if text is None:
        return None
    try:
        return int(text.strip())
    except ValueError:
        raise RuntimeError(f"{name}={text!r}: expected a whole number") from None


def _torch_style(environ):
    """(RANK, WORLD_SIZE, LOCAL_RANK or None) when torchrun's variables are set, else None."""
    rank, size = _integer(environ, "RANK"), _integer(environ, "WORLD_SIZE")
    if rank is None and size is None:
        return None
    if rank is None or size is None:
        present, missing = ("RANK", "WORLD_SIZE") if size is None else ("WORLD_SIZE", "RANK")
        raise RuntimeError(f"{present}={environ[present]} is set but {missing} is not: "
                           "torchrun sets both (a rank needs its place and the world's size)")
    _check_place("RANK", rank, "WORLD_SIZE", size)
    local = _integer(environ, "LOCAL_RANK")
    if local is not None and not 0 <= local <= rank:
        raise RuntimeError(f"LOCAL_RANK={local} with RANK={rank}: a rank's place on its "
                           "machine is between 0 and its place in the world")
    return rank, size, local


def _slurm_step(environ):
    """(SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID or None) inside an srun step, else None."""
    if not any(name in environ for name in SLURM_STEP_MARKS):
        return None
    rank, size = _integer(environ, "SLURM_PROCID"), _integer(environ, "SLURM_NTASKS")
    if rank is None or size is None:
        return None
    _check_place("SLURM_PROCID", rank, "SLURM_NTASKS", size)
    return rank, size, _integer(environ, "SLURM_LOCALID")


def _check_place(rank_name, rank, size_name, size):
    if size < 1 or not 0 <= rank < size:
        raise RuntimeError(f"{rank_name}={rank} with {size_name}={size}: a rank must be "
                           f"between 0 and {size_name} - 1, and {size_name} at least 1")


def _torch_launch(launcher, environ, rank, size, local_rank, variables):
    if size > 1 and not (environ.get("MASTER_ADDR") and environ.get("MASTER_PORT")):
        missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not environ.get(name)]
        raise RuntimeError(f"{launcher} started {variables[1]}={size} ranks but "
                           f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} "
                           "not set: the ranks meet at MASTER_ADDR:MASTER_PORT (rank 0's "
                           "host and a free port)")
    port = _integer(environ, "MASTER_PORT")
    master = None if size == 1 else (environ["MASTER_ADDR"], port)
    return Launch(launcher, "torch" if size > 1 else "none", rank, size, local_rank,
                  variables, master)

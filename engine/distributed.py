"""Data-parallel training through the standard engines: MPI between processes, NCCL on GPUs.

    mpiexec -n 2 python train.py        # each process: init, broadcast_model, then per step
                                        # backward, all_reduce_gradients, optimizer step

Every rank holds the whole model and trains on its shard of each global batch
(``data.DataLoader(..., shard=(rank(), world_size()))``); ``all_reduce_gradients`` averages
the gradients, so every rank takes the same step and the replicas stay equal.
``mean_over_ranks`` averages host numbers (an epoch's loss and accuracy on each shard), so
rank 0, which alone prints and saves, reports the whole world's.

- **The world.** ``init()`` reads rank and size from MPI (mpi4py; MPICH from the package
  index, since Open MPI refuses to run as root). A process not started by ``mpiexec`` is a
  world of one and imports no MPI at all: everything below then works unchanged, and needs
  no mpi4py. ``init(device="cuda")`` also gives each rank one GPU (its rank on the node) and
  an NCCL communicator (nccl4py) whose unique id rank 0 sends over MPI.
- **One collective per flat gradient buffer per step**, averaging: MPI ``Allreduce`` in
  place on the NumPy buffer on the CPU; NCCL's ``AVG`` in place on a CUDA buffer, zero-copy
  through the CUDA Array Interface and queued on the engine's stream, so it follows the
  backward kernels without a host sync and can be captured into a CUDA graph. No bucketing:
  a model's gradients already are one buffer (one bucket) per device and dtype, and the
  reference MLP's 0.94 MB all-reduce took 0.18-0.20 ms on 2 CPU ranks (``python -m
  bench.distributed`` and a bare mpi4py loop, 2-core machine), a tenth of its 1.6-2 ms
  step; the 784-2048-2048-10 MLP's 23 MB took 7-18 ms of a 66-150 ms step.
- **Same model everywhere.** ``broadcast_model`` first checks that every rank built the same
  model (parameter shapes, buffer devices and dtypes), then sends rank 0's flat parameter
  buffers to all. With ``ENGINE_CHECK_REPLICAS=N`` (N >= 1), every N-th call of
  ``all_reduce_gradients`` (the first one included) first compares a checksum of the flat
  parameter buffers across ranks and raises ``RankMismatch`` naming the first rank whose
  parameters differ from rank 0's. The checksum reads the buffers on the host: a debug mode.
- **No rank waits forever.** A rank that ends with an error while the others wait in a
  collective would leave them hanging (measured with MPICH 5.0.2: a rank that ended with
  ``sys.exit(3)`` while the other waited in ``Allreduce`` left both running until killed;
  a rank killed by a signal does end the run). So in
  a world of several ranks ``init`` makes an uncaught exception print its traceback and then
  abort every rank (``MPI_Abort``, as ``python -m mpi4py`` does), and ``abort(code)`` is the
  way for a program that handles its errors itself to end a run.
"""
import fcntl
import importlib.util
import os
import stat
import struct
import sys
import termios
import time
import zlib

import numpy as np

from ops.cuda import SIMULATOR, cuda, engine_stream
from ops.device import check_device, device_of, to_host
from ops.launch import note_unrecordable

CHECK_REPLICAS_VARIABLE = "ENGINE_CHECK_REPLICAS"
ABORT_DRAIN_S = 10.0   # the longest an abort waits for mpiexec to read this rank's output
# set by the process managers that start MPI ranks: MPICH's hydra, PMIx, Open MPI
LAUNCHER_VARIABLES = ("PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE")
INSTALL_HINT = "pip install -e '.[distributed]'"

_world = None


class RankMismatch(RuntimeError):
    """Ranks that must agree (on the model, the data, the parameters) do not; ``rank`` is the
    first rank that differs from rank 0. Raised on every rank alike."""

    def __init__(self, rank, message):
        super().__init__(message)
        self.rank = rank


class _World:
    """The ranks of this run: MPI's world communicator (None in a world of one started
    without mpiexec) and, once asked for, the NCCL communicator of the GPUs."""

    def __init__(self, MPI):
        self.MPI = MPI   # mpi4py's MPI module, or None
        self.mpi = None if MPI is None else MPI.COMM_WORLD
        self.rank = 0 if MPI is None else self.mpi.Get_rank()
        self.size = 1 if MPI is None else self.mpi.Get_size()
        self.nccl = None
        self.nccl_module = None
        self.replica_interval = _replica_interval()
        self.steps = 0   # calls of all_reduce_gradients so far

    def gather(self, value):
        """Every rank's ``value`` (a picklable object), in rank order."""
        return [value] if self.size == 1 else self.mpi.allgather(value)

    def node_rank_and_size(self):
        """This rank's position among the ranks on its machine, and their number."""
        if self.mpi is None:
            return 0, 1
        node = self.mpi.Split_type(self.MPI.COMM_TYPE_SHARED)
        try:
            return node.Get_rank(), node.Get_size()
        finally:
            node.Free()

    def average(self, array):
        """Replace ``array`` (host or device) by its mean over the ranks, in place."""
        if device_of(array) == "cuda":
            if self.nccl is not None:
                self.nccl.allreduce(array, array, self.nccl_module.AVG, stream=engine_stream())
                return
            self._require_nccl()
        if self.size == 1:
            return
        self.mpi.Allreduce(self.MPI.IN_PLACE, array, op=self.MPI.SUM)
        np.multiply(array, 1.0 / self.size, out=array)

    def broadcast(self, array):
        """Overwrite ``array`` (host or device) with rank 0's, in place."""
        if device_of(array) == "cuda":
            if self.nccl is not None:
                self.nccl.broadcast(array, array, 0, stream=engine_stream())
                return
            self._require_nccl()
        if self.size > 1:
            self.mpi.Bcast(array, root=0)

    def _require_nccl(self):
        if self.size > 1:
            raise RuntimeError("engine.distributed: the model is on cuda but this world has "
                               "no NCCL communicator; call init(device='cuda') first")


# ------------------------------------------------------------------ the world

def init(device="cpu", require_mpi=False):
    """Join the run's world of ranks; call it once at start, before anything uses the GPU.

    ``device="cuda"`` also takes this rank's GPU and creates the NCCL communicator.
    ``require_mpi=True`` fails when mpi4py is not installed (for a program asked to run
    distributed), instead of being a world of one. Calling it again adds what a new
    ``device`` needs and otherwise changes nothing."""
    global _world
    device = check_device(device)
    if _world is None:
        _world = _World(_mpi_module(require_mpi))
        if _world.size > 1:
            _abort_on_uncaught_exception()
    if device == "cuda" and _world.nccl is None:
        _attach_nccl(_world)


def is_initialized():
    """Whether ``init()`` has run (torch.distributed's name)."""
    return _world is not None


def several_ranks():
    """True in a world of more than one rank (False before ``init()``)."""
    return _world is not None and _world.size > 1


def rank():
    """This process's rank, 0 .. world_size() - 1."""
    return _require_world("rank").rank


def world_size():
    """The number of ranks (1 without mpiexec)."""
    return _require_world("world_size").size


def abort(code=1):
    """End this process with exit status ``code``; in a world of several ranks end every
    rank (``MPI_Abort``), so none is left waiting in a collective for this one.

    What this rank printed last (the line saying why) must reach the user before the abort
    ends the run. mpiexec's proxy reads a rank's stdout and stderr from pipes and forwards
    them upstream on the same connection as the rank's abort request, so once the proxy has
    read the pipes, the lines arrive before the abort; a proxy that has not read them yet
    when the abort arrives may lose them (a CI run under load once got an empty stderr).
    So this waits, up to ``ABORT_DRAIN_S``, until both pipes are read empty: an event it
    observes, not a sleep of a guessed length."""
    sys.stdout.flush()
    sys.stderr.flush()
    if _world is not None and _world.size > 1:
        for stream in (sys.stdout, sys.stderr):
            wait_until_read(stream, ABORT_DRAIN_S)
        _world.mpi.Abort(code)
    sys.exit(code)


def wait_until_read(stream, limit_s):
    """Return once the reader of ``stream``'s pipe has read everything written to it, or
    after ``limit_s`` seconds (a reader that stopped reading); at once for a file or a
    terminal."""
    try:
        descriptor = stream.fileno()
        if not stat.S_ISFIFO(os.fstat(descriptor).st_mode):
            return
    except (AttributeError, OSError, ValueError):   # no descriptor (a replaced stream)
        return
    deadline = time.monotonic() + limit_s
    while _unread_bytes(descriptor) and time.monotonic() < deadline:
        time.sleep(0.001)


def _unread_bytes(descriptor):
    """Bytes written into the pipe ``descriptor`` (either end) that no reader has read."""
    return struct.unpack("i", fcntl.ioctl(descriptor, termios.FIONREAD, b"\0" * 4))[0]


# ------------------------------------------------------------------ the model

def broadcast_model(model):
    """Give every rank rank 0's parameters; returns ``model``. Every rank must have built the
    same model (else ``RankMismatch``, on every rank, naming the first that differs)."""
    world = _require_world("broadcast_model")
    buffers = model.flat_buffers()
    check_agreement("the model (parameter shapes; device, dtype and size of each flat "
                    "buffer)", ([tuple(p.shape) for p in model.parameters()],
                                [(b.device, str(b.dtype), int(b.size)) for b in buffers]))
    for buffer in buffers:
        world.broadcast(buffer.data)
    return model


def all_reduce_gradients(model):
    """Average each flat gradient buffer of ``model`` over the ranks, one collective per
    buffer; call it after ``backward()`` and before the optimizer step, on every rank."""
    world = _require_world("all_reduce_gradients")
    if world.size > 1:
        note_unrecordable("an all-reduce (engine.distributed) runs no kernel of the engine")
    if world.replica_interval and world.steps % world.replica_interval == 0:
        check_replicas(model)
    world.steps += 1
    for buffer in model.flat_buffers():
        world.average(buffer.grad)


def average_across_ranks(array):
    """Replace ``array`` (host or device) by its mean over the ranks, in place: MPI on the
    host, NCCL on the GPU (on the engine's stream). Every rank must call it alike, in the
    same order: BatchNorm's batch statistics in training (``nn.BatchNorm(sync=True)``)."""
    world = _require_world("average_across_ranks")
    if world.size > 1:
        note_unrecordable("an all-reduce (engine.distributed) runs no kernel of the engine")
    world.average(array)


def check_replicas(model):
    """Raise ``RankMismatch`` unless every rank's flat parameter buffers are bit for bit
    rank 0's (compared by a CRC-32 of each buffer)."""
    world = _require_world("check_replicas")
    checksums = [zlib.crc32(np.ascontiguousarray(to_host(buffer.data)))
                 for buffer in model.flat_buffers()]
    check_agreement(f"the parameters after {world.steps} step(s) (the replicas have "
                    "diverged; CRC-32 of each flat buffer)", checksums)


def mean_over_ranks(values):
    """The mean over the ranks of each of ``values`` (host numbers: an epoch's loss and
    accuracy on each rank's shard), as a list of floats, the same on every rank."""
    world = _require_world("mean_over_ranks")
    local = np.array(values, dtype=np.float64).reshape(-1)
    if world.size > 1:
        world.average(local)
    return local.tolist()


def check_agreement(what, value):
    """Raise ``RankMismatch`` on every rank unless every rank passed an equal ``value`` (a
    plain picklable value: numbers, strings, tuples, lists); ``what`` names it."""
    values = _require_world("check_agreement").gather(value)
    for other, theirs in enumerate(values):
        if theirs != values[0]:
            raise RankMismatch(other, f"rank {other} disagrees with rank 0 on {what}: "
                                      f"{theirs!r} on rank {other}, {values[0]!r} on rank 0")


# ------------------------------------------------------------------ helpers

def _require_world(what):
    if _world is None:
        raise RuntimeError(f"engine.distributed.{what}: call engine.distributed.init() first")
    return _world


def _launched_by_mpiexec():
    return any(name in os.environ for name in LAUNCHER_VARIABLES)


def _mpi_module(require_mpi):
    """mpi4py's MPI module (initialising MPI), or None for a world of one started without
    mpiexec (MPI is then not even imported)."""
    launched = _launched_by_mpiexec()
    if not launched:
        if require_mpi and importlib.util.find_spec("mpi4py") is None:
            raise RuntimeError(f"engine.distributed.init: a distributed run needs mpi4py, "
                               f"which is not installed; {INSTALL_HINT}")
        return None
    try:
        from mpi4py import MPI
    except ImportError as error:
        raise RuntimeError(f"engine.distributed.init: this process was started by mpiexec "
                           f"but cannot import mpi4py ({error}); {INSTALL_HINT}") from None
    return MPI


def _replica_interval():
    text = os.environ.get(CHECK_REPLICAS_VARIABLE, "").strip()
    if not text:
        return 0
    if not text.isdigit():
        raise ValueError(f"{CHECK_REPLICAS_VARIABLE}={text!r}: expected a number of steps "
                         "between replica checks (1 = every step, 0 = off)")
    return int(text)


def _abort_on_uncaught_exception():
    report = sys.excepthook

    def report_and_abort(kind, value, traceback):
        report(kind, value, traceback)
        abort(1)   # the traceback reaches the user first (see abort)

    sys.excepthook = report_and_abort


def _attach_nccl(world):
    """Select this rank's GPU and create the NCCL communicator of all ranks."""
    if SIMULATOR:
        raise RuntimeError("engine.distributed.init(device='cuda'): NCCL needs a real GPU, "
                           "and this is Numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1)")
    try:
        import nccl.core as nccl
    except ImportError as error:
        raise RuntimeError(f"engine.distributed.init(device='cuda') needs nccl4py ({error}); "
                           f"{INSTALL_HINT}, and NCCL itself (pip install nvidia-nccl-cu12, "
                           "or -cu13 to match the CUDA driver)") from None
    node_rank, node_size = world.node_rank_and_size()
    gpus = len(cuda.gpus)
    if node_size > gpus:
        raise RuntimeError(f"engine.distributed.init(device='cuda'): {node_size} ranks on "
                           f"this machine but {gpus} GPU(s); NCCL takes one GPU per rank")
    cuda.select_device(node_rank)
    unique_id = nccl.get_unique_id() if world.rank == 0 else None
    if world.size > 1:
        unique_id = world.mpi.bcast(unique_id, root=0)
    world.nccl = nccl.Communicator.init(world.size, world.rank, unique_id)
    world.nccl_module = nccl

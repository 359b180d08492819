"""Data-parallel training through the standard engines: MPI between processes, NCCL on GPUs.

    mpiexec -n 2 python train.py        # each process: init, broadcast_model, then per step
                                        # backward, all_reduce_gradients, optimizer step

Every rank holds the whole model and trains on its shard of each global batch
(``data.DataLoader(..., shard=(rank(), world_size()))``); ``all_reduce_gradients`` averages
the gradients, so every rank takes the same step and the replicas stay equal.
``mean_over_ranks`` averages host numbers (an epoch's loss and accuracy on each shard), so
rank 0, which alone prints and saves, reports the whole world's.

- **The world.** ``init()`` asks ``engine.launchers`` what started the process. Under
  ``mpiexec``, or ``srun`` with PMI, rank and size come from MPI (mpi4py; MPICH from the
  package index, since Open MPI refuses to run as root), and srun's or torchrun's variables,
  where set, must agree with them. Under ``torchrun`` (or ``srun`` without PMI, given
  ``MASTER_ADDR``/``MASTER_PORT``) the ranks talk through torch.distributed's gloo backend
  (its TCPStore at the master's address) instead, so PyTorch is needed there and MPI is not.
  A process no launcher started is a world of one and imports neither: everything below
  then works unchanged. ``init(device="cuda")`` also gives each rank one GPU (its rank on the
  machine: MPI's shared-memory split, or ``LOCAL_RANK``/``SLURM_LOCALID``) and an NCCL
  communicator (nccl4py) whose unique id rank 0 sends over the host channel.
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
  way for a program that handles its errors itself to end a run. Over torch.distributed
  there is no abort to send: the rank ends, gloo's peers see its connections close and fail
  their collective (a waiting rank raised "Connection closed by peer" in the test), and
  torchrun then ends the rest.
"""
import atexit
import fcntl
import importlib.util
import os
import socket
import stat
import struct
import sys
import termios
import time
import zlib

import numpy as np

from engine import launchers
from ops.cuda import SIMULATOR, cuda, engine_stream
from ops.device import check_device, device_of, to_host
from ops.launch import note_unrecordable

CHECK_REPLICAS_VARIABLE = "ENGINE_CHECK_REPLICAS"
ABORT_DRAIN_S = 10.0   # the longest an abort waits for mpiexec to read this rank's output
# set by the process managers that start MPI ranks: MPICH's hydra, PMIx, Open MPI (the CLI's
# early answer and its refusal of ranks without --distributed read these; engine.launchers
# reads every launcher's)
LAUNCHER_VARIABLES = ("PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE")
INSTALL_HINT = "pip install -e '.[distributed]'"
TORCH_INSTALL_HINT = "pip install -e '.[torch]' (or start the ranks with mpiexec)"

_world = None


class RankMismatch(RuntimeError):
    """Ranks that must agree (on the model, the data, the parameters) do not; ``rank`` is the
    first rank that differs from rank 0. Raised on every rank alike."""

    def __init__(self, rank, message):
        super().__init__(message)
        self.rank = rank


class _MpiChannel:
    """The ranks' host channel through MPI's world communicator."""

    def __init__(self, MPI):
        self.MPI, self.comm = MPI, MPI.COMM_WORLD
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()

    def gather(self, value):
        return self.comm.allgather(value)

    def sum(self, array):
        self.comm.Allreduce(self.MPI.IN_PLACE, array, op=self.MPI.SUM)

    def broadcast(self, array):
        self.comm.Bcast(array, root=0)

    def broadcast_object(self, value):
        return self.comm.bcast(value, root=0)

    def node_rank_and_size(self, launch):
        node = self.comm.Split_type(self.MPI.COMM_TYPE_SHARED)
        try:
            return node.Get_rank(), node.Get_size()
        finally:
            node.Free()

    def abort(self, code):
        self.comm.Abort(code)


class _TorchChannel:
    """The ranks' host channel through torch.distributed's gloo backend, which meets at
    ``MASTER_ADDR:MASTER_PORT`` (a TCPStore that rank 0 serves); NumPy buffers go in place,
    as tensors sharing their memory. Where the program made a process group itself, its
    rank and size must be the launcher's, and a group of another backend (NCCL's) gets a
    gloo group of the same ranks beside it for the host buffers."""

    def __init__(self, launch):
        try:
            import torch
            import torch.distributed as torch_distributed
        except ImportError as error:
            raise RuntimeError(
                f"engine.distributed.init: {launch.launcher} started {launch.size} ranks "
                f"without MPI, so they talk through torch.distributed (gloo), and PyTorch "
                f"cannot be imported ({error}); {TORCH_INSTALL_HINT}") from None
        self.torch, self.torch_distributed = torch, torch_distributed
        self.rank, self.size = launch.rank, launch.size
        if not torch_distributed.is_initialized():
            host, port = launch.master
            host = f"[{host}]" if ":" in host else host   # an IPv6 address
            torch_distributed.init_process_group("gloo", init_method=f"tcp://{host}:{port}",
                                                 rank=launch.rank, world_size=launch.size)
            # a group left to the interpreter's exit sometimes ended the process with
            # "terminate called without an active exception" (SIGABRT) after its work
            atexit.register(torch_distributed.destroy_process_group)
        self.ranks = (None if torch_distributed.get_backend() == "gloo"
                      else torch_distributed.new_group(backend="gloo"))
        found = (torch_distributed.get_rank(), torch_distributed.get_world_size())
        if found != (launch.rank, launch.size):
            raise RuntimeError(f"engine.distributed.init: torch.distributed's process group "
                               f"is rank {found[0]} of {found[1]}, but {launch.variables[0]}="
                               f"{launch.rank} and {launch.variables[1]}={launch.size}")

    def gather(self, value):
        values = [None] * self.size
        self.torch_distributed.all_gather_object(values, value, group=self.ranks)
        return values

    def sum(self, array):
        # in place, in the array's memory
        self.torch_distributed.all_reduce(self.torch.from_numpy(array), group=self.ranks)

    def broadcast(self, array):
        self.torch_distributed.broadcast(self.torch.from_numpy(array), src=0, group=self.ranks)

    def broadcast_object(self, value):
        box = [value]
        self.torch_distributed.broadcast_object_list(box, src=0, group=self.ranks)
        return box[0]

    def node_rank_and_size(self, launch):
        """The launcher's local rank, and how many ranks share this machine's host name."""
        if launch.local_rank is None:
            raise RuntimeError(f"engine.distributed.init(device='cuda'): "
                               f"{launch.variables[2]} is not set, and under "
                               f"{launch.launcher} it says which GPU of its machine a rank "
                               f"takes ({launch.variables[0]}={launch.rank})")
        hosts = self.gather(socket.gethostname())
        return launch.local_rank, hosts.count(hosts[self.rank])

    def abort(self, code):
        # gloo's peers see this process's connections close and fail their collectives;
        # torchrun then ends the other ranks
        os._exit(code)


class _World:
    """The ranks of this run: the host channel (None in a world of one) and, once asked
    for, the NCCL communicator of the GPUs."""

    def __init__(self, launch, channel):
        self.launch, self.channel = launch, channel
        self.rank = 0 if channel is None else channel.rank
        self.size = 1 if channel is None else channel.size
        self.nccl = None
        self.nccl_module = None
        self.replica_interval = _replica_interval()
        self.steps = 0   # calls of all_reduce_gradients so far

    def gather(self, value):
        """Every rank's ``value`` (a picklable object), in rank order."""
        return [value] if self.size == 1 else self.channel.gather(value)

    def node_rank_and_size(self):
        """This rank's position among the ranks on its machine, and their number."""
        if self.channel is None:
            return (self.launch.local_rank or 0), 1
        return self.channel.node_rank_and_size(self.launch)

    def average(self, array):
        """Replace ``array`` (host or device) by its mean over the ranks, in place."""
        if device_of(array) == "cuda":
            if self.nccl is not None:
                self.nccl.allreduce(array, array, self.nccl_module.AVG, stream=engine_stream())
                return
            self._require_nccl()
        if self.size == 1:
            return
        self.channel.sum(array)
        np.multiply(array, 1.0 / self.size, out=array)

    def broadcast(self, array):
        """Overwrite ``array`` (host or device) with rank 0's, in place."""
        if device_of(array) == "cuda":
            if self.nccl is not None:
                self.nccl.broadcast(array, array, 0, stream=engine_stream())
                return
            self._require_nccl()
        if self.size > 1:
            self.channel.broadcast(array)

    def _require_nccl(self):
        if self.size > 1:
            raise RuntimeError("engine.distributed: the model is on cuda but this world has "
                               "no NCCL communicator; call init(device='cuda') first")


# ------------------------------------------------------------------ the world

def init(device="cpu", require_mpi=False):
    """Join the run's world of ranks; call it once at start, before anything uses the GPU.

    ``device="cuda"`` also takes this rank's GPU and creates the NCCL communicator.
    ``require_mpi=True`` fails when mpi4py is not installed (for a program asked to run
    distributed), instead of being a world of one; under torchrun, which needs PyTorch
    instead, it asks nothing more. The launcher's variables that contradict each other or
    MPI raise ``RuntimeError`` naming them, on every rank alike. Calling it again adds what a
    new ``device`` needs and otherwise changes nothing."""
    global _world
    device = check_device(device)
    if _world is None:
        _world = _join(require_mpi)
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
        _world.channel.abort(code)
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


def _join(require_mpi):
    """The world this process's launcher started it in (``engine.launchers``), its host
    channel open; in a world of several ranks an uncaught exception ends them all."""
    try:
        launch = launchers.detect()
    except RuntimeError as error:
        raise RuntimeError(f"engine.distributed.init: {error}") from None
    channel = None
    if launch.channel == "mpi":
        channel = _MpiChannel(_mpi_module(launch))
        problem = launchers.mismatch_with_mpi(launch, None, channel.rank, channel.size)
        # every rank learns every rank's problem, so all fail together or none does
        problems = channel.gather(problem) if channel.size > 1 else [problem]
        failing = [(r, text) for r, text in enumerate(problems) if text]
        if failing:
            r, text = failing[0]
            raise RuntimeError(f"engine.distributed.init: rank {r}: {text}")
    elif launch.channel == "torch":
        channel = _TorchChannel(launch)
    elif require_mpi and importlib.util.find_spec("mpi4py") is None:
        raise RuntimeError(f"engine.distributed.init: a distributed run needs mpi4py, "
                           f"which is not installed; {INSTALL_HINT}")
    world = _World(launch, channel)
    if world.size > 1:
        _abort_on_uncaught_exception()
    return world


def _mpi_module(launch):
    """mpi4py's MPI module, initialising MPI."""
    try:
        from mpi4py import MPI
    except ImportError as error:
        raise RuntimeError(f"engine.distributed.init: this process was started by "
                           f"{launch.launcher} (MPI) but cannot import mpi4py ({error}); "
                           f"{INSTALL_HINT}") from None
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
    if node_size > gpus or node_rank >= gpus:
        raise RuntimeError(f"engine.distributed.init(device='cuda'): {node_size} ranks on "
                           f"this machine (this one its number {node_rank}) but {gpus} "
                           f"GPU(s); NCCL takes one GPU per rank")
    cuda.select_device(node_rank)
    unique_id = nccl.get_unique_id() if world.rank == 0 else None
    if world.size > 1:
        unique_id = world.channel.broadcast_object(unique_id)
    world.nccl = nccl.Communicator.init(world.size, world.rank, unique_id)
    world.nccl_module = nccl

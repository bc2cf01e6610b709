"""parallel.backend: mpi | nccl | auto (issue 35 item 6), without a GPU.

NCCL refuses two ranks on one GPU, so the order, the bucket boundaries and
the capture are tested on the emulated device with the emulated NCCL
(tests/emulated_gpu/nccl.py, which reduces across the MPI ranks for real
and refuses what NCCL refuses): tests/mpi_scripts/nccl_equiv.py. Here too:
the graph rewrite, the choice and its reason, the watchdog, the config key
and the start-up block."""
import re
import types

import pytest

from purine_mpi.base.errors import GraphError, UserError
from purine_mpi.comm import nccl
from purine_mpi.graph.core import Graph, Location
from purine_mpi.parallel.nccl_backend import use_nccl
from tests.conftest import run_cli_args, run_cli_here
from tests.mpi_scripts.launch import run_mpi


class _World:
    """A one-rank world for choose_backend (its one allgather)."""

    rank, size = 0, 1
    stall_timeout = 300.0

    def allgather_object(self, obj, what=""):
        return [obj]


def test_mpi_is_chosen_as_asked_and_auto_says_why_nccl_cannot_run():
    assert nccl.choose_backend("mpi", _World(), 0) == ("mpi", "parallel.backend: mpi")
    backend, why = nccl.choose_backend("auto", _World(), -1)
    assert backend == "mpi" and why == "auto: rank 0: the model runs on the CPU"
    backend, why = nccl.choose_backend("auto", _World(), 0)   # no CuPy on this machine
    assert backend == "mpi" and why.startswith("auto: rank 0: CuPy's NCCL binding does not "
                                               "import"), why
    with pytest.raises(UserError, match=r"parallel.backend: nccl cannot run here: rank 0: "
                                        r"the model runs on the CPU; use parallel.backend: mpi"):
        nccl.choose_backend("nccl", _World(), -1)
    with pytest.raises(UserError, match="expected one of mpi, nccl, auto"):
        nccl.choose_backend("gloo", _World(), 0)


def _bucketed_graph(device=0):
    g = Graph("dp")
    gpu = Location(device=device)
    for i in range(3):
        g.add_blob(f"bucket{i}", (4,), "float32", gpu, kind="bucket")
        g.add_blob(f"g{i}", (4,), "float32", gpu, kind="grad", alias_of=f"bucket{i}", offset=0)
        g.add_blob(f"s{i}", (4,), "float32", gpu, kind="grad", alias_of=f"bucket{i}", offset=0)
    # made in another order than their seq: the chain follows seq
    for i in (2, 0, 1):
        g.add_op(f"bucket{i}.allreduce", "Allreduce", [f"g{i}"], [f"s{i}"],
                 {"seq": i, "bucket": f"bucket{i}"}, location=gpu, thread="comm")
    g.add_blob("h", (4,), "float32", gpu)
    g.add_blob("h.sum", (4,), "float32", gpu)
    g.add_op("grouped", "Allreduce", ["h"], ["h.sum"], {"seq": 3, "group": [0, 1]},
             location=gpu, thread="comm")
    return g


def test_the_buckets_become_nccl_ops_on_one_stream_chained_in_seq_order():
    g = _bucketed_graph()
    names = use_nccl(g)
    assert names == ["bucket0.allreduce", "bucket1.allreduce", "bucket2.allreduce"]
    ops = [g.ops[n] for n in names]
    assert {op.op_type for op in ops} == {"NcclAllreduce"}
    assert {op.thread for op in ops} == {nccl.NCCL_STREAM}
    assert [op.control_inputs for op in ops] == [[], [names[0]], [names[1]]]
    assert [op.attrs["seq"] for op in ops] == [0, 1, 2]   # the seq and bucket stay
    assert g.ops["grouped"].op_type == "Allreduce"       # a group's stays on MPI
    assert use_nccl(g) == []                              # nothing left to rewrite
    with pytest.raises(GraphError, match="NCCL needs them on one GPU"):
        use_nccl(_bucketed_graph(device=-1))


class _Op:
    def __init__(self, seq, waited):
        self.op = types.SimpleNamespace(name=f"grad_bucket{seq}.allreduce")
        self.attrs = {"seq": seq, "bucket": f"grad_bucket{seq}"}
        self._waited = waited

    def waiting_since(self, now):
        return self._waited

    def describe(self):
        return f"bucket grad_bucket{self.attrs['seq']}, 1.0 KB, seq {self.attrs['seq']}"


def test_the_watchdog_names_the_first_stalled_op_aborts_nccl_and_ends_the_job(
        monkeypatch, capfd):
    aborted, ended = [], []
    world = types.SimpleNamespace(rank=1, stall_timeout=2.0, abort=ended.append)
    monkeypatch.setattr(nccl, "_ops", [_Op(2, 9.0), _Op(0, None), _Op(1, 5.0)])
    comm = types.SimpleNamespace(abort=lambda: aborted.append("ncclCommAbort"))
    monkeypatch.setattr(nccl, "_comms", {(0, 1): comm})
    dog = nccl.NcclWatchdog(world)
    kernel, waited = dog.stalled()
    assert kernel.attrs["seq"] == 1 and waited == 5.0    # the first in seq order
    world.stall_timeout = 10.0
    assert dog.stalled() is None                          # nothing past the timeout
    world.stall_timeout = 2.0
    dog.fire(kernel, waited)
    err = capfd.readouterr().err
    assert err.strip() == (
        "rank 1: NCCL allreduce 'grad_bucket1.allreduce' (bucket grad_bucket1, 1.0 KB, seq 1) "
        "stalled for more than 2 s (parallel.stall_timeout; waited 5.0 s): a peer is slow, "
        "dead or launched its collectives in another order; ending the job with ncclCommAbort")
    assert aborted == ["ncclCommAbort"] and ended == [1]


@pytest.mark.mpi
def test_two_emulated_gpus_reduce_through_nccl_inside_the_captured_iteration(host_build_dir):
    """2 ranks, each its own emulated GPU and the emulated NCCL: the buckets
    reduce in seq order on the nccl stream, eagerly then inside the one
    captured graph of the iteration, and train like one rank with twice the
    batch (tests/mpi_scripts/nccl_equiv.py)."""
    proc, _ = run_mpi("nccl_equiv.py", 2, host_build_dir, timeout=240)
    assert proc.stdout.count("OK nccl_equiv") == 2, proc.stdout + proc.stderr


@pytest.mark.mpi
def test_two_ranks_on_one_gpu_are_refused_and_auto_takes_mpi(host_build_dir):
    proc, _ = run_mpi("nccl_equiv.py", 2, host_build_dir, "shared", timeout=120)
    assert proc.stdout.count("OK nccl_shared") == 2, proc.stdout + proc.stderr


@pytest.mark.mpi
@pytest.mark.parametrize("when", ["stall", "stall-replay"])   # eager, or inside the graph
def test_a_stalled_peer_is_named_by_the_nccl_watchdog_and_the_job_ends(host_build_dir, when):
    proc, seconds = run_mpi("nccl_equiv.py", 2, host_build_dir, when, timeout=120,
                            expect_ok=False)
    assert proc.returncode != 0 and seconds < 40, (proc.returncode, seconds)
    assert re.search(r"rank 0: NCCL allreduce 'grad_bucket\d+\.allreduce' \(bucket "
                     r"grad_bucket\d+, [\d.]+ KB, seq \d+\) stalled for more than 2 s", proc.stderr), \
        proc.stderr
    assert "ncclCommAbort" in proc.stderr and "Traceback" not in proc.stderr


def test_the_config_key_and_the_start_up_line(tmp_path, digits_h5):
    from tests.conftest import small_net_config
    from tests.test_log import _block, _write
    cfg = small_net_config(digits_h5)
    cfg["parallel"] = {"backend": "auto"}
    res = run_cli_args("train", _write(tmp_path, cfg), "--out", tmp_path / "run", "--iters", "2")
    assert res.returncode == 0, res.stderr
    rows, _ = _block(res.stdout)
    assert rows["collectives"] == "mpi (auto: rank 0: the model runs on the CPU)"
    cfg["parallel"] = {"backend": "infiniband"}
    res = run_cli_here("train", _write(tmp_path, cfg), "--out", tmp_path / "bad")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "parallel.backend" in res.stderr and "nccl" in res.stderr, res.stderr


def test_nccl_serves_sync_data_parallelism_only_decided_from_the_config():
    from purine_mpi.parallel.nccl_backend import apply_backend

    def job(**par):
        base = dict(backend="auto", scheme="data", mode="sync")
        return types.SimpleNamespace(path="job.yaml", parallel=types.SimpleNamespace(
            **dict(base, **par)))

    class Two(_World):   # no collective may happen: a pipeline's ranks all get here,
        size = 2         # a parameter server's do not

        def allgather_object(self, obj, what=""):
            raise AssertionError("a collective for a scheme NCCL does not serve")

    g = _bucketed_graph()
    assert apply_backend(g, job(mode="async"), Two(), 0) == (
        "mpi", "auto: NCCL reduces the buckets of schemes data and sharded, mode sync; this "
               "job runs "
               "scheme data, mode async")
    assert apply_backend(g, job(backend="mpi", scheme="pipeline"), Two(), 0) == \
        ("mpi", "parallel.backend: mpi")
    with pytest.raises(UserError, match=r"job.yaml: key 'parallel.backend': nccl cannot run "
                                        r"here: .* scheme pipeline"):
        apply_backend(g, job(backend="nccl", scheme="pipeline"), Two(), 0)
    assert apply_backend(g, job(backend="mpi"), _World(), 0) == (None, None)
    assert {op.op_type for op in g.ops.values()} == {"Allreduce"}   # untouched

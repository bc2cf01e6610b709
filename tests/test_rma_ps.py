"""Parameter servers over windows (issue 34, parallel/ps_windows.py): the
weights of sync_ps are bitwise those of two-sided, through shared windows
(one node) and RMA windows (emulated hosts); async keeps its staleness bound
with the weights read by Get; the graphs show the window ops."""
import os

import numpy as np
import pytest

from purine_mpi.job.config import dump_config
from purine_mpi.job.replica import build_train_graph
from purine_mpi.parallel.param_server import compose_for_rank
from tests.conftest import REPO, make_job
from tests.mpi_scripts.common import mlp_config
from tests.mpi_scripts.launch import run_mpi, run_python
from tests.conftest import checkpoint_arrays as _weights




def _train(tmp_path, cfg_path, name, n, *sets, env=None):
    args = ["-m", "purine_mpi", "train", str(cfg_path), "--out", str(tmp_path / name)]
    for s in sets:
        args += ["--set", s]
    proc, _ = run_python(n, args, timeout=300, env=env)
    assert "error" not in proc.stderr.lower(), proc.stderr
    return proc, _weights(tmp_path / name / "latest.h5")


def test_graphs_show_the_window_ops():
    """graph --np 3: a worker Puts each gradient into its slot and Gets each
    weight; the sync_ps server WaitWrites the slots and Publishes the
    weights; two_sided keeps Send/Recv; every Put meets its WaitWrite."""
    from purine_mpi.comm.verify import comm_signature, compare_signatures
    kinds = {}
    for transport in ("auto", "two_sided"):
        cfg = mlp_config(parallel={"mode": "sync_ps", "ps_ranks": 1, "transport": transport})
        slices = []
        for rank in range(3):
            g, grads = build_train_graph(make_job(cfg), 0, 2)
            slices.append(compose_for_rank(g, grads, cfg, 3, rank))
        assert compare_signatures([comm_signature(s) for s in slices]) == []
        kinds[transport] = [sorted({op.op_type for op in s.ops.values()
                                    if op.op_type in ("Put", "Get", "WaitWrite", "Publish",
                                                      "Send", "Recv")}) for s in slices]
    assert kinds["auto"] == [["Get", "Put"], ["Get", "Put"], ["Publish", "WaitWrite"]]
    assert kinds["two_sided"] == [["Recv", "Send"]] * 3
    g, grads = build_train_graph(make_job(mlp_config()), 0, 2)
    server = compose_for_rank(g, grads, mlp_config(parallel={"mode": "sync_ps"}), 3, 2)
    pub = [op for op in server.ops.values() if op.op_type == "Publish"]
    assert len(pub) == 6 and all(op.attrs["region"] == "ps/" + op.inputs[0][:-4]
                                 for op in pub)  # p@new -> region ps/p


@pytest.mark.mpi
def test_sync_ps_one_sided_equals_two_sided_bitwise(tmp_path):
    """3 ranks (2 workers, 1 server), 6 iterations: the weights and momenta
    of shared windows, of RMA windows (two emulated hosts, one rank each)
    and of shared windows under PURINE_COMM_DELAY jitter are bitwise those
    of Send/Recv; the start-up block names the transport."""
    cfg = mlp_config(solver={"max_iter": 6, "display": 3},
                     parallel={"mode": "sync_ps", "ps_ranks": 1})
    path = tmp_path / "mlp.yaml"
    path.write_text(dump_config(cfg))
    _, ref = _train(tmp_path, path, "two", 3, "parallel.transport=two_sided")
    proc, shared = _train(tmp_path, path, "one", 3, "parallel.transport=one_sided")
    assert "one-sided, shared windows" in proc.stdout, proc.stdout
    proc, rma = _train(tmp_path, path, "rma", 3, "parallel.transport=one_sided",
                       env={"PURINE_RANKS_PER_HOST": "1"})
    assert "one-sided, RMA windows" in proc.stdout, proc.stdout
    _, jitter = _train(tmp_path, path, "jit", 3, env={"PURINE_COMM_DELAY": "3:7"})
    assert sorted(ref) == sorted(shared) and any(k.startswith("solver/") for k in ref)
    for other in (shared, rma, jitter):
        for k, v in ref.items():
            assert np.array_equal(v, other[k]), k


@pytest.mark.mpi
@pytest.mark.parametrize("n,staleness,delay", [(3, 1, "2:5"), (4, 0, "")])
def test_async_over_windows_keeps_the_staleness_bound(n, staleness, delay):
    """The async server applies each gradient put into its slots and serves
    no pulls; no worker's push is applied while it leads the slowest by more
    than max_staleness (the workers' Gets wait), every push is applied, and
    with staleness 0 every worker ends with the server's weights."""
    proc, _ = run_mpi("param_server.py", n, "async", 1, staleness, "one_sided",
                      env={"PURINE_COMM_DELAY": delay}, timeout=120)
    assert proc.stdout.count("OK param_server") == n


@pytest.mark.mpi
def test_sync_ps_50_iterations_digits_one_sided_equals_two_sided(tmp_path, digits_h5):
    """The issue's target: LeNet on digits, 3 ranks, 50 iterations (seconds)."""
    path = os.path.join(REPO, "jobs", "digits_lenet.yaml")
    sets = [f"data.train.path={digits_h5}", f"data.test.path={digits_h5}",
            "parallel.mode=sync_ps", "parallel.ps_ranks=1", "solver.max_iter=50",
            "solver.test_interval=0", "checkpoint.interval=0"]
    _, ref = _train(tmp_path, path, "two", 3, *sets, "parallel.transport=two_sided")
    _, one = _train(tmp_path, path, "one", 3, *sets, "parallel.transport=one_sided")
    assert sorted(ref) == sorted(one)
    for k, v in ref.items():
        assert np.array_equal(v, one[k]), k


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["sync_ps", "async"])
def test_bench_runs_the_parameter_server_modes(tmp_path, mode):
    """``bench --json`` on 2 workers + 1 server: the transport, the bytes
    rank 0 moves per iteration (each param's gradient out and its weights
    in: two-sided Send/Recv; with shared windows two CPU copies and nothing
    through MPI; with RMA windows MPI_Rput and MPI_Get and no copy), and a
    sync_ps server's communication times."""
    import json
    cfg = mlp_config(parallel={"mode": mode, "ps_ranks": 1, "max_staleness": 1})
    path = tmp_path / "mlp.yaml"
    path.write_text(dump_config(cfg))
    g, _ = build_train_graph(make_job(cfg), 0, 2)
    params = sum(b.nbytes for b in g.blobs.values() if b.kind == "param" and b.alias_of is None)
    res = {}
    for name, transport, env in (("two", "two_sided", {}), ("one", "one_sided", {}),
                                 ("rma", "one_sided", {"PURINE_RANKS_PER_HOST": "1"})):
        proc, _ = run_python(3, ["-m", "purine_mpi", "bench", str(path), "--json", "--iters", "3",
                                 "--set", f"parallel.transport={transport}"], timeout=120,
                             env=env)
        res[name] = json.loads(proc.stdout.strip().splitlines()[-1])
    two, one, rma = res["two"], res["one"], res["rma"]
    # RMA windows (one rank per emulated host): MPI_Rput and MPI_Get, no copy
    assert rma["bytes_one_sided_per_iter"] >= 2 * params and rma["bytes_copied_per_iter"] == 0
    assert rma["server_transport"].startswith("one-sided, RMA windows")
    assert two["mode"] == one["mode"] == mode and two["world_size"] == 3
    assert two["transport"] == "two_sided" and one["transport"] == "one_sided"
    assert two["bytes_two_sided_per_iter"] == 2 * params and two["bytes_copied_per_iter"] == 0
    assert one["bytes_two_sided_per_iter"] == 0 and one["bytes_one_sided_per_iter"] == 0
    assert one["server_transport"].startswith("one-sided, shared windows")
    if mode == "sync_ps":  # gradients computed into the slots, weights read in place
        assert one["bytes_copied_per_iter"] == 0
        # the server updates the weights in their region: its Publish copies nothing
        assert one["server_bytes_copied_per_iter"] == rma["server_bytes_copied_per_iter"] == 0
        for r in (one, two):
            assert r["server_comm_ms_per_iter"] > 0 and r["server_send_ms_per_iter"] > 0
    else:  # gradients in the slots; the sequence lock copies the weights (maybe twice)
        assert params <= one["bytes_copied_per_iter"] < 3 * params
        assert one["server_comm_ms_per_iter"] is None  # the async loop runs no graph
    for r in (one, two):
        assert r["images_per_s"] > 0


class _NoDurations:
    def lookup(self, name, rank, rows=None):
        return 0.0


@pytest.mark.parametrize("mode", ["sync_ps", "pipeline"])
def test_predictor_models_one_sided_transfers(mode, tmp_path):
    """predict's cost of a transfer of B bytes: two-sided α + B/β (a
    parameter server's link shared by W workers: α + W·B/β), one-sided
    α_put + B/β_put (Put, Get, WaitWrite: no receive posted, no matching),
    a Put matched with its WaitWrite by window region; a link file keeps
    α_put and β_put."""
    from purine_mpi.tools.scaling.link import Link, load_link, save_link
    from purine_mpi.tools.scaling.model import Scenario, Template
    link = Link(1e-5, 1e9, 0.0, "test", alpha_put=2e-6, beta_put=4e9)
    save_link(tmp_path / "l.json", link)
    assert load_link(tmp_path / "l.json").put(1000) == pytest.approx(2e-6 + 1000 / 4e9)
    assert Link(1e-5, 1e9).put(1000) == Link(1e-5, 1e9).p2p(1000)  # no figures: a message's
    par = {"mode": "sync_ps", "ps_ranks": 1} if mode == "sync_ps" else \
        {"scheme": "pipeline", "stages": {"fc1": 0, "relu1": 0, "fc2": 1, "relu2": 1,
                                          "out": 1, "loss": 1}}
    seen = {}
    for transport in ("two_sided", "one_sided"):
        job = make_job(mlp_config(parallel=dict(par, transport=transport)))
        scenario = Scenario(job, 3 if mode == "sync_ps" else 2)
        w = 2 if mode == "sync_ps" else 1
        for rank in scenario.ranks:
            t = Template(job, scenario, rank)
            for name, op in t.graph.ops.items():
                if name not in t.comm:
                    continue
                sim = t._comm_op(op, (), _NoDurations(), link, "auto", scenario)
                seen.setdefault(transport, set()).add(op.op_type)
                if op.op_type in ("Release", "WaitFree"):  # a notify word, a wait for one
                    assert sim.kind == "compute" and sim.nbytes == 0
                    assert sim.seconds == (link.alpha_put if op.op_type == "Release" else 0)
                    continue
                one = op.op_type not in ("Send", "Recv")
                want = (link.alpha_put + w * sim.nbytes / link.beta_put) if one else \
                    (link.alpha + w * sim.nbytes / link.beta)
                assert sim.seconds == pytest.approx(want), (name, op.op_type)
                assert sim.tag == (op.attrs["region"] if one else op.attrs["tag"])
    assert seen["two_sided"] == {"Send", "Recv"}
    assert seen["one_sided"] >= ({"Put", "Get"} if mode == "sync_ps" else {"Put", "WaitWrite"})
    assert not seen["one_sided"] & {"Send", "Recv"}


@pytest.mark.mpi
def test_data_parallel_sum_through_a_shared_window(tmp_path):
    """parallel.transport one_sided on one node: each bucket is summed
    through a shared window (comm/rma_reduce.py) -- on 2 ranks bitwise the
    weights of MPI's allreduce (a0 + a1 either way), also under
    PURINE_COMM_DELAY jitter; on 3 ranks equal up to the order of the sum.
    auto keeps the allreduce."""
    cfg = mlp_config(solver={"max_iter": 6, "display": 3})
    path = tmp_path / "mlp.yaml"
    path.write_text(dump_config(cfg))
    proc, auto = _train(tmp_path, path, "auto", 2)
    assert "summed through a shared window" not in proc.stdout
    proc, one = _train(tmp_path, path, "one", 2, "parallel.transport=one_sided")
    assert "gradients: summed through a shared window" in proc.stdout, proc.stdout
    _, jitter = _train(tmp_path, path, "jit", 2, "parallel.transport=one_sided",
                       env={"PURINE_COMM_DELAY": "3:5"})
    for other in (one, jitter):
        for k, v in auto.items():
            assert np.array_equal(v, other[k]), k
    import json
    proc, _ = run_python(2, ["-m", "purine_mpi", "bench", str(path), "--json", "--iters", "2",
                             "--set", "parallel.transport=one_sided"], timeout=120)
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    grads = sum(v.nbytes for k, v in auto.items() if k.startswith("params/"))
    assert res["transport"] == "one_sided" and res["bytes_two_sided_per_iter"] == 0
    assert res["bytes_copied_per_iter"] == 2 * grads  # each bucket copied in and out
    _, three_ref = _train(tmp_path, path, "three_ref", 3, "parallel.transport=two_sided")
    _, three = _train(tmp_path, path, "three", 3, "parallel.transport=one_sided")
    for k, v in three_ref.items():
        np.testing.assert_allclose(three[k], v, rtol=1e-5, atol=1e-7, err_msg=k)


def test_auto_keeps_send_recv_for_servers_across_hosts_without_rdma(monkeypatch):
    """auto: one node -> shared windows; two emulated hosts (one rank each)
    -> two-sided, as the network emulates RMA over TCP (benchmarks/
    transport.py --two-hosts measured Put slower than Send there), unless
    PURINE_RMA_ACROSS_HOSTS says otherwise."""
    from purine_mpi.parallel import ps_windows
    from purine_mpi.parallel.param_server import _Offline, plan_param_server, ps_layout
    job = make_job(mlp_config(parallel={"mode": "sync_ps", "ps_ranks": 1}))
    g, grads = build_train_graph(job, 0, 2)
    plan = plan_param_server(g, grads, ps_layout(3, 1))
    for var in ("PURINE_RANKS_PER_HOST", "PURINE_RMA_ACROSS_HOSTS", "UCX_TLS", "FI_PROVIDER"):
        monkeypatch.delenv(var, raising=False)
    assert ps_windows.choose(job, _Offline(3, 0), plan)[0] == "shared"
    monkeypatch.setenv("PURINE_RANKS_PER_HOST", "1")
    kind, why, _ = ps_windows.choose(job, _Offline(3, 0), plan)
    assert kind == "two_sided" and "emulate RMA over TCP" in why
    monkeypatch.setenv("PURINE_RMA_ACROSS_HOSTS", "1")
    assert ps_windows.choose(job, _Offline(3, 0), plan)[0] == "rma"

"""Parameter servers (parallel.mode sync_ps / async): the last ps_ranks
ranks serve, the others train."""
import numpy as np
import pytest

from purine_mpi.base.errors import UserError
from purine_mpi.job.replica import build_train_graph
from purine_mpi.parallel.param_server import compose_for_rank, plan_param_server, ps_layout
from tests.conftest import make_job
from tests.mpi_scripts.common import mlp_config
from tests.mpi_scripts.launch import run_mpi, run_python


def test_layout_and_sharding():
    assert ps_layout(5, 2) == {"workers": [0, 1, 2], "servers": [3, 4]}
    with pytest.raises(UserError, match="at least 3 ranks"):
        ps_layout(2, 2)
    cfg = mlp_config(parallel={"mode": "sync_ps", "ps_ranks": 2})
    g, grads = build_train_graph(make_job(cfg), 0, 2)
    plan = plan_param_server(g, grads, ps_layout(4, 2))
    assert plan["order"][0] == "out/weight"           # top layer pushed first
    assert set(plan["owner"].values()) == {2, 3}
    tags = [t for p in plan["order"] for t in plan["tags"][p]]
    assert len(set(tags)) == len(tags)


def test_too_few_ranks_for_the_servers_names_the_config_file():
    """``mpiexec -n 2`` with ps_ranks 2 said "error: key 'parallel.ps_ranks':
    ..." without the file: the first check a run makes (split_workers, before
    any MPI call) left the config's path out (before the fix:
    ``assert text.startswith(f'{job.path}: ')`` failed)."""
    from purine_mpi.parallel.param_server import split_workers

    class TwoRanks:
        rank, size = 0, 2

    cfg = mlp_config(parallel={"mode": "sync_ps", "ps_ranks": 2})
    job = make_job(cfg)
    assert job.path
    with pytest.raises(UserError) as info:
        split_workers(job, TwoRanks())
    text = str(info.value)
    assert text.startswith(f"{job.path}: key 'parallel.ps_ranks': 2 server rank(s)"), text


def test_worker_and_server_graphs_match():
    """Every push has a receive on its server and every pull a send."""
    from purine_mpi.comm.verify import comm_signature, compare_signatures
    cfg = mlp_config(parallel={"mode": "sync_ps", "ps_ranks": 1})
    slices = []
    for rank in range(3):
        g, grads = build_train_graph(make_job(cfg), 0, 2)
        slices.append(compose_for_rank(g, grads, cfg, 3, rank))
    assert not any(op.op_type == "SGDUpdate" for op in slices[0].ops.values())
    assert sum(op.op_type == "SGDUpdate" for op in slices[2].ops.values()) == 6
    assert slices[1].ops["data"].attrs["rank"] == 1
    assert compare_signatures([comm_signature(s) for s in slices]) == []


@pytest.mark.mpi
@pytest.mark.parametrize("n,args,delay", [(4, ["sync_ps", 2], ""), (2, ["async", 1, 0], ""),
                                          (3, ["async", 1, 0], ""), (4, ["async", 1, 1], ""),
                                          (3, ["sync_ps", 1], "3:4")])
def test_param_server_runs(n, args, delay):
    """(with PURINE_COMM_DELAY: seeded random delays in the push/pull ops)"""
    proc, _ = run_mpi("param_server.py", n, *args, env={"PURINE_COMM_DELAY": delay})
    assert proc.stdout.count("OK param_server") == n


@pytest.mark.mpi
def test_train_cli_sync_ps_equals_allreduce(tmp_path):
    """``train`` end to end: 2 workers + 1 server give bitwise the weights of
    2 ranks with allreduce, and the checkpoint carries the servers' momenta."""
    import h5py
    from purine_mpi.job.config import dump_config
    cfg = mlp_config(solver={"max_iter": 6, "display": 3})
    path = tmp_path / "mlp.yaml"
    path.write_text(dump_config(cfg))
    out = {}
    # async with max_staleness 0 is synchronous SGD too (the requirement)
    for mode, n in (("sync", 2), ("sync_ps", 3), ("async", 3)):
        run_python(n, ["-m", "purine_mpi", "train", str(path), "--out", str(tmp_path / mode),
                       "--set", f"parallel.mode={mode}", "--set", "parallel.max_staleness=0"])
        with h5py.File(tmp_path / mode / "latest.h5", "r") as f:
            out[mode] = {k: f[k][()] for k in ("params/out/weight", "params/fc1/bias",
                                               "solver/fc1/weight/momentum")}
    for other in ("sync_ps", "async"):
        for k, v in out["sync"].items():
            assert np.array_equal(v, out[other][k]), (other, k)


@pytest.mark.mpi
def test_train_cli_sync_ps_clips_like_allreduce(tmp_path):
    """solver.clip_gradients on the one server of sync_ps: the weights of 2
    workers + 1 server equal those of 2 ranks with allreduce (the norm of
    the averaged gradients either way), and the clip acts."""
    import h5py
    from purine_mpi.job.config import dump_config
    cfg = mlp_config(solver={"max_iter": 4, "display": 2})
    path = tmp_path / "mlp.yaml"
    path.write_text(dump_config(cfg))
    out = {}
    for name, mode, n, clip in (("plain", "sync", 2, "null"), ("sync", "sync", 2, "0.05"),
                                ("sync_ps", "sync_ps", 3, "0.05")):
        run_python(n, ["-m", "purine_mpi", "train", str(path), "--out", str(tmp_path / name),
                       "--set", f"parallel.mode={mode}", "--set",
                       f"solver.clip_gradients={clip}"])
        with h5py.File(tmp_path / name / "latest.h5", "r") as f:
            out[name] = {k: f[k][()] for k in ("params/out/weight", "params/fc1/bias")}
    for k, v in out["sync"].items():
        np.testing.assert_allclose(out["sync_ps"][k], v, rtol=1e-5, atol=1e-7, err_msg=k)
    assert not np.allclose(out["sync"]["params/out/weight"], out["plain"]["params/out/weight"])

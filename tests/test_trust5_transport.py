"""Issue 42, the transports: the serial twin runs every scheme on every
transport with the event dispatcher's bits, ``--dispatcher`` reaches the
parameter servers, one-sided data parallelism on a GPU is refused in one
line, and the start-up block shows the agreed transport once."""
import json
import os
import subprocess

import numpy as np
import pytest

from purine_mpi.base.errors import GraphError
from purine_mpi.comm.ops import is_comm_op
from purine_mpi.ops.catalog import get_kernel_class
from purine_mpi.tools.graph import compose_for
from tests.conftest import MPIEXEC, PYTHON, REPO, cli_env, make_job, run_cli_here
from tests.mpi_scripts.launch import run_mpi
from tests.conftest import checkpoint_arrays as _weights

PIPELINE = os.path.join(REPO, "jobs", "digits_pipeline.yaml")
LENET = os.path.join(REPO, "jobs", "digits_lenet.yaml")
HYBRID = os.path.join(REPO, "jobs", "digits_hybrid.yaml")
PS = {"sync_ps": ["parallel.mode=sync_ps", "parallel.ps_ranks=1"],
      "async": ["parallel.mode=async", "parallel.ps_ranks=1", "parallel.max_staleness=1"]}
# (scheme, config, ranks, --set): a pipeline, sync_ps (2 workers), async (1
# worker: the server applies its pushes in one order, so a run has one result)
SCHEMES = {"pipeline": (PIPELINE, 2, []), "sync_ps": (LENET, 3, PS["sync_ps"]),
           "async": (LENET, 2, PS["async"])}


def _job(path, digits_h5, *sets):
    from purine_mpi.job.config import load_config
    overrides = [f"data.train.path={digits_h5}", f"data.test.path={digits_h5}", *sets]
    return make_job(load_config(path, overrides=overrides, check_files=False))


def _posting(graph):
    """The comm ops in the dispatcher's posting order (seq, then position),
    and those of them posted strictly in it (collectives)."""
    position = {op.name: i for i, op in enumerate(graph.topo_order())}
    comm = sorted((op for op in graph.ops.values() if is_comm_op(op)),
                  key=lambda o: (o.attrs.get("seq", 1 << 30), position[o.name]))
    names = [op.name for op in comm]
    return names, [op.name for op in comm if get_kernel_class(op.op_type, op.name).seq_ordered]


@pytest.mark.parametrize("transport", ["one_sided", "two_sided"])
@pytest.mark.parametrize("scheme", ["pipeline", "sync_ps", "async", "hybrid", "data"])
def test_the_serial_twin_orders_every_scheme_on_every_transport(
        scheme, transport, digits_h5):
    """Every rank's slice (composed as ``graph --np N`` does): the twin's
    fixed order exists (on main 0849175+ a one-sided slice was "a cycle":
    its WaitFree, an iteration's first wait, has a seq after the Puts its
    writer feeds), respects every dependency and keeps the collectives in
    seq order; where seq is a topological order of the comm ops (every
    two-sided slice) the twin posts exactly in seq order, as before."""
    from purine_mpi.runtime.scheduler import twin_order
    path, n, sets = {"hybrid": (HYBRID, 4, []), "data": (LENET, 2, [])}.get(
        scheme, SCHEMES.get(scheme))
    job = _job(path, digits_h5, f"parallel.transport={transport}", *sets)
    protocol = set()
    for rank in range(n):
        graph = compose_for(job, n, rank)
        comm, ordered = _posting(graph)
        protocol |= {graph.ops[c].op_type for c in comm} & {"WaitFree", "Release"}
        order = twin_order(graph, comm, ordered)
        at = {name: i for i, name in enumerate(order)}
        assert sorted(order) == sorted(graph.ops)
        for name, deps in graph.dependencies().items():
            assert all(at[d] < at[name] for d in deps), name
        assert sorted(ordered, key=at.get) == ordered
        if transport == "two_sided":
            assert sorted(comm, key=at.get) == comm
    if transport == "one_sided" and scheme != "data":
        assert protocol, "no WaitFree or Release: the slices are not one-sided"


def test_the_old_rule_finds_the_cycle(digits_h5):
    """What the twin did before: every comm op chained in seq order. On a
    one-sided pipeline slice that is a cycle (so this test shows the
    slices above are the ones that failed)."""
    graph = compose_for(_job(PIPELINE, digits_h5, "parallel.transport=one_sided"), 2, 0)
    comm, _ = _posting(graph)
    deps = {n: set(d) for n, d in graph.dependencies().items()}
    for before, after in zip(comm, comm[1:]):
        deps[after].add(before)
    with pytest.raises(GraphError, match="cycle"):
        graph.topo_order(deps)


# ------------------------------------------------------------ under MPI


def _figures(path):
    keep = ("phase", "iter", "loss", "accuracy", "lr")
    with open(path) as f:
        return [{k: v for k, v in json.loads(line).items() if k in keep} for line in f]


def _train(n, path, out, *extra, env=None, timeout=300):
    if MPIEXEC is None:
        pytest.skip("mpiexec not found")
    full = cli_env()
    full.update(env or {})
    return subprocess.run([MPIEXEC, "-n", str(n), PYTHON, "-m", "purine_mpi", "train", path,
                           "--out", str(out), *map(str, extra)], cwd=REPO, env=full,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.mpi
@pytest.mark.parametrize("transport", ["one_sided", "two_sided"])
@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_serial_dispatcher_gives_the_event_dispatchers_bits(scheme, transport, tmp_path,
                                                            digits_h5):
    """PURINE_DISPATCHER=serial against event: a pipeline (2 ranks),
    sync_ps (3) and async (2) on both transports, 6 iterations with a test
    pass at 3 and 6: the same losses and accuracies and bitwise the same
    weights and momenta. (On main the one-sided runs exited 2: "the graph
    has a cycle through ops: ...".)"""
    path, n, sets = SCHEMES[scheme]
    args = []
    for s in [f"data.train.path={digits_h5}", f"data.test.path={digits_h5}",
              "solver.max_iter=6", "solver.test_interval=3", "solver.display=1",
              f"parallel.transport={transport}", *sets]:
        args += ["--set", s]
    runs = {}
    for kind in ("serial", "event"):
        res = _train(n, path, tmp_path / kind, *args, env={"PURINE_DISPATCHER": kind})
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
        assert res.stderr.strip() == "" or "error" not in res.stderr.lower(), res.stderr
        runs[kind] = (_weights(tmp_path / kind / "latest.h5"),
                      _figures(tmp_path / kind / "metrics.jsonl"))
    (serial, serial_figs), (event, event_figs) = runs["serial"], runs["event"]
    assert serial_figs == event_figs and len(serial_figs) >= 8, serial_figs
    assert sorted(serial) == sorted(event) and any(k.startswith("solver/") for k in serial)
    for k, v in event.items():
        assert np.array_equal(v, serial[k]), k


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["sync_ps", "async"])
def test_dispatcher_option_reaches_the_servers_and_the_workers(mode, tmp_path, digits_h5):
    """``--dispatcher serial`` with parameter servers: every rank builds
    the serial twin -- the workers (train and test graphs) and a sync_ps
    server (an async server runs no graph). On main the option was dropped
    for these modes: every rank built EventDispatchers."""
    n = 3
    args = ["train", LENET, "--out", tmp_path / "run", "--dispatcher", "serial"]
    for s in [f"data.train.path={digits_h5}", f"data.test.path={digits_h5}",
              "solver.max_iter=2", "solver.test_interval=2", *PS[mode]]:
        args += ["--set", s]
    env = {"PURINE_DISPATCHER": ""}
    proc, _ = run_mpi("dispatcher_kinds.py", n, *args, timeout=300, env=env)
    lines = sorted(line for line in proc.stdout.splitlines() if line.startswith("DISPATCHERS"))
    servers = [] if mode == "async" else [f"DISPATCHERS rank {n - 1}: SerialDispatcher"]
    workers = [f"DISPATCHERS rank {r}: SerialDispatcher" for r in range(n - 1)]
    if mode == "async":
        assert f"DISPATCHERS rank {n - 1}: " in proc.stdout, proc.stdout
        lines = [line for line in lines if not line.startswith(f"DISPATCHERS rank {n - 1}:")]
    assert lines == sorted(workers + servers), proc.stdout


# ------------------------------------------------ one-sided on a GPU
@pytest.mark.parametrize("gpu", ["device=0", "backend=cupy"])
def test_one_sided_data_parallel_on_a_gpu_is_refused(gpu, tmp_path, digits_h5):
    """The shared-window sum of the buckets is host memory: with the
    buckets on a GPU, ``parallel.transport: one_sided`` is one line naming
    both keys, exit 2 -- decided by the job, since the graph is composed
    before it is placed (on main ``graph --np 2`` printed the slice with
    windowed Allreduces, and a run on the emulated GPU said "summed through
    a shared window" while the sum read the device buffers from the host,
    past their staging). ``auto`` and ``two_sided`` still compose."""
    sets = ["--set", f"data.train.path={digits_h5}", "--set", f"data.test.path={digits_h5}",
            "--set", gpu]
    res = run_cli_here("graph", LENET, "--np", "2", "--rank", "1", *sets,
                       "--set", "parallel.transport=one_sided")
    key = gpu.split("=")[0]
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stdout[-500:] + res.stderr
    assert "key 'parallel.transport': one_sided needs the gradient buckets on the CPU, " \
        f"but key '{key}' puts them on a GPU" in res.stderr and "Traceback" not in res.stderr
    for transport in ("auto", "two_sided"):
        res = run_cli_here("graph", LENET, "--np", "2", "--rank", "1", *sets,
                           "--set", f"parallel.transport={transport}")
        assert res.returncode == 0 and " Allreduce " in res.stdout, res.stderr


@pytest.mark.mpi
def test_one_sided_data_parallel_on_a_gpu_refused_at_train(tmp_path, digits_h5):
    """The same refusal in a live run, on every rank, before anything
    looks for CuPy (on main: the CuPy error, naming only 'device')."""
    res = _train(2, LENET, tmp_path / "run", "--set", f"data.train.path={digits_h5}",
                 "--set", f"data.test.path={digits_h5}", "--set", "device=0",
                 "--set", "parallel.transport=one_sided", timeout=120)
    assert res.returncode == 2, res.stdout + res.stderr
    assert res.stderr.count("\n") == 1 and "key 'parallel.transport': one_sided needs the " \
        "gradient buckets on the CPU, but key 'device'" in res.stderr, res.stderr


# --------------------------------------- the start-up block's transport row
@pytest.mark.mpi
def test_startup_block_shows_the_agreed_transport_once(tmp_path, digits_h5):
    """Two emulated hosts (PURINE_RANKS_PER_HOST=1), ``auto``: rank 0 has
    PURINE_RMA_ACROSS_HOSTS=0, rank 1 nothing (no RDMA network here). Both
    choose Send/Recv for different reasons; the block shows the choice once,
    with rank 0's reason (on main: two ``transport`` rows)."""
    if MPIEXEC is None:
        pytest.skip("mpiexec not found")
    args = [PYTHON, "-m", "purine_mpi", "train", PIPELINE, "--out", str(tmp_path / "run"),
            "--set", f"data.train.path={digits_h5}", "--set", f"data.test.path={digits_h5}",
            "--set", "solver.max_iter=2", "--set", "solver.test_interval=0"]
    env = cli_env()
    env["PURINE_RANKS_PER_HOST"] = "1"
    for key in ("PURINE_RMA_ACROSS_HOSTS", "FI_PROVIDER", "UCX_TLS"):
        env.pop(key, None)
    cmd = [MPIEXEC, "-n", "1", "-env", "PURINE_RMA_ACROSS_HOSTS", "0", *args,
           ":", "-n", "1", *args]
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    rows = [line.strip() for line in res.stdout.splitlines()
            if line.strip().startswith("transport")]
    assert len(rows) == 1, res.stdout
    assert "two-sided Send/Recv (ranks on two hosts, PURINE_RMA_ACROSS_HOSTS=0; as rank 0 " \
        "sees it, other ranks give other reasons)" in rows[0], rows

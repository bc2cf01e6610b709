"""``plan``'s "checkpoint save" row (``Scheme.save_bytes``, the
footprint's ``save``): the host bytes a save holds beyond an iteration's
rows, on rank 0 its receive buffers and joins; counted in the host's need
where the save (between iterations: no kernel temporaries) holds more than
an iteration. The figure against closed forms of the layouts of
tests/test_sharded_rss.py's 8 fc layers of 768 x 768 (AdamW), and against
the bytes a save makes resident in a run on 2 ranks."""
import json
import subprocess

import numpy as np
import pytest
import yaml

from purine_mpi.job.config import load_job
from purine_mpi.tools.plan import MemoryLimits, offline_footprints, run_plan
from tests.conftest import MPIEXEC, PYTHON, REPO, cli_env, run_cli_here
from tests.test_sharded_rss import _deep_mlp

W = 768 * 768 * 4   # an fc layer's weight (and each of its AdamW states), float32
B = 768 * 4         # its bias

#: the layouts on 2 ranks: config's parallel section
LAYOUTS = {
    "data": {"scheme": "data"},
    "pipeline": {"scheme": "pipeline", "stages": {f"fc{i}": int(i >= 4) for i in range(8)}
                 | {"out": 1, "loss": 1} | {f"a{i}": int(i >= 4) for i in range(8)}},
    "tensor": {"scheme": "tensor", "tensor_parallel": 2},
    "sharded": {"scheme": "sharded", "shard": 1, "bucket_mb": 2.5},
}


def _config(tmp_path, name):
    cfg = _deep_mlp()
    cfg["parallel"] = LAYOUTS[name]
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _saves(tmp_path, name, size=2):
    job = load_job(_config(tmp_path, name), (), None, check_files=False)
    fps, _ = offline_footprints(job, size, list(range(size)))
    return [fps[r].save for r in range(size)], fps


@pytest.mark.parametrize("name,rank0", [
    ("data", 0),
    # stage 1's weights into slot 0, their 2 states into slots 0 and 1
    ("pipeline", 2 * W),
    # the same slots, and two split parameters' joined states at once (fc0's
    # weight then its bias: column split, both joined from the shards)
    ("tensor", 2 * W + 2 * W + 2 * B),
    # one bucket a layer: its two states gathered into slots 0 and 1
    ("sharded", 2 * (W + B)),
])
def test_the_save_row_is_rank_0s_buffers_and_joins(tmp_path, name, rank0):
    """On the CPU only rank 0 holds more while a save runs (the others send
    their own arrays); data parallelism writes rank 0's own arrays (0)."""
    saves, fps = _saves(tmp_path, name)
    assert saves == [rank0, 0]
    for fp in fps.values():
        loop = sum(fp.host.values())
        assert fp.loop_total == loop
        assert fp.save_total == loop - fp.host["kernel_temporaries"] + fp.save
        assert fp.host_total == max(loop, fp.save_total)


#: scheme sharded on 4 ranks, streamed a parameter at a time
#: (``streamed_join`` with ``_join_plan``): 2 stages x 2 replicas; and 2
#: replicas x 2 tensor shards of 3 fc layers in one bucket, so that a
#: split parameter's state pieces lie on both replicas of each shard
FOUR = {
    "staged": (8, dict(LAYOUTS["pipeline"], scheme="sharded", shard=1)),
    "sharded_tensor": (3, {"scheme": "sharded", "shard": 1, "tensor_parallel": 2,
                           "bucket_mb": 100}),
}


def _four(tmp_path, name):
    layers, parallel = FOUR[name]
    cfg = _deep_mlp(layers=layers)
    cfg["parallel"] = parallel
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.parametrize("name,rank0", [
    # stage 1's weights, then each parameter's first state, into slot 0
    # (one weight's size), its second state into slot 1; each a view of
    # the buffer (a stage's replicas are one span of it)
    ("staged", 2 * W),
    # the same slots; a split weight's state pieces on ranks 0, 2 (shard 0)
    # and 1, 3 (shard 1) are not one span: each shard's copied together
    # (a weight's size) then the shards joined (another), while fc2's two
    # joined states (the previous parameter) and fc1's first are held:
    # 2 W + 2 W + W + 2 W
    ("sharded_tensor", 7 * W),
])
def test_one_rank_and_sharded_with_stages_or_tensor_shards(tmp_path, name, rank0):
    """One rank writes its own arrays (0 of every scheme); scheme sharded
    with stages or tensor shards streams each parameter's pieces to rank 0
    (about one parameter's whole weight and state beyond its own), the
    other ranks send views of their own arrays (0)."""
    assert _saves(tmp_path, "data", 1)[0] == [0]
    job = load_job(_four(tmp_path, name), (), None, check_files=False)
    fps, _ = offline_footprints(job, 4, range(4))
    assert [fps[r].save for r in range(4)] == [rank0, 0, 0, 0]


def test_plan_shows_the_row_and_counts_it_in_the_need(tmp_path):
    """Text and --json: the row on each rank; rank 0's need is the save's
    total where that is the larger, and a --host-memory between the
    iteration's total and the save's refuses it."""
    job = load_job(_config(tmp_path, "pipeline"), (), None, check_files=False)
    out, code = run_plan(job, 2, MemoryLimits(host=1 << 40), as_json=True)
    ranks = {r["rank"]: r for r in json.loads(out)["ranks"]}
    host = ranks[0]["host"]
    assert host["checkpoint_save"] == 2 * W and ranks[1]["host"]["checkpoint_save"] == 0
    assert host["save_total"] == host["loop_total"] - host["kernel_temporaries"] + 2 * W
    assert host["total"] == max(host["loop_total"], host["save_total"]) == host["save_total"]
    assert ranks[0]["fits"]["host"]["need_bytes"] == host["total"]
    text, _ = run_plan(job, 2, MemoryLimits(host=1 << 40))
    assert "checkpoint save" in text and "at a save" in text
    limit = (host["loop_total"] + host["save_total"]) // 2
    _, code = run_plan(job, 2, MemoryLimits(host=limit), as_json=True)
    assert code == 2


#: the probes' resident-memory helpers: a /proc/self/status figure in bytes,
#: and the resident bytes ``run()`` adds at its peak (the peak reset first,
#: /proc/self/clear_refs) with what it returned
_RESIDENT = """
def status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024

def added(run):
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = status("VmRSS")
    out = run()
    return status("VmHWM") - before, out
"""


#: under ``mpiexec -n 2``: for each layout a trainer, one iteration, then
#: (the resident peak reset before each, /proc/self/clear_refs) the save's
#: sections drained through the checkpoint writer's own loop into a group
#: that only reads each array (the scheme's bytes, no HDF5), then a real
#: save; each rank prints the resident bytes each added and its figure
_PROBE = """
import gc, json, os, sys
import numpy as np
from purine_mpi.job.checkpoint_file import _write_dict, save_checkpoint
from purine_mpi.job.config import load_job
from purine_mpi.parallel.schemes import scheme_of
from purine_mpi.tools.plan import save_bytes, train_save_metas
from purine_mpi.train.checkpoints import Checkpoints
from purine_mpi.train.trainer import Trainer

""" + _RESIDENT + """

class Reading:
    attrs = {}
    def __contains__(self, key):
        return False
    def create_group(self, name, **kw):
        return Reading()
    def create_dataset(self, name, data=None, **kw):
        np.asarray(data).sum()

out = sys.argv[1]
for path in sys.argv[2:]:
    job = load_job(path, (), None, check_files=False)
    name = os.path.basename(path)[:-5]
    t = Trainer(job, os.path.join(out, name), log=lambda m: None)
    try:
        t.step(0)
        t.train.drain()
        save_checkpoint(os.path.join(out, f"warm{t.world.rank}.h5"), {"x": np.ones(4)})
        figure = save_bytes(job, t.graphs, train_save_metas(job, t.graphs, t.world))
        def sections():
            params, solver = scheme_of(job).checkpoint_sections(
                t.graphs, t.ws, t.world, lambda: Checkpoints._held(t))
            for section, values in (("params", params), ("solver", solver)):
                if t.world.rank == 0:
                    _write_dict(Reading(), values, section)
                else:
                    for _ in values.items():
                        pass
        streamed, _ = added(sections)
        saved, _ = added(lambda: t.save(1, os.path.join(out, name, "probe.h5")))
        # a file a rank (mpiexec may cut the ranks' stdout lines into each other)
        with open(os.path.join(out, f"rows{t.world.rank}.jsonl"), "a") as f:
            f.write(json.dumps({"layout": name, "rank": t.world.rank, "figure": figure,
                                "streamed": streamed, "saved": saved}) + "\\n")
    finally:
        t.close()
        # the closed trainer's memory freed now (its readers' threads end at
        # close, its cycles are collected here): not by a collection during
        # the next layout's measured save, which would read as a save that
        # frees memory
        del t
        gc.collect()
"""


def _rows(out):
    """The probe's rows of every rank (``rows<rank>.jsonl``), read and removed."""
    rows = []
    for path in sorted(out.glob("rows*.jsonl")):
        rows += [json.loads(line) for line in path.read_text().splitlines()]
        path.unlink()
    return rows


@pytest.mark.mpi
@pytest.mark.slow
def test_the_figure_is_what_a_save_makes_resident(tmp_path):
    """One mpiexec of 2 ranks, each layout in turn (glibc's mmap threshold
    fixed at 128 KiB, PURINE_MMAP_THRESHOLD, so a freed buffer leaves the
    resident set and the next one is counted anew): the resident bytes the
    scheme's part of a save adds (its sections drained through the
    writer's loop) are the figure within 0.5 MiB on every rank; a real
    save adds at least the figure less 0.5 MiB (HDF5's own buffers come
    on top: not in the figure, docs/running.md). Then scheme sharded with
    stages and with tensor shards on 4 ranks (``FOUR``, streamed a
    parameter at a time): within 0.5 MiB too."""
    if MPIEXEC is None:
        pytest.skip("mpiexec not found")
    paths = [str(_config(tmp_path, name)) for name in LAYOUTS]
    env = dict(cli_env(), PURINE_MMAP_THRESHOLD=str(128 << 10))
    p = subprocess.run([MPIEXEC, "-n", "2", PYTHON, "-c", _PROBE, str(tmp_path), *paths],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = _rows(tmp_path)
    assert len(rows) == 2 * len(LAYOUTS), p.stdout
    print("\n".join(json.dumps(r) for r in rows))
    for r in rows:
        assert abs(r["streamed"] - r["figure"]) <= (512 << 10), r
        assert r["saved"] >= r["figure"] - (512 << 10), r
    assert {r["layout"]: r["figure"] for r in rows if r["rank"] == 0} == {
        "data": 0, "pipeline": 2 * W, "tensor": 4 * W + 2 * B, "sharded": 2 * (W + B)}
    # scheme sharded with stages (2 stages x 2 replicas) and with tensor
    # shards (2 replicas x 2 shards), 4 ranks: each parameter's pieces
    # streamed to rank 0 (before: every rank's part pickled and gathered at
    # once, rank 0 +189.6 MiB measured with stages)
    paths = [str(_four(tmp_path, name)) for name in FOUR]
    p = subprocess.run([MPIEXEC, "-n", "4", PYTHON, "-c", _PROBE, str(tmp_path), *paths],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = _rows(tmp_path)
    print("\n".join(json.dumps(r) for r in rows))
    assert len(rows) == 4 * len(FOUR)
    for r in rows:
        assert abs(r["streamed"] - r["figure"]) <= (512 << 10), r
        assert r["saved"] >= r["figure"] - (512 << 10), r
    assert {r["layout"]: r["figure"] for r in rows if r["rank"] == 0} == {
        "staged": 2 * W, "sharded_tensor": 7 * W}


def test_on_a_gpu_each_rank_copies_its_part_to_the_host(monkeypatch, host_build_dir):
    """On the (emulated) GPU a save's ``to_numpy`` copies each rank's
    weights and solver state to the host: data parallelism's figure on 1
    rank is the whole model state (3 fc layers' weights and biases and
    AdamW's two states of each: 3 x the weights)."""
    from tests.conftest import make_job
    from tests.emulated_gpu.helpers import emulated_gpu_env
    emulated_gpu_env(monkeypatch, host_build_dir)
    from purine_mpi.tools.plan import offline_footprint
    cfg = _deep_mlp(layers=2, width=64)
    cfg["device"] = 0
    fp = offline_footprint(make_job(cfg), 1, 0)
    weights = (2 * (64 * 64 + 64) + 10 * 64 + 10) * 4
    assert fp.save == 3 * weights
    assert fp.host_total == max(fp.loop_total, fp.save_total)


#: the whole net's parameters of ``_deep_mlp``: 8 fc layers and the 10-way output
P = 8 * (W + B) + 768 * 10 * 4 + 10 * 4


def test_the_start_up_load_row(tmp_path):
    """The start-up load (``Footprint.load``): the first fill of the
    largest parameter (a 768 x 768 weight drawn in float64, then cast to
    float32: 12 bytes an element, 3 W) on every rank; with ``--resume``
    this job's whole checkpoint besides (every parameter and its two AdamW
    states, read whole on each rank, a pipeline stage's too: 3 P) and the
    stage's optimizer state it sets (zeros untouched until then); with
    ``--init`` the file's /params when larger than the fill. Before the
    first iteration no op has run: ``load_total`` is the rows written by
    then (weights, data, kept blobs, buffers: ``STARTUP_ROWS``) plus the
    load; the host's need the largest total. Stage 1 of the pipeline holds
    half the model: a resume's whole checkpoint is its need, and a
    --host-memory between its iteration's total and that refuses the
    resume only."""
    from purine_mpi.runtime.footprint import STARTUP_ROWS
    from purine_mpi.job.checkpoint_file import save_checkpoint
    job = load_job(_config(tmp_path, "pipeline"), (), None, check_files=False)
    fresh, _ = offline_footprints(job, 2, [0, 1])
    resumed, _ = offline_footprints(job, 2, [0, 1], {"resume": True})
    # each stage's two AdamW states: fc0-3; fc4-7 and the output layer
    state = {0: 2 * 4 * (W + B), 1: 2 * (4 * (W + B) + 768 * 10 * 4 + 10 * 4)}
    for r in (0, 1):
        assert fresh[r].load == 3 * W
        fp = resumed[r]
        assert fp.host["optimizer_state"] == state[r]
        assert fp.load == 3 * P + state[r]
        assert fp.load_total == sum(fp.host.get(k, 0) for k in STARTUP_ROWS) + fp.load
        assert fp.host_total == max(fp.loop_total, fp.save_total, fp.load_total)
    one = resumed[1]
    assert one.host_total == one.load_total > one.loop_total
    limit = (fresh[1].host_total + one.load_total) // 2
    assert fresh[1].host_total < limit
    out, code = run_plan(job, 2, MemoryLimits(host=limit), as_json=True)
    assert json.loads(out)["ranks"][1]["host"]["startup_load"] == 3 * W
    out, code_resumed = run_plan(job, 2, MemoryLimits(host=limit), as_json=True,
                                 restore={"resume": True})
    ranks = {r["rank"]: r for r in json.loads(out)["ranks"]}
    assert ranks[1]["host"]["load_total"] == ranks[1]["host"]["total"] == one.load_total
    assert (code, code_resumed) == (0, 2)
    text, _ = run_plan(job, 2, MemoryLimits(host=1 << 40), restore={"resume": True})
    assert "start-up load" in text and "at start-up" in text
    # --init: the file's /params, read whole (here every parameter: P > 3 W)
    rng = np.random.default_rng(0)
    weights = {f"fc{i}/{k}": rng.standard_normal(s).astype(np.float32)
               for i in range(8) for k, s in (("weight", (768, 768)), ("bias", (768,)))}
    weights.update({"out/weight": np.zeros((10, 768), np.float32),
                    "out/bias": np.zeros(10, np.float32)})
    path = save_checkpoint(str(tmp_path / "w.h5"), weights)
    out = run_cli_here("plan", _config(tmp_path, "pipeline"), "--np", "2", "--init", path,
                       "--json")
    assert out.returncode == 0, out.stderr
    assert {r["host"]["startup_load"] for r in json.loads(out.stdout)["ranks"]} == {P}


#: in a fresh process (after h5py's first small write, as a run's first save
#: comes after its first files): a checkpoint of one 4096 x 2048 weight and
#: 300 of 64 x 64, each with two states; the resident bytes the save adds at
#: its peak, then those a load adds beyond the arrays it returns
_HDF5_BUFFERS = """
import sys, numpy as np
from purine_mpi.job.checkpoint_file import load_checkpoint, save_checkpoint

""" + _RESIDENT + """

out = sys.argv[1]
params = {"big/weight": np.ones((4096, 2048), np.float32)}
params.update({f"l{i}/weight": np.ones((64, 64), np.float32) for i in range(300)})
solver = {p: {"m": v + 1, "v": v + 2} for p, v in params.items()}
save_checkpoint(out + "/warm.h5", {"x": np.ones(4)})
saved, _ = added(lambda: save_checkpoint(out + "/ck.h5", params, solver))
loaded, ck = added(lambda: load_checkpoint(out + "/ck.h5"))
arrays = sum(a.nbytes for a in ck.params.values()) + sum(
    a.nbytes for s in ck.solver.values() for a in s.values())
print(saved, loaded - arrays)
"""


@pytest.mark.skipif(__import__("platform").libc_ver()[0] != "glibc", reason="glibc only")
def test_hdf5_holds_little_beyond_the_arrays(tmp_path):
    """HDF5's own buffers while a checkpoint is written or read
    (job/checkpoint_file.py: no chunk cache, a fixed 256 KiB metadata
    cache, arrays above 4 MiB written in slabs of rows) stay under 6 MiB on
    a process's first save and load (glibc's mmap threshold fixed, so a
    freed buffer leaves the resident set): measured 3.4-3.7 and 3.3-3.4
    MiB. Before, the save added 22.5 MiB (the chunk map of the 4096 x 2048
    array's 512 chunks, written whole, and the adaptive metadata cache of
    1,206 datasets; the load then reused what it left: 1.7)."""
    env = dict(cli_env(), PURINE_MMAP_THRESHOLD=str(128 << 10))
    p = subprocess.run([PYTHON, "-c", _HDF5_BUFFERS, str(tmp_path)], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    saved, loaded = (int(x) for x in p.stdout.split())
    assert saved < 6 << 20 and loaded < 6 << 20, (saved / 2**20, loaded / 2**20)


def test_train_refuses_a_resume_whose_start_up_does_not_fit(tmp_path):
    """One rank of the 8 fc layers (scheme data): a --host-memory between
    an iteration's need and a resume's start-up (the checkpoint read, 3 P,
    held while the optimizer state is set) trains from scratch, and
    refuses --resume before its first iteration, naming the start-up load
    (train's check counts the arrays of the file it read). Before, the
    check counted no load: the resume ran."""
    cfg = _config(tmp_path, "data")
    job = load_job(cfg, (), None, check_files=False)
    (fresh,) = offline_footprints(job, 1, [0])[0].values()
    (resumed,) = offline_footprints(job, 1, [0], {"resume": True})[0].values()
    assert fresh.host_total == fresh.loop_total < resumed.load_total
    limit = str((fresh.host_total + resumed.load_total) // 2)
    run = ["-m", "purine_mpi", "train", str(cfg), "--out", str(tmp_path / "run"),
           "--host-memory", limit]
    first = subprocess.run([PYTHON] + run + ["--iters", "1"], cwd=REPO, env=cli_env(),
                           capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    again = subprocess.run([PYTHON] + run + ["--iters", "2", "--resume", "auto"], cwd=REPO,
                           env=cli_env(), capture_output=True, text=True, timeout=300)
    assert again.returncode == 2, again.stdout + again.stderr
    assert "start-up load" in again.stderr and "iter 2" not in again.stdout


def test_the_check_adds_back_the_checkpoint_it_holds(tmp_path, monkeypatch):
    """train's check reads MemAvailable after --resume has read the
    checkpoint: the rank's own copy, counted in its need, is out of it
    already, so the rank's share is MemAvailable / K plus those bytes
    (without --host-memory). With MemAvailable a little above the need
    less the checkpoint, the resume passes (before: refused)."""
    import dataclasses
    from purine_mpi.base.errors import MemoryTooSmall
    from purine_mpi.job.checkpoint_file import Checkpoint
    from purine_mpi.parallel.rank_graphs import build_rank_graphs
    from purine_mpi.runtime.footprint import workspace_plans
    from purine_mpi.tools import plan
    from purine_mpi.tools.graph import _OfflineWorld
    job = load_job(_config(tmp_path, "data"), (), None, check_files=False)
    job = job.replace(parallel=dataclasses.replace(job.parallel, check_collectives=False))
    graphs = build_rank_graphs(job, _OfflineWorld(0, 1), check_memory=False)
    plans = workspace_plans(graphs, job.memory_plan)
    ck = Checkpoint("ck.h5", params={"w": np.zeros(3 * P // 4, np.uint8)},
                    solver={"w": {"m": np.zeros(3 * P // 4, np.uint8)}})
    (fp,) = offline_footprints(job, 1, [0], {"resume": True})[0].values()
    held = plan.arrays_nbytes(ck)
    need = fp.host_total - 3 * P + held  # this checkpoint in the place of the job's own
    monkeypatch.setattr("purine_mpi.base.threads.ranks_on_this_host", lambda: (1, None))
    monkeypatch.setattr(plan, "mem_available", lambda: need - held + (1 << 20))
    plan.check_memory(job, graphs, plans, _OfflineWorld(0, 1), plan.MemoryLimits(),
                      resume=ck)
    monkeypatch.setattr(plan, "mem_available", lambda: need - held - (1 << 20))
    with pytest.raises(MemoryTooSmall, match="it holds already"):
        plan.check_memory(job, graphs, plans, _OfflineWorld(0, 1), plan.MemoryLimits(),
                          resume=ck)

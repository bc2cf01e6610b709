"""Hybrid data x pipeline parallelism (``scheme: hybrid``): R replicas x p
stages on R·p ranks (rank = replica·p + stage) train like one rank on the
same global batch (float32 tolerance: the summation order differs), resume
bit-exact on the same layout, resume by name on another layout; the stage
groups' collectives are checked per sub-communicator; ``graph --np N --rank R``
shows every slice; bad layouts exit 2 naming the key."""
import json
import shutil

import h5py
import numpy as np
import pytest

from purine_mpi.comm.verify import comm_signature, compare_signatures
from purine_mpi.tools.graph import compose_for
from purine_mpi.job.config import resolve_config
from tests.conftest import (make_job, run_cli_args, run_cli_here, run_mpi_cli, train_here,
                            write_config_file)
from tests.test_micro_batches import STAGES, _close, _config, _params


def _hybrid(**extra):
    return _config(scheme="hybrid", stages=dict(STAGES), **extra)


def _all_params(path):
    with h5py.File(path, "r") as f:
        out = {}
        f.visititems(lambda name, obj: out.__setitem__(name, obj[()])
                     if isinstance(obj, h5py.Dataset) and not name.startswith("state")
                     else None)
        return out


# ------------------------------------------------------------ composition
def test_hybrid_slices_layout_and_data_windows():
    """4 ranks = 2 replicas x 2 stages: each rank holds its stage's layers,
    talks to its replica's other stage, allreduces with the other replica's
    same stage, and replica r's micro-batch k reads shard r·M + k of R·M."""
    cfg = resolve_config(_hybrid(micro_batches=2))
    slices = [compose_for(make_job(cfg), 4, r) for r in range(4)]
    for rank, g in enumerate(slices):
        replica, stage = divmod(rank, 2)
        types = {op.op_type for op in g.ops.values()}
        assert ("Conv" in types) == (stage == 0)
        assert ("SoftmaxLoss" in types) == (stage == 1)
        peers = {int(op.attrs["peer"]) for op in g.ops.values()
                 if op.op_type in ("Send", "Recv", "Put", "WaitWrite")}
        assert peers == {replica * 2 + (1 - stage)}
        groups = {tuple(op.attrs["group"]) for op in g.ops.values()
                  if op.op_type == "Allreduce"}
        assert groups == {(stage, 2 + stage)}
        readers = sorted((int(op.attrs["rank"]), int(op.attrs["world_size"]))
                         for op in g.ops.values() if op.op_type == "DataReader")
        assert readers == ([(replica * 2, 4), (replica * 2 + 1, 4)] if stage == 0 else [])
        assert all(op.location.rank == rank for op in g.ops.values())
        # the update scales the summed gradient by 1 / (M · R) once
        scales = {op.attrs["grad_scale"] for op in g.ops.values()
                  if op.op_type == "SGDUpdate"}
        assert scales == {0.25}
    sigs = [comm_signature(g) for g in slices]
    assert compare_signatures(sigs) == []
    # the stages' buckets differ, yet each group agrees within itself
    assert [e["count"] for e in sigs[0] if e["kind"] == "Allreduce"] != \
        [e["count"] for e in sigs[1] if e["kind"] == "Allreduce"]


def test_check_collectives_per_group():
    """A mismatch inside a stage group is found and named with the group;
    collectives of different groups are never compared with each other."""
    cfg = resolve_config(_hybrid())
    slices = [compose_for(make_job(cfg), 4, r) for r in range(4)]
    sigs = [comm_signature(g) for g in slices]
    bad = [list(s) for s in sigs]
    i = next(k for k, e in enumerate(bad[3]) if e["kind"] == "Allreduce")
    bad[3][i] = dict(bad[3][i], count=bad[3][i]["count"] + 1)
    problems = compare_signatures(bad)
    assert problems and "among ranks [1, 3]" in problems[0] and "rank 3 posts" in problems[0]
    # a rank that skips a group's collective
    missing = [list(s) for s in sigs]
    missing[2] = [e for e in missing[2] if e["kind"] != "Allreduce"]
    problems = compare_signatures(missing)
    assert problems and "among ranks [0, 2]" in problems[0] and "nothing" in problems[0]


def test_graph_cli_shows_every_hybrid_slice(tmp_path):
    cfg = write_config_file(tmp_path, _hybrid(micro_batches=2))
    for rank in range(4):
        replica, stage = divmod(rank, 2)
        res = run_cli_here("graph", cfg, "--np", "4", "--rank", str(rank))
        assert res.returncode == 0, res.stderr
        out = res.stdout
        assert f"rank {rank} = replica {replica}, stage {stage}" in out
        assert f"allreduced over ranks [{stage}, {2 + stage}]" in out
        assert ("conv1.fwd@mb1" in out) == (stage == 0) and ("fc1.fwd@mb1" in out) == (stage == 1)
        assert f"put@r{replica * 2 + 1 - stage}" in out  # transport auto, one node
        assert "bucket plan:" in out and f"over ranks [{stage}, {2 + stage}]" in out
    # the test phase is cut the same way (replica 1 of 2 reads its test shard)
    data = _hybrid()
    data["data"]["test"] = dict(data["data"]["train"])
    data["net"].append({"type": "accuracy", "name": "accuracy", "bottom": ["fc2", "label"],
                        "top": "accuracy", "phase": "test"})
    data["parallel"]["stages"]["accuracy"] = 1
    cfg = write_config_file(tmp_path, data, "test.yaml")
    for rank in (2, 3):
        res = run_cli_here("graph", cfg, "--np", "4", "--rank", str(rank), "--phase", "test")
        assert res.returncode == 0, res.stderr
        assert f"rank {rank} = replica 1, stage {rank - 2}" in res.stdout
        assert ("Accuracy" in res.stdout) == (rank == 3)
        assert (" WaitWrite " in res.stdout) == (rank == 3) and \
            (" Put " in res.stdout) == (rank == 2)


def test_graph_cli_shows_pipeline_and_micro_batch_slices(tmp_path):
    """``graph --np N --rank R`` for the other schemes with micro-batches: a
    pipeline's stage (layout line, its copies only) and a data-parallel
    rank's micro-batch readers (shards r·M + k of N·M)."""
    pipe = write_config_file(tmp_path, _config(scheme="pipeline", stages=dict(STAGES),
                                               micro_batches=4, schedule="gpipe"), "p.yaml")
    res = run_cli_here("graph", pipe, "--np", "2", "--rank", "1")
    assert res.returncode == 0, res.stderr
    assert "layout [pipeline: 1 replica x 2 stages, 4 micro-batches, 2 ranks]" in res.stdout
    assert "fc1.fwd@mb3" in res.stdout and "conv1.fwd" not in res.stdout
    assert "Allreduce" not in res.stdout
    data = resolve_config(_config(scheme="data", micro_batches=2))
    g = compose_for(make_job(data), 2, 1)
    readers = sorted((op.attrs["rank"], op.attrs["world_size"]) for op in g.ops.values()
                     if op.op_type == "DataReader")
    assert readers == [(2, 4), (3, 4)]
    cfg = write_config_file(tmp_path, _config(scheme="data", micro_batches=2), "d.yaml")
    res = run_cli_here("graph", cfg, "--np", "2", "--rank", "1")
    assert res.returncode == 0 and "data@mb1" in res.stdout and "bucket plan:" in res.stdout
    assert not res.stdout.startswith("layout")


@pytest.mark.parametrize("parallel,np_,key,words", [
    ({"scheme": "hybrid", "stages": STAGES}, 3, "parallel.stages", "not a multiple"),
    ({"scheme": "hybrid", "stages": STAGES}, 5, "parallel.stages", "not a multiple"),
    ({"scheme": "hybrid", "stages": {k: 0 for k in STAGES}}, 2, "parallel.stages",
     "at least 2 stages"),
    ({"scheme": "hybrid", "stages": dict(STAGES, loss=3)}, 4, "parallel.stages",
     "stage(s) 2 have no layers"),
    ({"scheme": "hybrid", "stages": {k: v for k, v in STAGES.items() if k != "relu3"}}, 4,
     "parallel.stages", "relu3"),
    ({"scheme": "hybrid", "stages": STAGES, "micro_batches": 3}, 4, "parallel.micro_batches",
     "batch_size 8"),
    ({"scheme": "hybrid", "stages": STAGES, "mode": "async"}, 4, "parallel.mode", "sync"),
])
def test_bad_hybrid_config_exits_2(tmp_path, parallel, np_, key, words):
    cfg = write_config_file(tmp_path, _config(**parallel))
    res = run_cli_here("graph", cfg, "--np", str(np_))
    assert res.returncode == 2, res.stderr
    assert f"'{key}'" in res.stderr and words in res.stderr and "Traceback" not in res.stderr
    assert "cfg.yaml" in res.stderr


# --------------------------------------------------------------- training
@pytest.fixture(scope="module")
def hybrid_runs(tmp_path_factory):
    """The runs both training tests start from, made once: the one-rank
    job of batch 16 trained to the end (``one``), and the 2 x 2 hybrid job
    (2 micro-batches, its collectives checked) stopped at iteration 3
    (``half3``, copied by each test before it resumes)."""
    d = tmp_path_factory.mktemp("hybrid")
    cfg1 = _config(scheme="data")
    cfg1["data"]["train"]["batch_size"] = 16
    one = write_config_file(d, cfg1, "one.yaml")
    many = write_config_file(d, _hybrid(micro_batches=2, check_collectives=True), "many.yaml")
    train_here(one, d / "one")  # in this process (conftest.train_here)
    half = run_mpi_cli(4, "train", many, "--out", d / "half3", "--iters", "3")
    assert half.returncode == 0, half.stderr
    return {"one_cfg": one, "many_cfg": many, "one": d / "one", "half3": d / "half3"}


@pytest.mark.mpi
def test_hybrid_2x2_matches_one_rank_and_resumes_bit_exact(hybrid_runs, tmp_path):
    """2 replicas x 2 stages x batch 8 (2 micro-batches) on 4 ranks == 1 rank
    x batch 16; a run stopped at iteration 3 and resumed on the same layout
    ends bit-identical to the uninterrupted one."""
    many = hybrid_runs["many_cfg"]
    r4 = run_mpi_cli(4, "train", many, "--out", tmp_path / "many")
    assert r4.returncode == 0, r4.stderr
    _close(_params(hybrid_runs["one"] / "latest.h5"), _params(tmp_path / "many" / "latest.h5"))
    # the logged losses agree too (summed over stages, averaged over replicas)
    log1 = [json.loads(x) for x in open(hybrid_runs["one"] / "metrics.jsonl")]
    log4 = [json.loads(x) for x in open(tmp_path / "many" / "metrics.jsonl")]
    assert [x["iter"] for x in log1] == [x["iter"] for x in log4]
    np.testing.assert_allclose([x["loss"] for x in log1], [x["loss"] for x in log4], rtol=1e-5)
    # resume on the same layout: 3 iterations, then 3 more from the checkpoint
    shutil.copytree(hybrid_runs["half3"], tmp_path / "half", symlinks=True)
    rest = run_mpi_cli(4, "train", many, "--out", tmp_path / "half", "--resume", "auto")
    assert rest.returncode == 0, rest.stderr
    a = _all_params(tmp_path / "many" / "latest.h5")
    b = _all_params(tmp_path / "half" / "latest.h5")
    assert sorted(a) == sorted(b) and len(a) == 12
    for name in a:
        assert np.array_equal(a[name], b[name]), name


@pytest.mark.mpi
def test_hybrid_checkpoint_resumes_on_one_rank(hybrid_runs, tmp_path):
    """Another layout: a 2 x 2 hybrid checkpoint (iteration 3) continued on
    one rank with the same global batch loads every stage's weights and
    momenta by name, keeps the data position, says so, and ends where an
    uninterrupted one-rank run ends (float32 tolerance)."""
    shutil.copytree(hybrid_runs["half3"], tmp_path / "half", symlinks=True)
    rest = run_cli_args("train", hybrid_runs["one_cfg"], "--out", tmp_path / "half",
                        "--resume", "auto")
    assert rest.returncode == 0, rest.stderr
    assert ("resuming a 4-rank checkpoint on 1 rank(s), layout [hybrid: 2 replicas x 2 "
            "stages, 2 micro-batches, 4 ranks] -> [data: 1 replica, 1 rank]") in rest.stdout
    _close(_params(hybrid_runs["one"] / "latest.h5"), _params(tmp_path / "half" / "latest.h5"))

"""Small consistencies a user notices (issue: 'At home on a real cluster', 7)."""
import re
import shutil

import pytest

from tests.conftest import run_cli_args, run_cli_here


def test_a_graph_yaml_job_reports_its_own_lr_and_speed(tmp_path, digits_h5):
    """A config written by ``graph --format yaml`` carries its solver: the
    start-up block's base_lr is the lr the iterations use, and the speed is
    counted from the graph's data readers (it has no data: section)."""
    sets = ["--set", f"data.train.path={digits_h5}", "--set", f"data.test.path={digits_h5}"]
    res = run_cli_here("graph", "jobs/digits_lenet.yaml", "--format", "yaml", *sets)
    assert res.returncode == 0, res.stderr
    job = tmp_path / "g.yaml"
    job.write_text(res.stdout)
    run = run_cli_args("train", job, "--out", tmp_path / "run", "--iters", "40")
    assert run.returncode == 0, run.stderr
    base = re.search(r"solver +\w+, base_lr ([\d.e-]+)", run.stdout)
    lrs = re.findall(r"  lr ([\d.e-]+)  ([\d,]+) img/s", run.stdout)
    assert base and lrs, run.stdout
    assert all(float(lr) == float(base.group(1)) for lr, _ in lrs)  # lr_policy step, stepsize > 40
    assert all(int(ips.replace(",", "")) > 0 for _, ips in lrs)


def _fc_on_digits(name, seed, digits_h5, solver, shuffle=False, **sections):
    """A config of one fc layer and its loss on the digits' train split
    (batch 16, no checkpoints): the graph-printing tests' job; ``sections``
    are further top-level sections (``parallel``)."""
    train = {"source": "hdf5", "path": digits_h5, "split": "train", "batch_size": 16}
    if shuffle:
        train["shuffle"] = True
    return {"name": name, "seed": seed, "data": {"train": train},
            "net": [{"type": "fc", "name": "fc", "bottom": "data", "top": "fc",
                     "num_output": 10},
                    {"type": "softmax_loss", "name": "loss", "bottom": ["fc", "label"],
                     "top": "loss"}],
            "solver": solver, **sections, "checkpoint": {"interval": 0}}


def _digits_sets(digits_h5):
    return ["--set", f"data.train.path={digits_h5}", "--set", f"data.test.path={digits_h5}"]


@pytest.fixture(scope="module")
def lenet_run(digits_h5, tmp_path_factory):
    """jobs/digits_lenet.yaml trained 30 iterations on one rank: its folder
    (read only by the tests; a test that resumes copies it) and stdout."""
    out = tmp_path_factory.mktemp("consistency") / "run"
    run = run_cli_args("train", "jobs/digits_lenet.yaml", "--out", out,
                       "--iters", "30", *_digits_sets(digits_h5))
    assert run.returncode == 0, run.stderr
    return out, run.stdout


def test_test_takes_a_run_folder_and_prints_figures_as_train_does(lenet_run, tmp_path,
                                                                  digits_h5):
    import json
    out, stdout = lenet_run
    final = json.loads(stdout.split("final ", 1)[1].splitlines()[0])
    res = run_cli_args("test", "jobs/digits_lenet.yaml", "--weights", out,
                       *_digits_sets(digits_h5))
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got == final  # the same figures, rounded the same way
    empty = tmp_path / "empty"
    empty.mkdir()
    bad = run_cli_here("test", "jobs/digits_lenet.yaml", "--weights", empty,
                       *_digits_sets(digits_h5))
    assert bad.returncode == 2 and "without latest.h5" in bad.stderr


def test_init_says_what_it_loaded_and_a_shape_mismatch_suggests_init_skip(lenet_run, tmp_path,
                                                                          digits_h5):
    weights = lenet_run[0] / "latest.h5"
    res = run_cli_args("train", "jobs/digits_lenet.yaml", "--out", tmp_path / "ft", "--iters",
                       "5", "--init", weights, *_digits_sets(digits_h5))
    assert res.returncode == 0 and re.search(r"loaded \d+ blobs from .*latest\.h5", res.stdout)
    wider = run_cli_args("train", "jobs/digits_lenet.yaml", "--out", tmp_path / "ft2",
                         "--iters", "5", "--init", weights,
                         "--set", "net.0.num_output=24", *_digits_sets(digits_h5))
    assert wider.returncode == 2 and "--init-skip conv1" in wider.stderr, wider.stderr


def test_a_resume_on_another_rank_count_says_the_global_batch(lenet_run, tmp_path, digits_h5):
    from tests.conftest import run_mpi_cli
    shutil.copytree(lenet_run[0], tmp_path / "run", symlinks=True)   # 1 rank, iteration 30
    res = run_mpi_cli(2, "train", "jobs/digits_lenet.yaml", "--out", tmp_path / "run",
                      "--iters", "40", "--resume", "auto", *_digits_sets(digits_h5))
    assert res.returncode == 0, res.stderr
    assert ("was written by 1 rank(s) with a global batch of 32, this run has 2: the global "
            "batch is now 64" in res.stdout), res.stdout
    assert "--set data.train.batch_size=16)" in res.stdout, res.stdout


def test_a_resume_says_a_changed_global_batch_and_only_a_changed_one(lenet_run, tmp_path,
                                                                      digits_h5):
    """The note compared the numbers of ranks, not the global batches: a
    1-rank checkpoint (batch 32) resumed on 2 ranks with ``batch_size=16``,
    as the note itself advised, was told 'the global batch is now 32 ...
    keep the global batch with --set data.train.batch_size=G/N', and one
    resumed on the same rank with another batch_size (a changed global
    batch, the schedule's iterations now other samples) was told nothing."""
    from tests.conftest import run_mpi_cli
    kept = run_mpi_cli(2, "train", "jobs/digits_lenet.yaml", "--out", tmp_path / "kept",
                       "--iters", "32", "--resume", lenet_run[0] / "latest.h5",
                       "--set", "data.train.batch_size=16", *_digits_sets(digits_h5))
    assert kept.returncode == 0, kept.stderr
    assert "resumed from" in kept.stdout and "global batch is now" not in kept.stdout, kept.stdout
    halved = run_cli_args("train", "jobs/digits_lenet.yaml", "--out", tmp_path / "halved",
                          "--iters", "32", "--resume", lenet_run[0] / "latest.h5",
                          "--set", "data.train.batch_size=16", *_digits_sets(digits_h5))
    assert halved.returncode == 0, halved.stderr
    assert ("was written by 1 rank(s) with a global batch of 32, this run has 1: the global "
            "batch is now 16 (16 per rank x 1)" in halved.stdout), halved.stdout
    assert "--set data.train.batch_size=32)" in halved.stdout, halved.stdout


def test_a_complete_graph_s_solver_section_is_its_ops(tmp_path, digits_h5):
    """A complete ``graph:`` (``graph --format yaml``) runs its own
    LearningRate and update ops. ``--iters 20`` on one dumped at a cosine
    ``max_iter`` of 10 trained iterations 10-19 at rate 0, and ``--set
    solver.base_lr=0.5`` had the start-up block say 0.5 while the op
    trained at 0.1, both exit 0. Now a solver key the config gives that an
    op reads must equal the op's attr (exit 2 naming both and the op's key),
    a key it leaves out is the op's (the start-up block says what runs), and
    with the op's key set too the rows are the closed form over 20."""
    import json
    import numpy as np
    import yaml
    from purine_mpi.ops.lr_policy import learning_rate
    from tests.conftest import train_here, write_config_file
    cfg = _fc_on_digits("cos", 1, digits_h5, {"base_lr": 0.1, "lr_policy": "cosine",
                                               "max_iter": 10, "display": 2, "momentum": 0.9})
    res = run_cli_here("graph", write_config_file(tmp_path, cfg, "net.yaml"), "--format", "yaml")
    assert res.returncode == 0, res.stderr
    dumped = yaml.safe_load(res.stdout)
    lr = next(i for i, e in enumerate(dumped["graph"]) if e.get("op_type") == "LearningRate")
    job = write_config_file(tmp_path, dumped, "g.yaml")
    for args, key in ((["--iters", "20"], "max_iter"), (["--set", "solver.base_lr=0.5"], "base_lr"),
                      (["--set", "solver.momentum=0.5"], "momentum")):
        res = run_cli_here("train", job, "--out", tmp_path / "x", *args)
        assert res.returncode == 2, (args, res.stdout, res.stderr)
        assert f"key 'solver.{key}'" in res.stderr and "is not the" in res.stderr, res.stderr
        if key != "momentum":
            assert f"graph.{lr}.attrs.{key}" in res.stderr, res.stderr
    # the loop's keys alone: the start-up block names the op's rate, not the defaults
    loop_only = dict(dumped, solver={"display": 2})
    res = run_cli_args("train", write_config_file(tmp_path, loop_only, "loop.yaml"),
                       "--out", tmp_path / "loop")
    assert res.returncode == 0, res.stderr
    assert re.search(r"solver +sgd, base_lr 0.1, lr_policy cosine; iterations 0 -> 10",
                     res.stdout), res.stdout
    # both set: the schedule over 20, each row the closed form of its last iteration
    from purine_mpi.job.config import load_job
    out = train_here(load_job(job, overrides=[f"graph.{lr}.attrs.max_iter=20"], iters=20),
                     tmp_path / "run")
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    lrs = [(r["iter"], r["lr"]) for r in rows if r["phase"] == "train"]
    attrs = dict(dumped["graph"][lr]["attrs"], max_iter=20)
    assert [it for it, _ in lrs] == list(range(2, 21, 2))
    for it, value in lrs:
        assert np.float32(value) == np.float32(learning_rate(attrs, it - 1)), (it, value)
    assert lrs[-1][1] > 0


@pytest.mark.parametrize("extra", [{}, {"micro_batches": 2, "clip_gradients": 0.05}],
                         ids=["plain", "micro_batches_clip"])
def test_a_dumped_graph_trains_as_its_config(tmp_path, digits_h5, extra):
    """``graph --format yaml`` wrote the name, the solver and the graph but
    not the seed, which draws the initial weights: the printed graph trained
    from other weights than its config (seed 1: after 3 iterations fc/weight
    up to 0.41 apart, relative L2 difference 1.39). With 2 micro-batches
    its two data readers (rows [0, 8) and [8, 16) of the batch, shards 0
    and 1 of 2) were both set to the replica's shard, so both read the
    same 8 rows (fc/bias 0.35 off, relative L2); with clip_gradients the
    graph's clip ops were made again ('blob clip.sumsq is defined twice',
    exit 2). Now the seed is written, a reader keeps its shard within the
    replica and a graph's own clip ops stand for clip_gradients: bitwise
    the same."""
    import h5py
    import numpy as np
    import yaml
    from tests.conftest import train_here, write_config_file
    cfg = _fc_on_digits("fx", 1, digits_h5, {"base_lr": 0.1, "momentum": 0.9, "max_iter": 3,
                                             "display": 1}, shuffle=True,
                        parallel={"micro_batches": extra.get("micro_batches", 1)})
    if "clip_gradients" in extra:
        cfg["solver"]["clip_gradients"] = extra["clip_gradients"]
    res = run_cli_here("graph", write_config_file(tmp_path, cfg, "net.yaml"), "--format", "yaml")
    assert res.returncode == 0, res.stderr
    dumped = yaml.safe_load(res.stdout)
    assert dumped["seed"] == 1
    # plan's header names the batch its data ops read (it said 'batch None per rank')
    res = run_cli_here("plan", write_config_file(tmp_path, dumped, "g.yaml"))
    assert res.returncode == 0 and ", batch 16 per rank;" in res.stdout, res.stdout + res.stderr
    weights = []
    for name, config in (("net", cfg), ("graph", dumped)):
        out = train_here(write_config_file(tmp_path, config, f"{name}.yaml"), tmp_path / name)
        with h5py.File(out / "latest.h5", "r") as f:
            weights.append({k: f["params/fc"][k][()] for k in ("weight", "bias")})
    for k in ("weight", "bias"):
        assert np.array_equal(weights[0][k], weights[1][k]), \
            (k, float(np.abs(weights[0][k] - weights[1][k]).max()))


@pytest.mark.mpi
def test_a_dumped_graph_that_clips_trains_as_its_config_on_2_ranks(tmp_path, digits_h5):
    """The clip ops a dumped graph carries clipped each rank's own gradients
    before the allreduce (after 3 iterations on 2 ranks fc/weight 0.0033
    off the config's run, which clips the reduced ones); they are now taken
    out and stand for ``solver.clip_gradients``, which the composition
    applies after the reduction: bitwise the config's 2-rank run."""
    import h5py
    import numpy as np
    import yaml
    from tests.conftest import run_mpi_cli, write_config_file
    cfg = _fc_on_digits("c2", 4, digits_h5, {"base_lr": 0.5, "momentum": 0.9, "max_iter": 3,
                                             "display": 1, "clip_gradients": 0.05},
                        shuffle=True, parallel={"micro_batches": 2})
    res = run_cli_here("graph", write_config_file(tmp_path, cfg, "net.yaml"), "--format", "yaml")
    assert res.returncode == 0, res.stderr
    assert "ClipScale" in res.stdout
    write_config_file(tmp_path, yaml.safe_load(res.stdout), "graph.yaml")
    weights = []
    for name in ("net", "graph"):
        run = run_mpi_cli(2, "train", tmp_path / f"{name}.yaml", "--out", tmp_path / name)
        assert run.returncode == 0, run.stdout + run.stderr
        with h5py.File(tmp_path / name / "latest.h5", "r") as f:
            weights.append({k: f["params/fc"][k][()] for k in ("weight", "bias")})
    for k in ("weight", "bias"):
        assert np.array_equal(weights[0][k], weights[1][k]), \
            (k, float(np.abs(weights[0][k] - weights[1][k]).max()))


@pytest.mark.parametrize("micro", [1, 2])
def test_a_rank_slice_s_data_readers_take_the_loading_job_s_shards(tmp_path, digits_h5, micro):
    """A graph printed for rank 1 of 2 (``graph --np 2 --rank 1 --format
    yaml``) carries its readers' shards of that composition (rank 1 of 2;
    with 2 micro-batches 2 and 3 of 4). Trained as a ``graph:`` config,
    each reader takes the loading job's shard and keeps its micro-batch
    copy's place within it (``micro_batch`` of ``micro_batches``): on 1
    rank shard k of M, on rank r of 2 shard r·M + k of 2·M. Read from the
    printed rank and world size, the 1-rank run read shard 1 of 2 (half
    the data: rows 8..15 of each 16) and rank r of 2 shard 2r + 1 of 4."""
    import yaml
    from purine_mpi.job.replica import graph_from_seed
    from tests.conftest import make_job, write_config_file
    cfg = _fc_on_digits("sl", 1, digits_h5, {"base_lr": 0.1, "max_iter": 3},
                        parallel={"micro_batches": micro})
    res = run_cli_here("graph", write_config_file(tmp_path, cfg, "net.yaml"), "--format", "yaml",
                       "--np", "2", "--rank", "1")
    assert res.returncode == 0, res.stderr
    dumped = yaml.safe_load(res.stdout)
    printed = sorted((e["attrs"]["rank"], e["attrs"]["world_size"]) for e in dumped["graph"]
                     if e.get("op_type") == "DataReader")
    assert printed == ([(1, 2)] if micro == 1 else [(2, 4), (3, 4)])
    job = make_job(dumped)
    for rank, world in ((0, 1), (0, 2), (1, 2)):
        g, _ = graph_from_seed(job, rank, world)
        got = sorted((op.attrs["rank"], op.attrs["world_size"]) for op in g.ops.values()
                     if op.op_type == "DataReader")
        assert got == [(rank * micro + k, world * micro) for k in range(micro)], (rank, world)

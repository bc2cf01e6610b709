"""A trust audit of the multi-rank and resume paths (session 64).

(a) A test pass whose forward overflows on one rank's shard of the test
split (finite weights, a finite sample of 3e38 that doubles to inf, an fc
of mixed-sign weights making it NaN): the world's sum of the figures is
NaN. Before, ``train`` printed ``test @ iter 4: loss nan  accuracy 0.3750``,
kept ``best_4.h5`` for that accuracy (counted from the same overflowed
scores), printed ``final {"loss": null, "accuracy": 0.375}`` and exited 0,
where ``test`` of the same weights exits 3 (and, before session 64's
review, printed that accuracy beside the null loss: now all null, below).
Now no figure of such a pass is shown (its row holds nulls), kept as the
best or counted as an improvement, and a run that ends on one exits 3 on every
rank, its log's last line saying why.

(b) ``--resume`` of a checkpoint of iteration 20 with ``--iters 10`` into
another folder (one without the run's latest.h5) ran the end's test pass as
``test @ iter 10`` and wrote ``ckpt_10.h5`` with ``iteration = 10`` holding
the weights (and data position) of iteration 20: a file that lies about its
iteration, which a later ``--resume auto --iters 30`` trains on as 10 more
iterations than were done. Past max_iter there is now nothing to do in any
folder (``already finished at iteration 20: nothing to do``), as in the
run's own folder.

(c) A resume with another seed is said (below).
"""
import json

import h5py
import numpy as np
import pytest

from tests.conftest import (run_cli_args, run_mpi_cli, small_net_config,
                            write_config_file)


def _outlier_h5(path):
    """8 train samples of small values; 8 test samples, the last 3e38 (finite:
    the data check passes it)."""
    rng = np.random.default_rng(0)
    with h5py.File(path, "w") as f:
        f.create_dataset("train/data", data=rng.standard_normal((8, 1, 2, 2)).astype(np.float32))
        f.create_dataset("train/label", data=np.arange(8) % 2)
        test = rng.standard_normal((8, 1, 2, 2)).astype(np.float32)
        test[7] = 3e38
        f.create_dataset("test/data", data=test)
        f.create_dataset("test/label", data=np.arange(8) % 2)


def _overflow_config(data):
    return {"name": "overflow", "seed": 1,
            "data": {"train": {"source": "hdf5", "path": str(data), "split": "train",
                               "batch_size": 2},
                     "test": {"source": "hdf5", "path": str(data), "split": "test",
                              "batch_size": 2}},
            "net": [{"type": "eltwise", "name": "twice", "bottom": ["data", "data"],
                     "top": "x"},
                    {"type": "fc", "name": "fc", "bottom": "x", "top": "fc", "num_output": 2},
                    {"type": "softmax_loss", "name": "loss", "bottom": ["fc", "label"],
                     "top": "loss"},
                    {"type": "accuracy", "name": "accuracy", "bottom": ["fc", "label"],
                     "top": "accuracy", "phase": "test"}],
            "solver": {"base_lr": 0.01, "max_iter": 4, "test_interval": 0, "display": 0},
            "checkpoint": {"interval": 0, "best": {"metric": "accuracy"}}}


@pytest.mark.mpi
def test_an_overflowed_test_pass_on_one_rank_is_no_result(tmp_path):
    data = tmp_path / "d.h5"
    _outlier_h5(data)
    job = write_config_file(tmp_path, _overflow_config(data))
    out = tmp_path / "run"
    res = run_mpi_cli(2, "train", job, "--out", out)
    assert res.returncode == 3, (res.returncode, res.stdout, res.stderr)
    assert "test @ iter 4: non-finite loss" in res.stdout, res.stdout
    assert "error: the test pass at iteration 4 gave non-finite figures" in res.stderr, \
        res.stderr
    assert res.stderr.count("error:") == 1, res.stderr  # one line, rank 0's
    assert not list(out.glob("best_*.h5")), sorted(p.name for p in out.iterdir())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    test_rows = [r for r in rows if r["phase"] == "test"]
    assert test_rows and all(r.get("accuracy") is None and r.get("loss") is None
                             for r in test_rows), test_rows
    last = (out / "train.log").read_text().rstrip().splitlines()[-1]
    assert last == "run ended: non-finite test figures at iteration 4 (exit 3)", last
    assert (out / "latest.h5").exists()  # the finite weights the pass ran on are kept


def test_test_of_weights_whose_pass_overflows_shows_no_figure_as_train_does(tmp_path):
    """``test`` of finite weights whose pass overflows (the data of (a), on
    one rank: the whole split) follows train's rule: no figure of the pass
    is a result. Before, it printed ``{"loss": null, "accuracy": 0.375}``,
    the accuracy counted from the same overflowed scores that train's row
    and final line (all null) refuse."""
    data = tmp_path / "d.h5"
    _outlier_h5(data)
    job = write_config_file(tmp_path, _overflow_config(data))
    out = tmp_path / "run"
    trained = run_cli_args("train", job, "--out", out)
    assert trained.returncode == 3, trained.stderr   # the end's pass overflowed
    final = json.loads(trained.stdout.split("final ", 1)[1].splitlines()[0])
    assert final == {"loss": None, "accuracy": None, "samples": 8}, final
    res = run_cli_args("test", job, "--weights", out / "latest.h5")
    assert res.returncode == 3, (res.stdout, res.stderr)
    assert json.loads(res.stdout) == final, res.stdout
    assert "gave a non-finite loss (NaN or inf): no figure of the pass is a result" in \
        res.stderr, res.stderr


@pytest.fixture(scope="module")
def run20(digits_h5, tmp_path_factory):
    """(config, folder) of the tiny net trained 20 iterations on one rank
    (read only: the tests resume it into folders of their own)."""
    base = tmp_path_factory.mktemp("run20")
    cfg = write_config_file(base, small_net_config(digits_h5))
    first = run_cli_args("train", cfg, "--out", base / "a", "--iters", "20")
    assert first.returncode == 0, first.stderr
    return cfg, base / "a"


def test_a_resume_past_max_iter_writes_no_checkpoint_labelled_max_iter(tmp_path, run20):
    cfg, run = run20
    out = tmp_path / "b"
    past = run_cli_args("train", cfg, "--out", out, "--resume", run / "latest.h5",
                        "--iters", "10")
    assert past.returncode == 0, past.stderr
    assert past.stdout.splitlines()[-1] == ("already finished at iteration 20: nothing to do "
                                            "(past solver.max_iter 10)"), past.stdout
    assert not list(out.glob("*.h5")), sorted(p.name for p in out.iterdir())
    assert "test @ iter" not in past.stdout, past.stdout


def test_a_resume_with_another_seed_says_the_epoch_goes_on_in_another_order(tmp_path, run20):
    """(c) The epoch order is a permutation keyed by (seed, epoch): a resume
    with another --seed went on through the epoch under way in another
    permutation (samples read twice, others skipped) without a word."""
    cfg, run = run20
    res = run_cli_args("train", cfg, "--out", tmp_path / "c", "--resume", run / "latest.h5",
                       "--iters", "21", "--seed", "9")
    assert res.returncode == 0, res.stderr
    assert "was written by a run of seed 3, this run's is 9" in res.stdout, res.stdout
    assert "--seed 3 continues the run as it was" in res.stdout, res.stdout
    same = run_cli_args("train", cfg, "--out", tmp_path / "d", "--resume", run / "latest.h5",
                        "--iters", "21")
    assert same.returncode == 0 and "was written by a run of seed" not in same.stdout, same.stdout


SLOW_SAVE = """
import os, runpy, sys, time
real = os.replace
def replace(a, b):
    if os.environ.get("PMI_RANK") == "0" and os.path.basename(b) == "ckpt_2.h5":
        time.sleep(9)  # a file system slower than parallel.stall_timeout
    return real(a, b)
os.replace = replace
sys.argv = ["purine_mpi"] + sys.argv[1:]
runpy.run_module("purine_mpi", run_name="__main__", alter_sys=True)
"""


@pytest.mark.mpi
@pytest.mark.slow
def test_a_checkpoint_write_longer_than_the_stall_timeout_is_named(tmp_path, digits_h5):
    """(d) While rank 0 wrote a checkpoint the other ranks went on into the
    next collective; a write longer than ``parallel.stall_timeout`` ended
    the job as 'rank 1: the stop agreement (allreduce) stalled ...: a peer
    rank stopped responding', naming neither the write nor what to do. Now
    the others wait for the write in a barrier of its own, named."""
    import subprocess

    from tests.conftest import MPIEXEC, PYTHON, REPO, cli_env
    if MPIEXEC is None:
        pytest.skip("mpiexec not found")
    script = tmp_path / "slow_save.py"
    script.write_text(SLOW_SAVE)
    cfg = small_net_config(digits_h5)
    cfg["solver"].update(max_iter=4, test_interval=0, display=0)
    cfg["checkpoint"] = {"interval": 2}
    cfg["parallel"] = {"scheme": "data", "stall_timeout": 4}
    job = write_config_file(tmp_path, cfg)
    res = subprocess.run([MPIEXEC, "-n", "2", PYTHON, str(script), "train", job, "--out",
                          tmp_path / "run"], cwd=REPO, env=cli_env(), capture_output=True,
                         text=True, timeout=120)
    out = res.stdout + res.stderr
    assert res.returncode == 1, out
    assert ("rank 1: the wait for rank 0's write of the checkpoint ckpt_2.h5 stalled for more "
            "than 4 s (parallel.stall_timeout): rank 0 is still writing it (a slow file "
            "system: raise parallel.stall_timeout)") in out, out


@pytest.mark.mpi
def test_a_scheme_none_resume_says_every_replica_goes_on_from_rank_0s(tmp_path, digits_h5):
    """(e) Scheme none saves rank 0's replica alone: a resume on 2 ranks
    gave rank 1 rank 0's weights and momenta, silently (the train rows, the
    ranks' mean loss, then left the uninterrupted run's: 1.88 for 2.12 at
    iteration 20 of jobs/digits_lenet.yaml resumed at 10)."""
    cfg = small_net_config(digits_h5)
    cfg["solver"].update(max_iter=4, test_interval=0)
    cfg["parallel"] = {"scheme": "none"}
    job = write_config_file(tmp_path, cfg)
    first = run_mpi_cli(2, "train", job, "--out", tmp_path / "a")
    assert first.returncode == 0, first.stderr
    res = run_mpi_cli(2, "train", job, "--out", tmp_path / "b", "--iters", "6", "--resume",
                      tmp_path / "a" / "latest.h5")
    assert res.returncode == 0, res.stderr
    assert "note: scheme none: " in res.stdout and \
        "so each of the 2 replicas resumes from it" in res.stdout, res.stdout


def test_scheme_tensor_of_degree_1_on_one_rank_is_not_told_to_split_1_ways(digits_h5):
    """(f) ``scheme: tensor`` with the default ``tensor_parallel: 1`` on one
    rank was told '(start mpiexec -n 1 to split it 1 ways)'."""
    from purine_mpi.parallel.compose import settings_without_effect
    from tests.conftest import make_job
    cfg = small_net_config(digits_h5)
    cfg["parallel"] = {"scheme": "tensor"}
    notes = settings_without_effect(make_job(cfg), 1)
    assert not any("split it 1 ways" in n for n in notes), notes
    assert any("parallel.tensor_parallel is 1, which splits nothing" in n for n in notes), notes


def test_a_resume_says_which_seed_the_data_order_follows(tmp_path, run20):
    """The note of (c) said the data order follows the run's new seed also
    where ``data.train.seed`` draws it (the order goes on unchanged), and
    nothing where that seed alone changed (the epoch under way went on in
    another order without a word). It now reads the checkpoint's config:
    the data's own seed is said apart from the run's."""
    cfg, run = run20
    # the run's seed 3 drew the order; data.train.seed 3 draws the same one
    kept = run_cli_args("train", cfg, "--out", tmp_path / "e", "--resume", run / "latest.h5",
                        "--iters", "21", "--seed", "9", "--set", "data.train.seed=3")
    assert kept.returncode == 0, kept.stderr
    assert "was written by a run of seed 3, this run's is 9: the dropout masks" in kept.stdout, \
        kept.stdout
    assert "not the train data's order (data.train.seed 3 draws it" in kept.stdout, kept.stdout
    assert "goes on in another order" not in kept.stdout, kept.stdout
    # the run's seed kept, the data's order drawn from another one
    moved = run_cli_args("train", cfg, "--out", tmp_path / "f", "--resume", run / "latest.h5",
                         "--iters", "21", "--set", "data.train.seed=5")
    assert moved.returncode == 0, moved.stderr
    assert ("whose train data was read in the order of seed 3, this run's in the order "
            "of seed 5 (data.train.seed, data.train.shuffle), so the epoch under way goes on "
            "in another order") \
        in moved.stdout, moved.stdout
    assert "data.train.seed: 3 continues it as it was" in moved.stdout, moved.stdout

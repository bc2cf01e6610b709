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
    assert "was written by 1 rank(s), this run has 2: the global batch is now 64" in res.stdout

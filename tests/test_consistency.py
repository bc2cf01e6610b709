"""Small consistencies a user notices (issue: 'At home on a real cluster', 7)."""
import re

from tests.conftest import run_cli_args


def test_a_graph_yaml_job_reports_its_own_lr_and_speed(tmp_path, digits_h5):
    """A config written by ``graph --format yaml`` carries its solver: the
    start-up block's base_lr is the lr the iterations use, and the speed is
    counted from the graph's data readers (it has no data: section)."""
    sets = ["--set", f"data.train.path={digits_h5}", "--set", f"data.test.path={digits_h5}"]
    res = run_cli_args("graph", "jobs/digits_lenet.yaml", "--format", "yaml", *sets)
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

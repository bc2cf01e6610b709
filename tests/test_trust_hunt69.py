"""Session 69's trust hunt: what a user of the CLI met, each test failing
on the code before its fix (the assertion named in each docstring)."""
import os

import pytest

from tests.conftest import REPO, run_cli_here

JOBS = os.path.join(REPO, "jobs")


@pytest.mark.parametrize("value", ["0", "2.5", "two"])
def test_plan_and_predict_refuse_a_bad_ranks_per_node_alike(value, tmp_path):
    """``--ranks-per-node`` is read in one place (tools/scaling/node.
    parse_ranks_per_node) for ``plan`` and ``predict``: the same one line
    and exit 2 from both. Before, plan's argparse ``type=int`` gave a usage
    error for 2.5 and plan's own check said "give a number of ranks >= 1"
    for 0, predict "expected a whole number >= 1, got '0'" (this test's
    equality of the two lines)."""
    plan = run_cli_here("plan", os.path.join(JOBS, "digits_lenet.yaml"), "--np", "2",
                        "--ranks-per-node", value)
    predict = run_cli_here("predict", str(tmp_path), "--np", "2", "--ranks-per-node", value)
    want = f"error: --ranks-per-node {value}: expected a whole number >= 1"
    assert plan.returncode == 2 and predict.returncode == 2, (plan.stderr, predict.stderr)
    assert plan.stderr.strip().splitlines()[-1] == want, plan.stderr
    assert predict.stderr.strip().splitlines()[-1] == want, predict.stderr

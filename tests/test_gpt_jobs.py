"""The GPT jobs on the text source (issue 37): data parallelism over
``mpiexec`` gives the weights of one rank with the global batch, the shipped
gpt_tiny net starts at the uniform loss and trains, and (slow) it learns
beyond the data's unigram statistics within a short budget."""
import json
import os

import numpy as np
import pytest

from tests.conftest import REPO, run_cli_args, run_mpi_cli, train_here, write_config_file
from tests.gpt_oracle import gpt_net

TINY = os.path.join(REPO, "jobs", "gpt_tiny.yaml")


def _params(path):
    from purine_mpi.job.checkpoint_file import load_params
    return load_params(path)


def test_two_ranks_equal_one_rank_with_twice_the_batch(email_h5, tmp_path):
    """Scaling target: 2-rank data parallelism on the text source gives the
    weights of 1 rank with twice the batch, within 1e-5 (norm-relative, per
    parameter), after 6 AdamW steps with warm-up, cosine and clipping."""
    net = gpt_net(vocab=256, width=32, heads=2, blocks=2, max_length=16, approximate="tanh")
    solver = {"type": "adamw", "base_lr": 0.003, "momentum2": 0.99, "weight_decay": 0.1,
              "lr_policy": "cosine", "warmup_iters": 2, "max_iter": 6, "display": 0,
              "clip_gradients": 1.0}

    def config(batch):
        spec = {"source": "text", "path": email_h5, "batch_size": batch, "sequence_length": 16,
                "shuffle": True}
        return {"name": "dp", "seed": 5, "net": net, "solver": solver, "data": {"train": spec}}
    # the one-rank runs in this process (conftest.train_here)
    one = train_here(config(8), tmp_path / "one")
    two = tmp_path / "two"
    res = run_mpi_cli(2, "train", write_config_file(tmp_path, config(4), "two.yaml"), "--out", two)
    assert res.returncode == 0, res.stderr
    a, b = _params(one / "latest.h5"), _params(two / "latest.h5")
    assert sorted(a) == sorted(b) and len(a) > 10
    # the k third of qkv_bias has a zero gradient in exact arithmetic (a
    # softmax does not see a constant added to a row): AdamW turns its
    # rounding noise into steps, so it is compared apart, in absolute terms
    for n in [n for n in a if n.endswith("qkv_bias")]:
        a[n + ":k"], b[n + ":k"] = a[n][32:64], b[n][32:64]
        assert np.abs(a[n + ":k"] - b[n + ":k"]).max() <= 1e-5, n
        a[n], b[n] = np.delete(a[n], np.s_[32:64]), np.delete(b[n], np.s_[32:64])
        del a[n + ":k"], b[n + ":k"]
    worst = max(np.linalg.norm(a[n] - b[n]) / np.linalg.norm(a[n]) for n in a)
    assert worst <= 1e-5, worst
    # and the ranks did not read the same windows: one rank with the per-rank
    # batch trains to other weights
    c = _params(train_here(config(4), tmp_path / "half") / "latest.h5")
    assert np.linalg.norm(a["wte/weight"] - c["wte/weight"]) > 1e-3 * np.linalg.norm(
        a["wte/weight"])


def test_gpt_tiny_starts_uniform_and_trains(email_h5, tmp_path):
    """The shipped net: its initial loss is near ln 256 (std-0.02 weights
    give scores of std about 0.02·√128 = 0.23, a loss about 0.1 below it, as
    PyTorch's GPT with the same init gives), and 8 warm-up steps lower it."""
    from purine_mpi.job.config import load_config
    from purine_mpi.train.trainer import Trainer
    from tests.conftest import FakeWorld, make_job
    cfg = load_config(TINY, overrides=[f"data.train.path={email_h5}",
                                       f"data.test.path={email_h5}",
                                       "data.train.batch_size=4", "solver.max_iter=8"])
    job = make_job(cfg)
    t = Trainer(job, str(tmp_path), world=FakeWorld(), log=lambda m: None)
    try:
        losses = []
        for it in range(8):
            t.ws["iter"][...] = it
            t.train.run(it)
            losses.append(sum(float(t.ws[b]) for b in t.graphs.losses))
    finally:
        t.close()
    assert np.log(256) - 0.25 < losses[0] < np.log(256) + 0.02, losses
    assert max(losses[-2:]) < losses[0] - 0.3, losses


# Measured (one core, 2026-11-25): jobs/gpt_tiny.yaml with batch 16 and
# max_iter 150 (the cosine schedule compressed to it) ends at a validation
# loss of 2.456 nats/byte (15 s of CPU); the untrained net gives 5.41 (about
# ln 256), the unigram entropy of these 377,753 bytes is 3.12 and their
# in-sample bigram statistics 2.35. 120 iterations (2026-11-29) end at 2.515,
# 100 at 2.563 (too near the threshold to hold on another BLAS); 120 is CI's
# budget (the 30 more cost ~7 s of a loaded worker and asked nothing more).
SHORT_ITERS = 120
SHORT_THRESHOLD = 2.6  # 0.83 of the unigram entropy: a net that learned no context cannot


@pytest.mark.slow
def test_gpt_tiny_learns_in_a_short_budget(email_h5, tmp_path):
    out = tmp_path / "run"
    res = run_cli_args("train", TINY, "--out", out, "--set", f"data.train.path={email_h5}",
                       "--set", f"data.test.path={email_h5}", "--set", "data.train.batch_size=16",
                       "--set", f"solver.max_iter={SHORT_ITERS}",
                       "--set", f"solver.test_interval={SHORT_ITERS}",
                       # no iteration-0 pass (a text source's default; ~4% of this
                       # test): its loss is not asked here, test_token_logs checks it
                       "--set", "solver.test_initialization=false", timeout=600)
    assert res.returncode == 0, res.stderr
    tests = [json.loads(line) for line in open(out / "metrics.jsonl")]
    final = [r for r in tests if r.get("phase") == "test"][-1]
    assert final["iter"] == SHORT_ITERS
    assert final["loss"] <= SHORT_THRESHOLD, final

"""jobs/gpt2_124m.yaml (issue 45 item 5): nanoGPT's train_gpt2 settings. It
builds on the CPU, its parameter count is GPT-2 124M's with the padded
vocabulary (the count of transformers' own GPT2LMHeadModel, tied lm_head,
built offline on the CPU), and ``plan`` and ``graph`` work on it."""
import os

import numpy as np
import pytest

from purine_mpi.job.config import load_config
from purine_mpi.tools.graph import compose_for
from tests.conftest import REPO, make_job, run_cli_here

JOB = os.path.join(REPO, "jobs", "gpt2_124m.yaml")


def _sets(text_h5, *more):
    return [f"data.train.path={text_h5}", f"data.test.path={text_h5}", *more]


def test_settings_are_nanogpts(text_h5):
    cfg = load_config(JOB, overrides=_sets(text_h5))
    s, par, train = cfg["solver"], cfg["parallel"], cfg["data"]["train"]
    assert (s["type"], s["base_lr"], s["momentum"], s["momentum2"], s["weight_decay"]) == \
        ("adamw", 6e-4, 0.9, 0.95, 0.1)
    assert (s["lr_policy"], s["min_lr"], s["clip_gradients"]) == ("cosine", 6e-5, 1.0)
    assert s["warmup_iters"] > 0 and s["max_iter"] > s["warmup_iters"]
    # 2**19 tokens per step through micro-batches
    assert train["batch_size"] * train["sequence_length"] == 2 ** 19
    assert par["micro_batches"] > 1 and train["batch_size"] % par["micro_batches"] == 0
    attn = [layer for layer in cfg["net"] if layer["type"] == "attention"]
    assert len(attn) == 12 and {a["num_heads"] for a in attn} == {12}
    assert cfg["net"][0]["input_dim"] == 50304 and cfg["net"][0]["num_output"] == 768


def _param_count(text_h5):
    cfg = load_config(JOB, overrides=_sets(text_h5, "parallel.micro_batches=1",
                                           "data.train.batch_size=1"))
    graph = compose_for(make_job(cfg), 1, 0)
    return sum(int(np.prod(b.shape)) for b in graph.params()), cfg


def test_parameter_count_is_gpt2_124m(text_h5):
    count, cfg = _param_count(text_h5)
    # the closed form of the config: wte + wpe + L (2 LN + qkv + proj + fc + proj) + ln_f
    V, C, T = cfg["net"][0]["input_dim"], cfg["net"][0]["num_output"], cfg["net"][1]["max_length"]
    L = sum(layer["type"] == "attention" for layer in cfg["net"])
    closed = V * C + T * C + L * (4 * C + 3 * C * C + 3 * C + C * C + C + 8 * C * C + 5 * C) + 2 * C
    assert count == closed
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    # built on the meta device: the parameters' shapes without 124M random
    # initial values (their count is all this compares)
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=V, n_positions=T, n_embd=C, n_layer=L, n_head=12))
    assert count == sum(p.numel() for p in model.parameters())  # tied: lm_head counted once
    assert count == 124_475_904  # the figure nanoGPT prints for this config


def test_graph_and_plan_work_on_the_cpu(text_h5):
    res = run_cli_here("graph", JOB, *sum((["--set", s] for s in _sets(
        text_h5, "parallel.micro_batches=1", "data.train.batch_size=2")), []))
    assert res.returncode == 0, res.stderr
    assert "h11_attn" in res.stdout and "lm_head" in res.stdout
    res = run_cli_here("plan", JOB, "--json", *sum((["--set", s] for s in _sets(
        text_h5, "parallel.micro_batches=1", "data.train.batch_size=2")), []))
    assert res.returncode == 0, res.stderr
    assert "weights" in res.stdout

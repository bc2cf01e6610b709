"""``generate`` (issue 37): a continuation drawn from a trained GPT, checked
against the same weights in a PyTorch GPT (tests/gpt_oracle.py) that runs
on the cropped context itself (no padding), reproducible for a seed."""
import email
import os

import numpy as np
import pytest

from tests.conftest import run_cli_args, run_mpi_cli, write_config_file
from tests.gpt_oracle import gpt_net, torch_gpt_from_net

EMAIL = os.path.dirname(email.__file__)
T = 16


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 1-block GPT trained 40 iterations on the email package: (config, run folder, net)."""
    d = tmp_path_factory.mktemp("gen")
    data = d / "email.h5"
    res = run_cli_args("data", "text", "--from", EMAIL, "--glob", "*.py", "--out", data)
    assert res.returncode == 0, res.stderr
    net = gpt_net(vocab=256, width=32, heads=2, blocks=1, max_length=T, approximate="tanh")
    spec = {"source": "text", "path": str(data), "batch_size": 8, "sequence_length": T}
    config = write_config_file(d, {
        "name": "gen", "seed": 3, "net": net,
        "data": {"train": dict(spec, shuffle=True), "test": spec},
        "solver": {"type": "adamw", "base_lr": 0.01, "max_iter": 40, "display": 0,
                   "weight_decay": 0.0}})
    run = d / "run"
    res = run_cli_args("train", config, "--out", run)
    assert res.returncode == 0, res.stderr
    return config, run, net


def _params(run):
    from purine_mpi.job.checkpoint_file import load_params
    return load_params(os.path.join(run, "latest.h5"))


def _torch_continuation(net, params, prompt, tokens, temperature, top_k, seed):
    """The reference: PyTorch on the last T tokens, the draw rule of
    docs/transformers.md with NumPy's default_rng(seed)."""
    import torch
    model, _ = torch_gpt_from_net(net, params)
    model.eval()
    rng = np.random.default_rng(seed)
    context, out = list(prompt.encode()), []
    with torch.no_grad():
        for _ in range(tokens):
            logits, _ = model(torch.tensor([context[-T:]]))
            s = logits[0, -1].double().numpy()
            if temperature == 0:
                t = int(np.argmax(s))
            else:
                s = s / temperature
                if top_k:
                    s[s < np.sort(s)[-top_k]] = -np.inf
                p = np.exp(s - s.max())
                t = int(rng.choice(len(p), p=p / p.sum()))
            out.append(t)
            context.append(t)
    return bytes(out).decode("utf-8", errors="replace")


def _generate(config, run, *extra):
    res = run_cli_args("generate", config, "--weights", run, *extra)
    assert res.returncode == 0, res.stderr
    assert res.stdout.endswith("\n")
    return res.stdout[:-1]


def test_greedy_matches_pytorch_and_crops_the_context(trained):
    config, run, net = trained
    params = _params(run)
    prompt = "def get_payload(self, i=None, decode=False):\n"  # longer than T: cropped
    assert len(prompt) > T
    ours = _generate(config, run, "--prompt", prompt, "--tokens", "24", "--temperature", "0")
    assert ours == _torch_continuation(net, params, prompt, 24, 0, None, 0)
    # the context is the last T tokens: the prompt's own last T give the same text
    assert _generate(config, run, "--prompt", prompt[-T:], "--tokens", "24",
                     "--temperature", "0") == ours
    # top-k 1 is greedy too
    assert _generate(config, run, "--prompt", prompt, "--tokens", "24", "--top-k", "1",
                     "--seed", "5") == ours


def test_sampling_is_reproducible_and_matches_pytorch(trained):
    config, run, net = trained
    params = _params(run)
    args = ("--prompt", "import ", "--tokens", "30", "--temperature", "0.8", "--top-k", "20")
    first = _generate(config, run, *args, "--seed", "11")
    assert first == _generate(config, run, *args, "--seed", "11")
    assert first != _generate(config, run, *args, "--seed", "12")
    assert first == _torch_continuation(net, params, "import ", 30, 0.8, 20, 11)
    # a checkpoint file works as the run folder does
    assert first == _generate(config, str(run), *args[:-2], "--top-k", "20", "--seed", "11")
    assert first == _generate(config, os.path.join(run, "ckpt_40.h5"), *args, "--seed", "11")


@pytest.mark.parametrize("extra,word", [
    (("--tokens", "0"), "--tokens"), (("--temperature", "-1"), "--temperature"),
    (("--temperature", "nan"), "--temperature"), (("--top-k", "0"), "--top-k"),
    (("--prompt", ""), "--prompt"), (("--seed", "-3"), "seed")])
def test_bad_arguments_exit_2(trained, extra, word):
    config, run, _ = trained
    args = {"--prompt": "x", "--tokens": "5"}
    args.update(dict(zip(extra[::2], extra[1::2])))
    res = run_cli_args("generate", config, "--weights", run,
                       *[v for kv in args.items() for v in kv])
    assert res.returncode == 2, res.stderr
    assert word in res.stderr and "Traceback" not in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


def test_generate_needs_a_text_model(digits_h5, tmp_path, trained):
    config, run, _ = trained
    other = write_config_file(tmp_path, {
        "net": [{"type": "fc", "name": "fc", "bottom": "data", "top": "fc", "num_output": 10},
                {"type": "softmax_loss", "name": "loss", "bottom": ["fc", "label"]}],
        "data": {"train": {"path": digits_h5, "split": "train", "batch_size": 4}}})
    res = run_cli_args("generate", other, "--weights", run, "--prompt", "x", "--tokens", "2")
    assert res.returncode == 2 and "data.train.source" in res.stderr, res.stderr


def test_generate_under_mpiexec_prints_once(trained):
    config, run, _ = trained
    res = run_mpi_cli(2, "generate", config, "--weights", run, "--prompt", "class ",
                      "--tokens", "12", "--temperature", "0")
    assert res.returncode == 0, res.stderr
    assert res.stdout[:-1] == _generate(config, run, "--prompt", "class ", "--tokens", "12",
                                        "--temperature", "0")

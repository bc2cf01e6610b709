"""``generate`` (issue 37): a continuation drawn from a trained GPT, checked
against the same weights in a PyTorch GPT (tests/gpt_oracle.py) that runs
on the cropped context itself (no padding), reproducible for a seed."""
import io
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.conftest import (REPO, cli_env, poisoned_copy, run_cli_args, run_cli_here,
                            run_mpi_cli, train_here, write_config_file)
from tests.gpt_oracle import gpt_net, torch_gpt_from_net

T = 16


@pytest.fixture(scope="module")
def trained(tmp_path_factory, email_h5):
    """A 1-block GPT trained 40 iterations on the email package: (config, run folder, net)."""
    d = tmp_path_factory.mktemp("gen")
    net = gpt_net(vocab=256, width=32, heads=2, blocks=1, max_length=T, approximate="tanh")
    spec = {"source": "text", "path": email_h5, "batch_size": 8, "sequence_length": T}
    config = write_config_file(d, {
        "name": "gen", "seed": 3, "net": net,
        "data": {"train": dict(spec, shuffle=True), "test": spec},
        "solver": {"type": "adamw", "base_lr": 0.01, "max_iter": 40, "display": 0,
                   "weight_decay": 0.0}})
    run = d / "run"
    train_here(config, run)  # in this process (conftest.train_here)
    return config, run, net


def _params(run):
    from purine_mpi.job.checkpoint_file import load_params
    return load_params(os.path.join(run, "latest.h5"))


def _nucleus(p, top_p):
    """The reference nucleus of probabilities ``p``: the ids of the fewest
    tokens, taken by descending probability (a tie: the lower id first),
    whose probabilities sum to ``top_p`` or more, in exact rational sums."""
    from fractions import Fraction
    kept, total = [], Fraction(0)
    for i in sorted(range(len(p)), key=lambda i: (-p[i], i)):
        if total >= Fraction(top_p):
            break
        kept.append(i)
        total += Fraction(p[i])
    return kept


def _torch_continuation(net, params, prompt, tokens, temperature, top_k, seed, top_p=None):
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
                p /= p.sum()
                if top_p:
                    q = np.zeros_like(p)
                    kept = _nucleus(p, top_p)
                    q[kept] = p[kept]
                    p = q / q.sum()
                t = int(rng.choice(len(p), p=p / p.sum()))
            out.append(t)
            context.append(t)
    return bytes(out).decode("utf-8", errors="replace")


def _generate(config, run, *extra):
    """The continuation alone (--no-prompt)."""
    res = run_cli_here("generate", config, "--weights", run, "--no-prompt", *extra)
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
    # the nucleus after the top k (Hugging Face's order)
    nucleus = _generate(config, run, *args, "--top-p", "0.6", "--seed", "11")
    assert nucleus == _torch_continuation(net, params, "import ", 30, 0.8, 20, 11, top_p=0.6)
    assert nucleus != first


@pytest.mark.parametrize("extra,word", [
    (("--tokens", "0"), "--tokens"), (("--temperature", "-1"), "--temperature"),
    (("--temperature", "nan"), "--temperature"), (("--top-k", "0"), "--top-k"),
    (("--top-p", "0"), "--top-p must be a number in (0, 1]"), (("--top-p", "1.5"), "--top-p"),
    (("--top-p", "nan"), "--top-p"), (("--top-p", "-0.2"), "--top-p"),
    (("--prompt", ""), "--prompt"), (("--seed", "-3"), "seed")])
def test_bad_arguments_exit_2(trained, extra, word):
    config, run, _ = trained
    args = {"--prompt": "x", "--tokens": "5"}
    args.update(dict(zip(extra[::2], extra[1::2])))
    res = run_cli_here("generate", config, "--weights", run,
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
    res = run_cli_here("generate", other, "--weights", run, "--prompt", "x", "--tokens", "2")
    assert res.returncode == 2 and "data.train.source" in res.stderr, res.stderr


def test_generate_under_mpiexec_prints_once(trained):
    config, run, _ = trained
    res = run_mpi_cli(2, "generate", config, "--weights", run, "--prompt", "class ",
                      "--tokens", "12", "--temperature", "0", "--no-prompt")
    assert res.returncode == 0, res.stderr
    assert res.stdout[:-1] == _generate(config, run, "--prompt", "class ", "--tokens", "12",
                                        "--temperature", "0")


def test_a_padded_test_pass_counts_each_window_once(trained):
    """The test phase reads the disjoint windows of the validation split: a
    batch that divides their number and one that pads the last batch (whole
    windows get the padding label) give the same figures, on 1 and 2 ranks."""
    import json
    config, run, _ = trained
    from purine_mpi.data.sources import source_info
    from tests.conftest import make_job
    from purine_mpi.job.config import load_config
    n = source_info(make_job(load_config(config)).data.test.source_dict())[0]
    figures = []
    for batch, ranks in ((n, 1), (64, 1), (24, 2)):  # one batch of every window; padded
        args = ("test", config, "--weights", run, "--set", f"data.test.batch_size={batch}")
        res = run_cli_args(*args) if ranks == 1 else run_mpi_cli(ranks, *args)
        assert res.returncode == 0, res.stderr
        figures.append(json.loads(res.stdout.strip().splitlines()[-1]))
    assert figures[0]["samples"] == n and all(f == figures[0] for f in figures), figures


# ------------------------------------------------------ issue 42 and issue 46
def test_nan_weights_exit_3_naming_the_blob(trained, tmp_path):
    """As test, --init and --resume: not NumPy's 'Probabilities contain NaN'."""
    config, run, _ = trained
    bad = poisoned_copy(os.path.join(run, "latest.h5"), tmp_path / "nan.h5",
                        "params/h0_fc/weight")
    res = run_cli_args("generate", config, "--weights", bad, "--prompt", "x", "--tokens", "3")
    assert res.returncode == 3, res.stderr
    assert "h0_fc/weight" in res.stderr and "Traceback" not in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and res.stdout == ""


@pytest.mark.parametrize("extra", [["--temperature", "0"], []], ids=["greedy", "sampled"])
def test_non_finite_scores_of_finite_weights_exit_3(trained, tmp_path, extra):
    """Finite weights whose forward pass overflows (ln_f's scale 3e38, the
    float32 largest's order: the logits are -inf and NaN): greedy decoding
    took the first NaN's id (np.argmax) and printed it, exit 0; sampling
    stopped with a traceback (NumPy's 'Probabilities contain NaN'). Now
    exit 3 in one line saying the scores are not finite; no token is
    drawn from them."""
    import h5py
    config, run, _ = trained
    bad = tmp_path / "overflow.h5"
    shutil.copy(os.path.join(run, "latest.h5"), bad)
    with h5py.File(bad, "r+") as f:
        weight = f["params/ln_f/weight"]
        weight[...] = np.where(weight[...] < 0, -3e38, 3e38).astype(np.float32)
    res = run_cli_args("generate", config, "--weights", bad, "--prompt", "def ", "--tokens", "3",
                       "--no-prompt", *extra)
    assert res.returncode == 3, (res.returncode, res.stdout, res.stderr)
    assert "scores of the token after the prompt and 0 drawn token(s) are not finite" \
        in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and res.stdout.strip() == ""


def test_a_prompt_that_is_not_utf8_exits_2(trained):
    config, run, _ = trained
    prompt = os.fsdecode(b"\xff abc")  # as Python gives a non-UTF-8 argument
    res = run_cli_here("generate", config, "--weights", run, "--prompt", prompt, "--tokens", "3")
    assert res.returncode == 2, res.stderr
    assert "--prompt" in res.stderr and "UTF-8" in res.stderr and "0xff" in res.stderr
    assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_prints_the_prompt_then_the_continuation(trained):
    """nanoGPT's sample.py: the prompt, then what was drawn; --no-prompt
    leaves the prompt out."""
    config, run, _ = trained
    args = ("--prompt", "from email ", "--tokens", "20", "--seed", "4")
    res = run_cli_here("generate", config, "--weights", run, *args)
    assert res.returncode == 0, res.stderr
    assert res.stdout == "from email " + _generate(config, run, *args) + "\n"


def test_the_weights_alone_suffice(trained, tmp_path):
    """No config (the checkpoint holds it) and no training data file: the
    same text as with the config."""
    config, run, net = trained
    args = ("--prompt", "import ", "--tokens", "16", "--temperature", "0.7", "--seed", "9")
    want = _generate(config, run, *args)
    for weights in (run, os.path.join(run, "ckpt_40.h5")):
        res = run_cli_here("generate", "--weights", weights, "--no-prompt", *args)
        assert res.returncode == 0, res.stderr
        assert res.stdout[:-1] == want
    # a config whose data file is gone: generate never reads it
    spec = {"source": "text", "path": str(tmp_path / "gone.h5"), "batch_size": 8,
            "sequence_length": T}
    moved = write_config_file(tmp_path, {
        "name": "gen", "seed": 3, "net": net,
        "data": {"train": dict(spec, shuffle=True), "test": spec},
        "solver": {"type": "adamw", "base_lr": 0.01, "max_iter": 40, "display": 0,
                   "weight_decay": 0.0}})
    assert _generate(moved, run, *args) == want
    # a weights file without a config: say to give one
    from purine_mpi.job.checkpoint_file import load_params
    import h5py
    bare = tmp_path / "bare.h5"
    with h5py.File(bare, "w") as f:
        for name, value in load_params(os.path.join(run, "latest.h5")).items():
            f.create_dataset(f"params/{name}", data=value)
    res = run_cli_here("generate", "--weights", bare, "--prompt", "x", "--tokens", "2")
    assert res.returncode == 2 and "config" in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    assert _generate(config, bare, *args) == want  # with the config it is a weights file


def test_streams_as_drawn_and_ctrl_c_keeps_the_text(trained):
    """The tokens appear as they are drawn; Ctrl-C ends the line and exits
    130 without a traceback, the text drawn so far shown."""
    config, run, _ = trained
    cmd = [sys.executable, "-m", "purine_mpi", "generate", config, "--weights", str(run),
           "--prompt", "import ", "--tokens", "1000000", "--temperature", "0"]
    # faulthandler: a run that outlives its Ctrl-C shows its threads' stacks
    # (SIGABRT). SIGINT as at a terminal: a test run started in the background
    # of a script (`cmd &`, nohup) ignores SIGINT, and Python keeps an ignored
    # SIGINT ignored in its children (the final run of stop 58: SigIgn 0x...7)
    p = subprocess.Popen(cmd, cwd=REPO, env=dict(cli_env(), PYTHONFAULTHANDLER="1"),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        os.set_blocking(p.stdout.fileno(), False)
        shown, deadline = b"", time.monotonic() + 90
        while len(shown) < len("import ") + 40 and time.monotonic() < deadline \
                and p.poll() is None:
            shown += p.stdout.read() or b""
            time.sleep(0.05)
        assert len(shown) >= len("import ") + 40, shown  # today: nothing before the end
        p.send_signal(signal.SIGINT)
        os.set_blocking(p.stdout.fileno(), True)
        try:
            rest, err = p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail("generate still runs 60 s after its Ctrl-C: " + _still_running(p))
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    text = (shown + rest).decode()
    assert p.returncode == 130, err
    assert b"Traceback" not in err and text.startswith("import ") and text.endswith("\n")
    # what was shown is the start of the same greedy continuation
    assert text[len("import "):][:40] == _generate(config, run, "--prompt", "import ",
                                                   "--tokens", "40", "--temperature", "0")


def _still_running(p):
    """What a process that outlived its SIGINT was doing: its /proc state
    and signal masks (a stopped process, an ignored or blocked SIGINT), then
    its Python stacks (faulthandler's, on SIGABRT)."""
    try:
        with open(f"/proc/{p.pid}/status") as f:
            status = [line.strip() for line in f
                      if line.split(":")[0] in ("State", "SigPnd", "ShdPnd", "SigBlk",
                                                "SigIgn", "SigCgt")]
    except OSError as exc:
        status = [str(exc)]
    p.send_signal(signal.SIGABRT)
    try:
        _, err = p.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        err = b"(no stacks: it did not end on SIGABRT either)"
    return "; ".join(status) + "\n" + err.decode(errors="replace")[-6000:]


def test_stream_decodes_characters_split_across_tokens():
    """Byte tokens: a character of several bytes is printed once whole, an
    invalid byte as U+FFFD, never a garbled piece."""
    from purine_mpi.tools.generate import write_stream
    raw = "é€😀 ok".encode() + b"\xff!" + "é".encode()[:1]
    out = io.StringIO()
    write_stream(iter(raw), "p: ", out)
    assert out.getvalue() == "p: " + raw.decode("utf-8", errors="replace") + "\n"


def test_device_0_on_a_machine_without_gpu_exits_2(trained):
    """As train, test and bench refuse it (not silently run on the CPU)."""
    from purine_mpi.base.backend import cupy_available
    if cupy_available():
        pytest.skip("this machine has a GPU: device 0 runs there")
    config, run, _ = trained
    res = run_cli_here("generate", config, "--weights", run, "--prompt", "x", "--tokens", "2",
                       "--set", "device=0")
    assert res.returncode == 2, res.stderr
    assert "device" in res.stderr and "Traceback" not in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and res.stdout == ""


def test_gpu_variables_on_a_cpu_run_are_noted_once(trained, tmp_path, monkeypatch):
    """PURINE_CONV and PURINE_FC_EPILOGUE steer the GPU path: a run on the
    CPU says once that they have no effect (generate's stderr, train's
    start-up block), on rank 0 alone. (generate runs in this process, with
    the variables in the environment run_cli_here gives it: the note is
    read from the environment at each call.)"""
    config, run, _ = trained
    with monkeypatch.context() as m:
        m.setenv("PURINE_CONV", "cudnn")
        m.setenv("PURINE_FC_EPILOGUE", "cublaslt")
        env = cli_env()
        res = run_cli_here("generate", config, "--weights", run, "--prompt", "x", "--tokens", "2")
    assert res.returncode == 0, res.stderr
    notes = [line for line in res.stderr.splitlines() if "no effect" in line]
    assert len(notes) == 1 and "PURINE_CONV" in notes[0] and "PURINE_FC_EPILOGUE" in notes[0]
    res = subprocess.run([sys.executable, "-m", "purine_mpi", "train", config, "--iters", "1",
                          "--out", str(tmp_path / "r")], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stderr
    lines = [line for line in (res.stdout + res.stderr).splitlines() if "no effect" in line]
    assert len(lines) == 1 and "PURINE_CONV, PURINE_FC_EPILOGUE" in lines[0], lines
    quiet = run_cli_here("generate", config, "--weights", run, "--prompt", "x", "--tokens", "2")
    assert quiet.returncode == 0 and "no effect" not in quiet.stderr, quiet.stderr


def test_device_0_runs_on_the_gpu(trained, monkeypatch, host_build_dir):
    """device: 0 places the net on the GPU (here the emulated one,
    tests/emulated_gpu) and draws the same tokens as the CPU."""
    from purine_mpi.job.config import load_job
    from purine_mpi.tools.generate import Generator
    from tests.emulated_gpu import emulated_gpu_env
    config, run, _ = trained
    weights = os.path.join(run, "latest.h5")
    cpu = Generator(load_job(config, check_files=False), weights)
    want = list(cpu.generate("import ", 12, 0.9, None, 5))
    emulated_gpu_env(monkeypatch, host_build_dir)
    gpu = Generator(load_job(config, ["device=0"], check_files=False), weights)
    assert gpu.device == 0
    assert list(gpu.generate("import ", 12, 0.9, None, 5)) == want


def test_a_tiny_temperature_draws_the_greedy_token():
    """scores / 1e-310 overflowed to inf, and inf - inf made the
    probabilities NaN (a traceback); temperature -> 0 tends to greedy."""
    from purine_mpi.tools.generate import pick
    scores = np.array([1.0, 3.0, 2.0, -1.0, 2.5])
    for temperature in (1e-3, 1e-300, 1e-310, 5e-324):
        for top_k in (None, 2):
            assert pick(scores, temperature, top_k, np.random.default_rng(7)) == 1
    # a normal temperature draws as the rule says: NumPy on the same draws
    for temperature, top_k in ((0.7, None), (1.3, 3)):
        s = scores / temperature
        if top_k:
            s[s < np.sort(s)[-top_k]] = -np.inf
        p = np.exp(s - s.max())
        want = np.random.default_rng(5).choice(len(p), size=40, p=p / p.sum())
        rng = np.random.default_rng(5)
        got = [pick(scores, temperature, top_k, rng) for _ in range(40)]
        assert got == [int(t) for t in want]


def test_top_p_draws_from_the_nucleus():
    """--top-p: many draws of ``pick`` against the nucleus distribution
    of the reference (``_nucleus``, exact sums): each token's share within
    5 standard errors, no draw outside the nucleus; after top-k, on the
    distribution renormalized over the k best (Hugging Face's order, which
    here keeps another set than top-p first); P = 1 is no top-p, draw for
    draw, and a tiny P is greedy (the lower id of a tie)."""
    from purine_mpi.tools.generate import pick
    scores = np.log([0.05, 0.3, 0.02, 0.2, 0.15, 0.1, 0.08, 0.07, 0.03])
    n = 6000
    for temperature, top_k, top_p, want_kept in ((1.0, None, 0.7, [1, 3, 4, 5]),
                                                 (0.8, None, 0.5, [1, 3]),
                                                 (1.0, 4, 0.6, [1, 3]),
                                                 (1.3, None, 0.95, [0, 1, 3, 4, 5, 6, 7, 8])):
        s = scores / temperature
        if top_k:
            s[s < np.sort(s)[-top_k]] = -np.inf
        p = np.exp(s - s.max())
        p /= p.sum()
        kept = _nucleus(p, top_p)
        if want_kept is not None:
            assert sorted(kept) == want_kept
        ref = np.zeros_like(p)
        ref[kept] = p[kept]
        ref /= ref.sum()
        rng = np.random.default_rng(3)
        counts = np.bincount([pick(scores, temperature, top_k, rng, top_p) for _ in range(n)],
                             minlength=len(p))
        assert counts[ref == 0].sum() == 0, (top_p, counts)
        err = np.sqrt(ref * (1 - ref) / n)
        assert np.all(np.abs(counts / n - ref) <= 5 * err + 1e-12), (top_p, counts / n, ref)
    # top-k then top-p keeps {1, 3} above; top-p alone would keep {1, 3, 4}
    assert sorted(_nucleus(np.exp(scores), 0.6)) == [1, 3, 4]
    # P = 1: every token, the draws of no top-p
    for top_k in (None, 3):
        a, b = np.random.default_rng(9), np.random.default_rng(9)
        assert [pick(scores, 0.9, top_k, a, 1.0) for _ in range(200)] == \
            [pick(scores, 0.9, top_k, b) for _ in range(200)]
    # a tiny P: the most likely token alone; of two tied, the lower id
    tied = np.array([0.5, 2.0, -1.0, 2.0, 1.9])
    rng = np.random.default_rng(1)
    for top_p in (1e-9, 0.25):
        assert {pick(tied, 1.0, None, rng, top_p) for _ in range(200)} == {1}
        assert {pick(scores, 1.0, None, rng, top_p) for _ in range(50)} == {1}


# ------------------------------------------------------------------ leftover 1
def _untied(tmp_path, rows, scores):
    """A 1-block GPT whose embedding has ``rows`` rows and whose output layer
    (not tied to it) scores ``scores`` tokens, with random weights: (config, weights)."""
    import h5py
    from purine_mpi.graph import Graph
    from purine_mpi.layers import build_net
    net = gpt_net(vocab=rows, width=8, heads=2, blocks=1, max_length=8)
    head = next(layer for layer in net if layer["name"] == "lm_head")
    del head["tie_weight"]
    head["num_output"] = scores
    spec = {"source": "text", "path": str(tmp_path / "unread.h5"), "batch_size": 2,
            "sequence_length": 8}
    config = write_config_file(tmp_path, {"name": "untied", "seed": 1, "net": net,
                                          "data": {"train": spec}})
    g = Graph("untied")
    g.add_blob("data", (1, 8), "int32")
    g.add_blob("label", (1, 8), "int32")
    build_net(net, "test", (g, config, None))
    rng = np.random.default_rng(0)
    weights = tmp_path / "untied.h5"
    with h5py.File(weights, "w") as f:
        for blob in g.params():
            f.create_dataset(f"params/{blob.name}",
                             data=rng.normal(0, 0.5, blob.shape).astype(np.float32))
    return config, weights, net.index(head)


def test_an_embedding_smaller_than_the_scores_is_refused_at_start_up(tmp_path):
    """An untied output layer scoring 256 tokens over an embedding of 100
    rows: a drawn id >= 100 fed back stopped the CPU run midway (the
    embedding's ValueError, a traceback) and read a wrapped row on a GPU.
    generate refuses the net before drawing (exit 2, one line naming both
    keys), not restricting the draw, which would sample another
    distribution than the model's. A prompt byte beyond the table (here
    'é', 0xc3) is refused with it."""
    from purine_mpi.base.errors import ConfigError
    from purine_mpi.job.config import load_job
    from purine_mpi.tools.generate import Generator
    config, weights, head = _untied(tmp_path, 100, 256)
    with pytest.raises(ConfigError) as exc:
        Generator(load_job(config, check_files=False), str(weights))
    message = str(exc.value)
    assert "key 'net[0].input_dim'" in message and f"net[{head}].num_output" in message
    assert "below 100" in message and "scores 256" in message, message
    for prompt in ("x", "é"):
        res = run_cli_here("generate", config, "--weights", weights, "--prompt", prompt,
                           "--tokens", "20", "--temperature", "1.5")
        assert res.returncode == 2 and res.stdout == "", res.stderr
        assert "net[0].input_dim" in res.stderr and "Traceback" not in res.stderr
        assert len(res.stderr.strip().splitlines()) == 1


def test_padding_scores_beyond_the_vocabulary_need_no_more_rows(tmp_path):
    """Scores for padding ids (264 over 256 bytes, untied) are never drawn:
    256 rows read every drawn id, so the net runs, drawing below 256, and
    a prompt's bytes are checked against the table's rows."""
    from purine_mpi.job.config import load_job
    from purine_mpi.tools.generate import Generator
    config, weights, _ = _untied(tmp_path, 256, 264)
    gen = Generator(load_job(config, check_files=False), str(weights))
    assert (gen.vocab, gen.drawn, gen.rows) == (264, 256, 256)
    drawn = list(gen.generate("abc", 40, 2.0, None, 3))
    assert len(drawn) == 40 and max(drawn) < 256

"""GPT-2 in Hugging Face's layout (issue 46): ``export hf`` writes a folder
that transformers' GPT2LMHeadModel loads with our logits (within 1e-5);
``train --init model.safetensors`` loads a GPT2LMHeadModel's file (also the
Hub's unprefixed names with its mask buffers) with its logits; our
checkpoint -> export hf -> --init -> our checkpoint is bitwise; a file of
other shapes and a net GPT-2 cannot express are refused (exit 2), naming
the tensor or the difference. Nothing is downloaded (HF_HUB_OFFLINE)."""
import copy
import json
import os

import h5py
import numpy as np
import pytest

from purine_mpi.job.config import load_config
from tests.conftest import run_cli_args, run_cli_here, train_here, write_config_file
from tests.gpt_nets import gpt_config, text_h5
from tests.test_onnx_export import our_forward

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_numpy = pytest.importorskip("safetensors.numpy")

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing from the network, ever


def _net(approximate="tanh"):
    net = copy.deepcopy(gpt_config("x")["net"])
    for layer in net:
        if layer["type"] == "gelu":
            layer["approximate"] = approximate
    return net


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 2-block GPT (width 16, 4 heads, 8 tokens) trained 4 iterations."""
    d = tmp_path_factory.mktemp("hf_gpt2")
    cfg = gpt_config(text_h5(d))
    path = write_config_file(d, cfg)
    train_here(path, d / "run")  # in this process (conftest.train_here)
    return d, cfg, path, d / "run" / "latest.h5"


def _hf_logits(folder_or_model, ids):
    model = folder_or_model
    if not isinstance(model, torch.nn.Module):
        model = transformers.GPT2LMHeadModel.from_pretrained(str(folder_or_model))
    model.eval()
    with torch.no_grad():
        return model(torch.from_numpy(ids.astype(np.int64))).logits.numpy()


def _params(ckpt):
    with h5py.File(ckpt, "r") as f:
        out = {}
        f["params"].visititems(lambda k, v: out.__setitem__(k, v[()])
                               if isinstance(v, h5py.Dataset) else None)
        return out


@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_export_hf_loads_in_transformers_with_our_logits(trained, approximate):
    d, cfg, _, weights = trained
    path = write_config_file(d, dict(cfg, net=_net(approximate)), f"gelu_{approximate}.yaml")
    out = d / f"hf_{approximate}"
    res = run_cli_args("export", "hf", path, "--weights", weights.parent, "--out", out)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.startswith(f"wrote {out}: 28 tensors, GPT-2 of 2 layers"), res.stdout
    config = json.loads((out / "config.json").read_text())
    assert config["activation_function"] == {"tanh": "gelu_new", "none": "gelu"}[approximate]
    assert (config["n_layer"], config["n_head"], config["n_embd"], config["n_positions"],
            config["vocab_size"], config["n_inner"]) == (2, 4, 16, 8, 256, 64)
    tensors = safetensors_numpy.load_file(str(out / "model.safetensors"))
    # Conv1D's [in, out]: our qkv_weight (3C, C) transposed
    assert tensors["transformer.h.0.attn.c_attn.weight"].shape == (16, 48)
    ours = our_forward(load_config(path), str(weights))
    logits = _hf_logits(out, ours["data"])
    np.testing.assert_allclose(logits, ours["logits"], rtol=0, atol=1e-5)


def test_init_from_gpt2_file_gives_its_logits_and_round_trip_is_bitwise(trained, tmp_path):
    d, cfg, path, weights = trained
    # a GPT2LMHeadModel of this net's shape, built from a config (no download)
    torch.manual_seed(3)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=256, n_positions=8, n_embd=16, n_layer=2, n_head=4, n_inner=64,
        activation_function="gelu_new", layer_norm_epsilon=1e-5))
    with torch.no_grad():  # layer norms and biases off their init, so a mix-up shows
        for name, p in model.named_parameters():
            if "ln_" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(str(tmp_path / "hf"))
    # as the Hub's files are: names without 'transformer.', the causal-mask buffers
    state = safetensors_numpy.load_file(str(tmp_path / "hf" / "model.safetensors"))
    hub = {k[len("transformer."):]: v for k, v in state.items()}
    hub["h.0.attn.bias"] = np.tril(np.ones((1, 1, 8, 8), np.float32))
    safetensors_numpy.save_file(hub, str(tmp_path / "hub.safetensors"))
    for name, src in (("hf", tmp_path / "hf" / "model.safetensors"),
                      ("hub", tmp_path / "hub.safetensors")):
        res = run_cli_args("train", path, "--out", tmp_path / f"run_{name}", "--init", src,
                           "--iters", "0")
        assert res.returncode == 0, res.stdout + res.stderr
        assert f"loaded 28 blobs from {src}" in res.stdout, res.stdout
        ours = our_forward(load_config(path), str(tmp_path / f"run_{name}" / "latest.h5"))
        np.testing.assert_allclose(ours["logits"], _hf_logits(model, ours["data"]),
                                   rtol=0, atol=1e-5)
    # our checkpoint -> export hf -> --init -> our checkpoint: the same bits
    res = run_cli_args("export", "hf", path, "--weights", weights, "--out", tmp_path / "out")
    assert res.returncode == 0, res.stdout + res.stderr
    res = run_cli_args("train", path, "--out", tmp_path / "back", "--iters", "0",
                       "--init", tmp_path / "out" / "model.safetensors")
    assert res.returncode == 0, res.stdout + res.stderr
    before, after = _params(weights), _params(tmp_path / "back" / "latest.h5")
    assert sorted(before) == sorted(after) and len(before) == 28
    for name in before:
        assert before[name].dtype == after[name].dtype
        assert before[name].tobytes() == after[name].tobytes(), name


def test_init_refuses_a_file_of_other_shapes_naming_the_tensor(trained, tmp_path):
    _, _, path, _ = trained
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=256, n_positions=8, n_embd=16, n_layer=2, n_head=4, n_inner=32))
    model.save_pretrained(str(tmp_path / "hf"))
    src = tmp_path / "hf" / "model.safetensors"
    res = run_cli_args("train", path, "--out", tmp_path / "run", "--init", src)
    assert res.returncode == 2, res.stdout + res.stderr
    err = res.stderr.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in res.stderr, res.stderr
    assert "tensor 'transformer.h.0.mlp.c_fc.weight' has shape [16, 32], this net expects " \
           "[16, 64]" in err[0], err[0]
    assert "--init-skip b0_fc" in err[0]


@pytest.mark.parametrize("change,said", [
    (lambda net: net[3].update(bias_term=False),
     "layer 'b0_attn' has no bias (bias_term: false)"),
    (lambda net: net[2].update(eps=1e-6), "layer_norm's eps differs between layers"),
    (lambda net: net[-2].pop("tie_weight"), "layer 'lm_head' is not tied to the embedding"),
    (lambda net: net[3].update(causal=False), "layer 'b0_attn' is not causal"),
])
def test_export_hf_refuses_what_gpt2_cannot_express(trained, tmp_path, change, said):
    _, cfg, _, weights = trained
    net = _net()
    change(net)
    path = write_config_file(tmp_path, dict(cfg, net=net))
    # the net is judged before any weight is read
    res = run_cli_here("export", "hf", path, "--weights", weights, "--out", tmp_path / "hf")
    assert res.returncode == 2, res.stdout + res.stderr
    err = res.stderr.strip().splitlines()
    assert len(err) == 1 and "GPT-2 (GPT2Config) cannot express this net" in err[0], err
    assert said in err[0], err[0]
    assert not (tmp_path / "hf").exists()

"""Trust audit of the interop (ONNX export, Hugging Face GPT-2 export and
import, Caffe prototxt conversion) against independent references:
onnxruntime runs the exported model at a batch other than the export's,
transformers' GPT2LMHeadModel loads our export and writes a model we import,
Caffe's loss_weight semantics. All in-process, small nets."""
import copy
import os

import numpy as np
import pytest
import yaml

from purine_mpi.base.errors import UserError
from purine_mpi.interop.caffe_convert import convert
from purine_mpi.interop.prototxt import PrototxtError
from purine_mpi.job.checkpoint_file import save_checkpoint
from purine_mpi.job.replica import forward_graph
from purine_mpi.runtime.dispatcher import SerialDispatcher

from .conftest import make_job
from .gpt_nets import gpt_config, text_h5
from .test_caffe_convert import random_h5

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing from the network, ever


def _values(graph, seed):
    """Random float32 values of every parameter (running variances > 0)."""
    rng = np.random.default_rng(seed)
    out = {}
    for b in graph.params():
        v = rng.standard_normal(b.shape).astype(np.float32) * 0.5
        out[b.name] = np.abs(v) + 0.5 if b.name.endswith("running_var") else v
    return out


def _forward(config, batch, values):
    """Our test-phase forward pass of ``config`` at test batch ``batch``:
    the dispatcher's workspace after one run."""
    config = copy.deepcopy(config)
    config["data"]["test"]["batch_size"] = batch
    job = make_job(config)
    d = SerialDispatcher(forward_graph(job, "test", job.data.test))
    for b in d.graph.params():
        d.workspace.set(b.name, values[b.name])
    d.run(0)
    return d.workspace


# --------------------------------------------------------------------- ONNX
def _layer(kind, name, bottom, top, **keys):
    return dict(type=kind, name=name, bottom=bottom, top=top, **keys)


def _conv(name, bottom, channels=4, **keys):
    return _layer("conv", name, bottom, name, num_output=channels, **dict({"kernel": 1}, **keys))


_HEAD = [_layer("fc", "fc", "head_in", "fc", num_output=3),
         {"type": "softmax_loss", "name": "loss", "bottom": ["fc", "label"], "top": "loss"}]

# every exportable layer type with its unusual options, on (2, 7, 6) inputs
ONNX_NETS = {
    "conv_pool": [
        _conv("c", "data", kernel=3, pad=2, group=2, dilation=2, stride=2),
        _layer("pool", "ave", "c", "ave", pool="ave", kernel=3, stride=2, pad=1, ceil_mode=True),
        _layer("pool", "max", "c", "max", pool="max", kernel=3, stride=2, pad=1, ceil_mode=True),
        _layer("pool", "ave2", "c", "ave2", pool="ave", kernel=2, stride=3, ceil_mode=True),
        _layer("pool", "g", "c", "g", pool="max", **{"global": True}),
        _layer("global_pool", "ga", "c", "ga"),
        _layer("concat", "gg", ["g", "ga"], "gg"),
        _layer("eltwise", "sum", ["ave", "max"], "sum", coeff=[0.5, -2.0]),
        _layer("flatten", "f1", "sum", "f1"), _layer("flatten", "f2", "ave2", "f2"),
        _layer("flatten", "f3", "gg", "f3"),
        _layer("concat", "head_in", ["f1", "f2", "f3"], "head_in")],
    "lrn_bn": [
        _conv("c", "data", channels=6),
        _layer("lrn", "across", "c", "across", local_size=3, alpha=0.5, beta=0.6, k=2.0),
        _layer("lrn", "within", "c", "within", local_size=3, alpha=0.5, beta=0.6, k=2.0,
               norm_region="within_channel"),
        _layer("batch_norm", "bn", "across", "bn", eps=1e-3, moving_average_fraction=0.9),
        _layer("relu", "leaky", "bn", "leaky", negative_slope=0.1),
        _layer("dropout", "drop", "within", "drop", ratio=0.3),
        _layer("eltwise", "prod", ["leaky", "drop", "c"], "prod", operation="prod"),
        _layer("eltwise", "head_in", ["prod", "c"], "head_in", operation="max")],
    "axes": [
        _conv("c", "data"), _conv("d", "data"),
        _layer("softmax", "s2", "c", "s2", axis=2), _layer("sigmoid", "sig", "d", "sig"),
        _layer("tanh", "th", "s2", "th"), _layer("softmax", "s3", "th", "s3", axis=3),
        _layer("concat", "cat2", ["s3", "sig"], "cat2", axis=2),
        {"type": "slice", "name": "sl", "bottom": "cat2", "top": ["a", "b"],
         "slice_point": [1]},
        {"type": "split", "name": "sp", "bottom": "b", "top": ["b1", "b2"]},
        _layer("eltwise", "bb", ["b1", "b2"], "bb"),
        _layer("concat", "ab", ["a", "bb"], "ab"),
        _layer("reshape", "rs", "ab", "rs", shape=[0, -1, 2]),
        _layer("flatten", "fl", "rs", "fl", axis=1),
        _layer("fc", "fc2", "c", "fc2", num_output=3, axis=2),
        _layer("flatten", "f2", "fc2", "f2"),
        _layer("concat", "head_in", ["fl", "f2"], "head_in"),
        # axis 0 of this output is twice the batch: a free dim, not the batch's
        _layer("concat", "twice", ["c", "d"], "twice", axis=0)],
}


@pytest.mark.parametrize("net", sorted(ONNX_NETS))
def test_onnxruntime_equals_our_forward_at_other_batches(net):
    """The model exported at batch 3 (a free batch dim, and --batch 3 / 5)
    under onnxruntime at batch 5 gives our forward's outputs at batch 5
    within 1e-5 of their largest value. Before, an output whose axis 0 is
    not the batch (a concat along axis 0) was declared of the batch's size
    (this test printed 'AssertionError: (None, ['batch', 4, 7, 6])'); with
    --batch, ONNX's strict shape inference refused the model ('Inferred
    shape and existing shape differ in dimension 0: (6) vs (3)'), so export
    exited 2 calling it an exporter bug."""
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    from purine_mpi.interop.onnx_export import build_model
    shape = {"source": "synthetic", "shape": [2, 7, 6], "classes": 3}
    config = {"name": net, "seed": 1, "net": ONNX_NETS[net] + _HEAD,
              "data": {"train": dict(shape, batch_size=3), "test": dict(shape, batch_size=3)}}
    job = make_job(copy.deepcopy(config))
    graph = forward_graph(job, "test", job.data.test)
    values = _values(graph, 0)
    ours = _forward(config, 5, values)
    for batch in (None, 3, 5):
        model = build_model(graph, values, net, batch)
        onnx.checker.check_model(model)
        onnx.shape_inference.infer_shapes(model, strict_mode=True)
        outputs = [o.name for o in model.graph.output]
        assert "fc" in outputs
        if net == "axes":
            dims = [d.dim_value or d.dim_param for d in
                    model.graph.output[outputs.index("twice")].type.tensor_type.shape.dim]
            assert dims == [6 if batch == 3 else "", 4, 7, 6], (batch, dims)
        if batch == 3:
            continue  # a fixed batch of 3 takes batches of 3 only
        session = ort.InferenceSession(model.SerializeToString())
        for name, got in zip(outputs, session.run(outputs, {"data": np.array(ours["data"])})):
            want = np.array(ours[name])
            assert got.shape == want.shape, name
            assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max(), name


def test_reshape_to_a_fixed_first_axis_needs_the_configs_batch():
    """A reshape to shape [3, -1] of a batch of 3 mixes the samples of any
    other batch: exported with a free batch (or --batch 5) it is refused
    naming the layer; with --batch 3 it is exported and equals our forward.
    Before, the free-batch model ran at batch 6 and gave a (3, 64) output
    declared (batch, 32), onnxruntime only warning ('DID NOT RAISE')."""
    pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    from purine_mpi.interop.onnx_export import build_model
    shape = {"source": "synthetic", "shape": [1, 4, 4], "classes": 3}
    net = [_conv("c", "data", channels=2),
           _layer("reshape", "rs", "c", "rs", shape=[3, -1]),
           _layer("softmax", "sm", "rs", "sm"),
           _layer("reshape", "head_in", "c", "head_in", shape=[0, -1])] + _HEAD
    config = {"name": "rs", "seed": 1, "net": net,
              "data": {"train": dict(shape, batch_size=3), "test": dict(shape, batch_size=3)}}
    job = make_job(copy.deepcopy(config))
    graph = forward_graph(job, "test", job.data.test)
    values = _values(graph, 0)
    for batch, said in ((None, "a free batch"), (5, "--batch 5")):
        with pytest.raises(UserError, match=rf"layer 'rs' reshapes to a fixed first axis of 3 "
                                            rf"\(shape \[3, -1\]\): with {said} .* write 0 "
                                            rf"there .* or export with --batch 3"):
            build_model(graph, values, "rs", batch)
    model = build_model(graph, values, "rs", 3)
    ours = _forward(config, 3, values)
    (sm,) = ort.InferenceSession(model.SerializeToString()).run(
        ["sm"], {"data": np.array(ours["data"])})
    np.testing.assert_allclose(sm, np.array(ours["sm"]), rtol=1e-5, atol=1e-7)


def test_export_onnx_of_a_graph_config_is_refused(tmp_path):
    """A config of a `graph:` (no net: list) has no test phase to export:
    exit 2 naming the key, nothing written. Before, export wrote a model of
    0 nodes and no outputs and said so as a success ('DID NOT RAISE')."""
    pytest.importorskip("onnx")
    import h5py
    from purine_mpi.interop.onnx_export import export_onnx
    spec = {"source": "synthetic", "shape": [3], "classes": 2, "batch_size": 4}
    job = make_job({"name": "g", "data": {"train": spec, "test": spec}, "graph": [
        {"type": "blob", "name": "x", "size": [4, 3]},
        {"type": "blob", "name": "y", "size": [4, 3]},
        {"type": "op", "name": "act", "op_type": "Relu", "inputs": ["x"], "outputs": ["y"]}]})
    with h5py.File(tmp_path / "w.h5", "w") as f:
        f.create_group("params")
    with pytest.raises(UserError, match=r"key 'graph': export onnx writes the test phase of "
                                        r"a net: list"):
        export_onnx(job, str(tmp_path / "w.h5"), str(tmp_path / "m.onnx"))
    assert not (tmp_path / "m.onnx").exists()


# ---------------------------------------------------------- Hugging Face GPT-2
@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    return text_h5(tmp_path_factory.mktemp("trust_interop"))


def _gpt(tokens, **change):
    """A 2-block GPT (width 16, 8 tokens) with ``change`` on its layers
    (attention: fused, heads; gelu: approximate; layer_norm: eps)."""
    config = gpt_config(tokens, heads=change.get("heads", 4))
    for layer in config["net"]:
        if layer["type"] == "attention":
            layer["fused"] = change.get("fused", True)
            layer["attn_dropout"] = change.get("attn_dropout", 0.0)
        if layer["type"] == "gelu":
            layer["approximate"] = change.get("approximate", "tanh")
        if layer["type"] == "layer_norm":
            layer["eps"] = change.get("eps", 1e-5)
    return config


def _hf_stack():
    """(torch, transformers); the test skips without them or safetensors."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("safetensors.numpy")
    return torch, transformers


def _random_gpt2(transformers, **config):
    """A GPT2LMHeadModel of a small random GPT2Config: vocabulary 256, 8
    positions, width 16, 2 layers; ``config`` adds to it or replaces."""
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        **{"vocab_size": 256, "n_positions": 8, "n_embd": 16, "n_layer": 2, **config}))


def _save_pretrained(model, tmp_path):
    """``model`` saved by transformers into tmp_path/hf: its model.safetensors."""
    model.save_pretrained(str(tmp_path / "hf"))
    return str(tmp_path / "hf" / "model.safetensors")


def _hf_logits(model, ids):
    import torch
    model.eval()
    with torch.no_grad():
        return model(torch.from_numpy(ids.astype(np.int64))).logits.numpy()


@pytest.mark.parametrize("change", [
    {"fused": False, "attn_dropout": 0.1},
    {"approximate": "none", "eps": 1e-3, "heads": 2}])
def test_export_hf_logits_generate_and_round_trip(tokens, tmp_path, change):
    """export hf -> GPT2LMHeadModel: its logits are ours within 1e-5 (of
    the largest), its greedy generate draws our generate's tokens, and
    export -> --init's reading gives our params bit for bit. Before, the
    raw attention (fused: false) was refused by export hf and by --init:
    'the net is not GPT-2's structure: after layer 'b0_attn' GPT-2 has the
    attention's softmax, this net has layer 'b0_attn' (AttentionContext)'
    (the walk dropped every Softmax as if it read the head's logits)."""
    torch, transformers = _hf_stack()
    from purine_mpi.interop.hf_gpt2 import export_hf, hf_params
    from purine_mpi.tools.generate import Generator
    config = _gpt(tokens, **change)
    job = make_job(copy.deepcopy(config))
    values = _values(forward_graph(job, "test", job.data.test), 1)
    weights = save_checkpoint(tmp_path / "w.h5", values, config_text=yaml.safe_dump(config))
    export_hf(job, weights, str(tmp_path / "hf"))
    model = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf"))
    ours = _forward(config, 3, values)
    want = np.array(ours["logits"])
    got = _hf_logits(model, np.array(ours["data"]))
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    drawn = list(Generator(job, weights).generate("ab", 5, temperature=0))
    hf = model.generate(torch.tensor([list(b"ab")]), max_new_tokens=5, do_sample=False,
                        pad_token_id=0)
    assert drawn == hf[0, 2:].tolist()
    back, note = hf_params(str(tmp_path / "hf" / "model.safetensors"), job)
    assert note is None and sorted(back) == sorted(values)
    for name, value in back.items():
        assert value.dtype == values[name].dtype and value.tobytes() == values[name].tobytes()


def test_export_hf_carries_the_subword_vocabulary(tokens, tmp_path):
    """A run on a byte-level BPE of 300 tokens (its vocabulary in the
    checkpoint): export hf writes tokenizer.json, which transformers'
    AutoTokenizer loads with our ids for a text, and GPT2LMHeadModel's
    greedy generate, decoded by it, is the text of our generate. Before,
    the folder held no vocabulary (the test printed "assert 'its vocabulary
    in tokenizer.json' in '28 tensors, GPT-2 of 2 layers, ... loads it'")."""
    torch, transformers = _hf_stack()
    pytest.importorskip("tokenizers")
    from purine_mpi.data.tokenizer import Vocabulary, train_bpe
    from purine_mpi.interop.hf_gpt2 import export_hf
    from purine_mpi.tools.generate import Generator
    import json as json_module
    vocabulary = train_bpe([json_module.__doc__ * 3], 300).to_str()
    config = _gpt(tokens)
    for layer in config["net"]:
        if layer["type"] == "embedding":
            layer["input_dim"] = 300
        if layer["name"] == "lm_head":
            layer["num_output"] = 300
    job = make_job(copy.deepcopy(config))
    values = _values(forward_graph(job, "test", job.data.test), 2)
    weights = save_checkpoint(tmp_path / "w.h5", values, config_text=yaml.safe_dump(config),
                              tokenizer=vocabulary)
    line = export_hf(job, weights, str(tmp_path / "hf"))
    assert "its vocabulary in tokenizer.json" in line, line
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    text = 'Encode a "JSON" object:\n    {"a": [1, 2]}'
    ours = Vocabulary(vocabulary)
    assert tokenizer(text)["input_ids"] == ours.encode(text)
    drawn = list(Generator(job, weights).generate("JSON", 4, temperature=0))
    model = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf"))
    prompt = ours.encode("JSON")
    hf = model.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False,
                        pad_token_id=0)[0, len(prompt):].tolist()
    assert hf == drawn and tokenizer.decode(hf) == ours.decode(drawn)


def test_init_from_a_transformers_gpt2_and_its_config(tokens, tmp_path):
    """A GPT2LMHeadModel of a random GPT2Config (2 heads, eps 1e-6, exact
    GELU, n_inner from n_embd) saved by transformers: read into a net of
    those settings, our forward gives its logits within 1e-5. The same
    folder read into a net of 4 heads (tensors of the same shapes) is
    refused naming n_head; before, it loaded and computed another model
    (the test printed 'DID NOT RAISE')."""
    torch, transformers = _hf_stack()
    from purine_mpi.interop.hf_gpt2 import hf_params
    torch.manual_seed(5)
    model = _random_gpt2(transformers, n_head=2, activation_function="gelu",
                         layer_norm_epsilon=1e-6)
    with torch.no_grad():  # layer norms and biases off their init, so a mix-up shows
        for name, p in model.named_parameters():
            if "ln_" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    path = _save_pretrained(model, tmp_path)
    config = _gpt(tokens, heads=2, approximate="none", eps=1e-6)
    values, note = hf_params(path, make_job(copy.deepcopy(config)))
    assert note is None
    ours = _forward(config, 3, values)
    want = _hf_logits(model, np.array(ours["data"]))
    got = np.array(ours["logits"])
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    with pytest.raises(UserError, match=r"config.json describes another GPT-2 than this net "
                                        r"computes: n_head 2, this net has num_heads 4"):
        hf_params(path, make_job(_gpt(tokens, heads=4, approximate="none", eps=1e-6)))
    with pytest.raises(UserError, match=r"activation_function 'gelu', this net's gelu has "
                                        r"approximate: tanh; layer_norm_epsilon 1e-06, this "
                                        r"net has layer_norm eps 1e-05"):
        hf_params(path, make_job(_gpt(tokens, heads=2)))


def test_init_of_an_untied_gpt2_needs_an_untied_head(tokens, tmp_path):
    """A GPT2LMHeadModel of tie_word_embeddings false stores its own
    lm_head.weight: read into our net with a tied head it is refused naming
    the tensor (before, the head was dropped without a word and the net
    computed the embedding's logits: 'DID NOT RAISE'); into a net whose head
    has its own weight, our logits are transformers' within 1e-5."""
    torch, transformers = _hf_stack()
    from purine_mpi.interop.hf_gpt2 import hf_params
    torch.manual_seed(6)
    model = _random_gpt2(transformers, n_head=4, tie_word_embeddings=False)
    path = _save_pretrained(model, tmp_path)
    with pytest.raises(UserError, match=r"its lm_head.weight is not its transformer.wte.weight "
                                        r".* this net's head is tied to the embedding"):
        hf_params(path, make_job(_gpt(tokens)))
    config = _gpt(tokens)
    for layer in config["net"]:
        if layer["name"] == "lm_head":
            del layer["tie_weight"]
    values, note = hf_params(path, make_job(copy.deepcopy(config)))
    assert note is None
    ours = _forward(config, 3, values)
    want = _hf_logits(model, np.array(ours["data"]))
    got = np.array(ours["logits"])
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def test_init_of_a_bfloat16_gpt2(tokens, tmp_path):
    """A GPT2LMHeadModel saved in bfloat16 (as models on the Hub often are):
    every tensor is read as torch widens it to float32, bit for bit, and our
    logits are the float32 model's within 1e-5. Before, the file was
    refused: "is not a safetensors file numpy can read (TypeError: data
    type 'bfloat16' not understood)"."""
    torch, transformers = _hf_stack()
    from purine_mpi.interop.hf_gpt2 import hf_params
    torch.manual_seed(7)
    model = _random_gpt2(transformers, n_head=4).to(torch.bfloat16)
    config = _gpt(tokens)
    values, _ = hf_params(_save_pretrained(model, tmp_path), make_job(copy.deepcopy(config)))
    state = {k: v.float().numpy() for k, v in model.state_dict().items()}
    assert values["wte/weight"].tobytes() == state["transformer.wte.weight"].tobytes()
    assert values["b1_fc/weight"].tobytes() == \
        np.ascontiguousarray(state["transformer.h.1.mlp.c_fc.weight"].T).tobytes()
    ours = _forward(config, 3, values)
    want = _hf_logits(model.float(), np.array(ours["data"]))
    got = np.array(ours["logits"])
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


# -------------------------------------------------------------------- Caffe
_LOSS_WEIGHT = """name: "lw"
layer { name: "data" type: "HDF5Data" top: "data" top: "label"
        hdf5_data_param { source: "x" batch_size: 4 } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" loss_weight: %s
        inner_product_param { num_output: 3 } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss"
        loss_weight: 2 }
"""


def test_caffe_loss_weight_on_a_layer_that_is_not_a_loss(tmp_path):
    """Caffe adds loss_weight x the sum of any layer's top to the loss: a
    non-zero one on an InnerProduct is refused at its line (before, it was
    dropped without a word: 'DID NOT RAISE'); 0 there, and the
    SoftmaxWithLoss's own, convert as before."""
    data = random_h5(tmp_path / "d.h5", (2, 3, 3), 3)
    net = tmp_path / "lw.prototxt"
    net.write_text(_LOSS_WEIGHT % "0.5")
    with pytest.raises(PrototxtError, match=r"lw.prototxt:4: layer 'ip' \(type InnerProduct\): "
                                            r"loss_weight 0.5 on a layer that is not a loss"):
        convert(str(net), data_path=data)
    net.write_text(_LOSS_WEIGHT % "0")
    config, _ = convert(str(net), data_path=data)
    assert [layer.get("loss_weight") for layer in config["net"]] == [None, 2.0]


_OWN_PHASE = """name: "ph"
layer { name: "data" type: "HDF5Data" top: "data" top: "label"
        hdf5_data_param { source: "x" batch_size: 4 } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
        inner_product_param { num_output: 3 } }
layer { name: "act" type: "%s" bottom: "ip" top: "ip" phase: TEST }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""


def test_caffe_layer_own_phase_is_a_mode_not_a_filter(tmp_path):
    """Caffe builds a layer with its own `phase: TEST` (not `include {
    phase: TEST }`) into both nets, computed as in testing (net.cpp sets a
    layer's phase only where it has none). A ReLU computes alike in both:
    it stays in the training net (before, it was converted as test-only and
    the net trained without it: "assert 'test' is None"); a Dropout would
    be identity in Caffe's training net: refused at its line."""
    data = random_h5(tmp_path / "d.h5", (2, 3, 3), 3)
    net = tmp_path / "ph.prototxt"
    net.write_text(_OWN_PHASE % "ReLU")
    config, notes = convert(str(net), data_path=data)
    relu = next(layer for layer in config["net"] if layer["name"] == "act")
    assert relu.get("phase") is None
    assert any("its phase: TEST is Caffe's mode of computation, not a filter: the layer is in "
               "both nets" in note for note in notes), notes
    net.write_text(_OWN_PHASE % "Dropout")
    with pytest.raises(PrototxtError, match=r"ph.prototxt:6: layer 'act' \(type Dropout\): "
                                            r"phase: TEST \(the layer's own field, not include "
                                            r"\{ phase \}\) makes Caffe compute it as in "
                                            r"testing in the train net too"):
        convert(str(net), data_path=data)


def test_generate_top_k_and_top_p_keep_what_transformers_keeps():
    """``generate --top-k K --top-p P`` against transformers' own warpers
    (TemperatureLogitsWarper, TopKLogitsWarper, then TopPLogitsWarper,
    the order of its ``generate``): on random scores, the tokens a draw
    may give and their probabilities are transformers' softmax of the
    warped scores."""
    import torch
    from transformers.generation.logits_process import (TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)

    from purine_mpi.tools.generate import distribution
    rng = np.random.default_rng(4)
    for case in range(40):
        scores = rng.standard_normal(50) * (0.5 + case % 4)
        temperature = (0.7, 1.0, 1.6)[case % 3]
        top_k = (None, 5, 20, 49)[case % 4]
        top_p = (0.05, 0.3, 0.6, 0.9, 0.999)[case % 5]
        warped = torch.tensor(scores[None, :], dtype=torch.float64)
        ids = torch.zeros((1, 1), dtype=torch.long)
        warpers = [TemperatureLogitsWarper(temperature)] + \
            ([TopKLogitsWarper(top_k)] if top_k else []) + [TopPLogitsWarper(top_p)]
        for warper in warpers:
            warped = warper(ids, warped)
        want = torch.softmax(warped, dim=-1)[0].numpy()
        got = distribution(scores, temperature, top_k, top_p)
        assert np.array_equal(got > 0, want > 0), (case, np.flatnonzero(got), np.flatnonzero(want))
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15, err_msg=str(case))

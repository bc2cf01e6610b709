"""An Eltwise sum's gradient for an input of coefficient 1 is dy itself, no
copy (issue 45; ops/tensor.py ``_eltwise_grad``, graph/grad.py
``GradContext.share``): the graph has no EltwiseGrad for such an input,
and training gives the same bits as with the copies.

The reference is the code before: ``GradContext.shareable`` answering no
makes every gradient a copy again (``_copies``), through the same
gradient rule; the weights after a few steps are compared bit for bit."""
import numpy as np
import pytest

from purine_mpi.graph import Graph
from purine_mpi.graph.grad import GradContext, build_backward
from purine_mpi.runtime.dispatcher import SerialDispatcher
from tests.conftest import MPIEXEC, REPO, make_job, train_here, write_config_file
from tests.gpt_nets import gpt_config, text_h5
from tests.test_micro_batches import _params


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    return text_h5(tmp_path_factory.mktemp("share_tokens"))


def _copies(m):
    """The code before: every Eltwise sum's gradient a copy (EltwiseGrad)."""
    m.setattr(GradContext, "shareable", lambda self, blob, grad: False)


def _same_bits(a, b):
    assert sorted(a) == sorted(b) and a
    for name in a:
        x, y = np.asarray(a[name]), np.asarray(b[name])
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert x.tobytes() == y.tobytes(), name


# ------------------------------------------------------------ the graph
def _graph(coeff=None, inputs=("h", "k")):
    """p, q (params) -> h = 2p, k = -3q (Scale) -> y = Eltwise sum of
    ``inputs`` (names among h, k, p) -> loss = sum(y * w); also h read by
    a second Scale into the loss (h gets two contributions)."""
    g = Graph("share")
    for name in ("p", "q"):
        g.add_blob(name, (3, 4), "float32", kind="param")
    g.add_op("hs.fwd", "Scale", ["p"], ["h"], {"scale": 2.0})
    g.add_op("ks.fwd", "Scale", ["q"], ["k"], {"scale": -3.0})
    attrs = {"operation": "sum"} if coeff is None else {"operation": "sum", "coeff": coeff}
    g.add_op("add.fwd", "Eltwise", list(inputs), ["y"], attrs)
    g.add_op("h2.fwd", "Scale", ["h"], ["h2"], {"scale": 0.5})
    g.add_blob("w", (3, 4), "float32")
    g.add_blob("w2", (3, 4), "float32")
    g.add_op("loss.fwd", "WeightedSum", ["y", "w"], ["loss"])
    g.add_op("loss2.fwd", "WeightedSum", ["h2", "w2"], ["loss2"])
    g.infer_shapes()
    grads = build_backward(g, {"loss": 1.0, "loss2": 1.0})
    g.infer_shapes().validate()
    return g, grads


def _run(g, grads, values):
    d = SerialDispatcher(g)
    for name, v in values.items():
        d.workspace.set(name, v)
    d.run()
    return {p: np.array(d.workspace[gname]) for p, gname in grads.items()}


def _values():
    rng = np.random.default_rng(5)
    return {n: rng.standard_normal((3, 4)).astype(np.float32) for n in ("p", "q", "w", "w2")}


def _eltwise_grads(g):
    return sorted((op.attrs["index"], op.outputs[0]) for op in g.ops.values()
                  if op.op_type == "EltwiseGrad")


@pytest.mark.parametrize("coeff,inputs,copied", [
    (None, ("h", "k"), []),              # a residual add: both gradients are dy
    ([1.0, 1.0], ("h", "k"), []),        # coefficients given, all 1
    ([1.0, 0.5], ("h", "k"), [1]),       # 0.5 * dy rounds: its copy stays
    (None, ("h", "p"), [1]),             # a parameter's gradient keeps its copy
    (None, ("h", "h"), []),              # an input listed twice: Sum(dy, dy)
])
def test_a_coefficient_1_input_takes_dy_itself_and_the_same_gradients(monkeypatch, coeff,
                                                                      inputs, copied):
    """No EltwiseGrad for an activation of coefficient 1 (the others keep
    theirs), h's two contributions summed in the same order, and the
    gradients bit for bit those of the copies and equal to the closed form
    (dL/dp = 2 (c_h w + 0.5 w2) [+ c_p w], dL/dq = -3 c_k w)."""
    g, grads = _graph(coeff, inputs)
    dy = g.ops["add.fwd"].outputs[0] + ".grad"
    assert [i for i, _ in _eltwise_grads(g)] == copied
    # h's contributions in the order of the copies': h2's (its consumer
    # last in the forward, first in the backward), then the add's (dy
    # itself, once per occurrence)
    shared = [dy] * sum(1 for i, x in enumerate(inputs) if x == "h" and i not in copied)
    assert g.ops["h.grad_sum"].inputs == ["h.grad@h2"] + shared
    if "k" in inputs and 1 not in copied:   # k's gradient is dy: its Scale reads it
        assert g.ops["ks.bwd.scale"].inputs == [dy]
    with monkeypatch.context() as m:
        _copies(m)
        ref, ref_grads = _graph(coeff, inputs)
    assert len(_eltwise_grads(ref)) == sum(1 for x in inputs if x in ("h", "k", "p"))
    values = _values()
    got, want = _run(g, grads, values), _run(ref, ref_grads, values)
    _same_bits(got, want)
    c = [1.0, 1.0] if coeff is None else coeff
    w, w2 = values["w"].astype(np.float64), values["w2"].astype(np.float64)
    ch = sum(ci for ci, x in zip(c, inputs) if x == "h")
    ck = sum(ci for ci, x in zip(c, inputs) if x == "k")
    cp = sum(ci for ci, x in zip(c, inputs) if x == "p")
    np.testing.assert_allclose(got["p"], 2 * (ch * w + 0.5 * w2) + cp * w, rtol=1e-6)
    if "q" in got:
        np.testing.assert_allclose(got["q"], -3 * ck * w, rtol=1e-6)


def test_the_gpt_graph_has_no_residual_copy_and_fewer_gradient_blobs(tokens, monkeypatch):
    """The tiny GPT's training graph: no EltwiseGrad (the code before: one
    per input of each residual add, four a block), each residual add's
    branch reads dy itself (``x1.grad`` is read by block 0's projection),
    and the gradient blobs fewer by one per copy."""
    from purine_mpi.tools.graph import compose_for
    job = make_job(gpt_config(tokens))

    def count(graph, op_type):
        return sum(1 for op in graph.ops.values() if op.op_type == op_type)

    g = compose_for(job, 1, 0)
    assert count(g, "EltwiseGrad") == 0
    with monkeypatch.context() as m:
        _copies(m)
        ref = compose_for(job, 1, 0)
    assert count(ref, "EltwiseGrad") == 8
    assert len(g.ops) == len(ref.ops) - 8
    grads = [n for n, b in g.blobs.items() if b.kind == "grad"]
    assert len(grads) == len([n for n, b in ref.blobs.items() if b.kind == "grad"]) - 8
    readers = {op.name for op in g.ops.values() if "x1.grad" in op.inputs}
    assert "b0_proj.bwd.inner_product_grad_data" in readers, readers
    assert not any(n.startswith("b0_m.grad") for n in g.blobs)


# ------------------------------------------------------ training, bitwise
def _cnn(path, iters=4):
    """A small CNN with residual adds: a1 = relu(conv(data)); s0 = a1 + z,
    z a frozen conv of the data (no gradient); s1 = relu(conv(s0) + z);
    s2 = s1 + relu(conv(s1)) (coefficients 1 and 1) -> pool -> fc. a1's
    gradient is s0's, written by conv c2's data gradient and read by r1's
    gradient alone: on a device the pair fuses (parallel/fuse.py
    ``fuse_dgrad_relu``), which the copy prevented."""
    conv = {"type": "conv", "num_output": 4, "kernel": 3, "pad": 1}
    return {
        "name": "res_cnn", "seed": 5,
        "data": {"train": {"source": "hdf5", "path": path, "split": "train",
                           "batch_size": 8, "shuffle": True}},
        "net": [
            dict(conv, name="c1", bottom="data", top="a1"),
            {"type": "relu", "name": "r1", "bottom": "a1", "top": "a1"},
            dict(conv, name="c0", bottom="data", top="z",
                 param=[{"lr_mult": 0}, {"lr_mult": 0}]),
            {"type": "eltwise", "name": "res0", "bottom": ["a1", "z"], "top": "s0"},
            dict(conv, name="c2", bottom="s0", top="a2"),
            {"type": "eltwise", "name": "res1", "bottom": ["a2", "z"], "top": "s1"},
            {"type": "relu", "name": "r2", "bottom": "s1", "top": "s1"},
            dict(conv, name="c3", bottom="s1", top="a3"),
            {"type": "relu", "name": "r3", "bottom": "a3", "top": "a3"},
            {"type": "eltwise", "name": "res2", "bottom": ["s1", "a3"], "top": "s2",
             "coeff": [1.0, 1.0]},
            {"type": "pool", "name": "pool", "bottom": "s2", "top": "p", "pool": "max",
             "kernel": 2, "stride": 2},
            {"type": "fc", "name": "fc", "bottom": "p", "top": "fc", "num_output": 10},
            {"type": "softmax_loss", "name": "loss", "bottom": ["fc", "label"], "top": "loss"},
        ],
        "solver": {"base_lr": 0.05, "momentum": 0.9, "weight_decay": 5e-4,
                   "lr_policy": "fixed", "max_iter": iters, "display": 1, "test_interval": 0},
        "checkpoint": {"interval": 0},
    }


def _gpt(tokens, **extra):
    cfg = gpt_config(tokens, iters=4)
    cfg["data"].pop("test")
    cfg["solver"].update(test_interval=0, clip_gradients=1.0)
    cfg.update(extra)
    return cfg


def _both(tmp_path, monkeypatch, cfg, train):
    new = train(cfg, tmp_path / "shared")
    with monkeypatch.context() as m:
        _copies(m)
        old = train(cfg, tmp_path / "copies")
    return new, old


def _host(cfg, out):
    return _params(train_here(cfg, out) / "latest.h5")


@pytest.mark.parametrize("case", ["gpt", "gpt_micro_recompute", "cnn"])
def test_training_on_the_host_is_bitwise_the_same(tokens, digits_h5, tmp_path, monkeypatch,
                                                 case):
    """Four steps on the host in float32 (AdamW with clipping for the GPT;
    also with two micro-batches and full recompute; SGD for the CNN): the
    weights and solver state bit for bit those of the copies."""
    if case == "cnn":
        cfg = _cnn(digits_h5)
    elif case == "gpt":
        cfg = _gpt(tokens)
    else:
        cfg = _gpt(tokens, recompute="full")
        cfg["parallel"] = {"micro_batches": 2}
    new, old = _both(tmp_path, monkeypatch, cfg, _host)
    _same_bits(new, old)


@pytest.mark.parametrize("case", ["gpt_bf16", "gpt_bf16_micro", "cnn_fp32", "cnn_bf16"])
def test_training_on_the_emulated_device_is_bitwise_the_same(tokens, digits_h5, tmp_path,
                                                            monkeypatch, host_build_dir, case):
    """The trainer on the emulated device (placement, the fuse passes, the
    device arena, CUDA graphs): the GPT in bf16 with bits storage (also
    with two micro-batches), the residual CNN in float32 and bf16 (where a
    ReLU's gradient now fuses into a convolution's data gradient, and in
    bf16 the convolutions' gradients read the bf16 Cast of the shared
    gradient, not of a copy): the weights bit for bit those of the copies."""
    from purine_mpi.base.backend import to_numpy
    from purine_mpi.job.config import validate_config
    from purine_mpi.train.trainer import Trainer, run_and_report
    from tests.conftest import FakeWorld
    from tests.emulated_gpu import emulated_trainer_env
    emulated_trainer_env(monkeypatch, host_build_dir)
    if case.startswith("cnn"):
        cfg = dict(_cnn(digits_h5), device=0, cuda_graph=True, precision=case[4:])
    else:
        cfg = dict(_gpt(tokens), device=0, precision="bf16", cuda_graph=True)
        if case == "gpt_bf16_micro":
            cfg["parallel"] = {"micro_batches": 2}

    def train(cfg, out):
        t = Trainer(make_job(validate_config(cfg, check_files=False)), str(out),
                    world=FakeWorld(), log=lambda line: None)
        ops = t.train.graph.ops.values()   # the device graph the dispatcher runs
        kinds = {op.op_type for op in ops}
        # data gradients with the ReLU's mask fused in (fuse_dgrad_relu)
        masked = sorted(op.name for op in ops if "mask_slope" in op.attrs)
        assert run_and_report(t, FakeWorld()) == 0
        ws = t.train.workspace
        return (kinds, masked), {p: np.array(to_numpy(ws[p])) for p in t.graphs.params}

    ((kinds, masked), new), ((old_kinds, old_masked), old) = _both(tmp_path, monkeypatch, cfg,
                                                                   train)
    assert "EltwiseGrad" not in kinds and "EltwiseGrad" in old_kinds
    if case.startswith("cnn"):   # the fuse the copy prevented, the same bits
        assert masked == ["c2.bwd.conv_grad_data"] and old_masked == []
    _same_bits(new, old)


_OLD_CLI = """import sys
from purine_mpi.graph.grad import GradContext


def copies(self, blob, grad):   # the copies (the code before), each asked noted
    with open(sys.argv[1], "a") as f:
        f.write(blob + "\\n")
    return False


GradContext.shareable = copies
from purine_mpi.cli import main
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.mpi
@pytest.mark.parametrize("parallel", [
    {"scheme": "data"},
    # the shared gradients cross the stages (x1's is read on both), the
    # Sums placed by their Eltwise layer's name (GradContext.grad_of)
    {"scheme": "pipeline", "stages": 2, "micro_batches": 2},
    # the residual stream's gradients read beside the split layers' allreduces
    {"scheme": "tensor", "tensor_parallel": 2},
], ids=["data", "pipeline", "tensor"])
def test_two_rank_training_is_bitwise_the_same(tokens, tmp_path, parallel):
    """``mpiexec -n 2`` data parallelism (the gradient buckets' allreduce),
    a two-stage pipeline of two micro-batches, 2-way tensor parallelism;
    the GPT with clipping: the checkpoint bit for bit that of the copies
    (the same command with ``GradContext.shareable`` answering no)."""
    import subprocess

    from tests.conftest import PYTHON, cli_env
    if MPIEXEC is None:
        pytest.skip("mpiexec not found")
    cfg = write_config_file(tmp_path, _gpt(tokens, parallel=parallel))
    old_cli = tmp_path / "old_cli.py"
    old_cli.write_text(_OLD_CLI)
    out = {}
    asked = tmp_path / "asked.txt"
    for name, entry in (("shared", ["-m", "purine_mpi"]), ("copies", [str(old_cli), asked])):
        res = subprocess.run([MPIEXEC, "-n", "2", PYTHON, *entry, "train", str(cfg),
                              "--out", str(tmp_path / name)], cwd=REPO, env=cli_env(),
                             capture_output=True, text=True, timeout=180)
        assert res.returncode == 0, res.stdout + res.stderr
        out[name] = _params(tmp_path / name / "latest.h5")
    _same_bits(out["shared"], out["copies"])
    assert "b0_a" in asked.read_text().split()   # the copies' run made its copies

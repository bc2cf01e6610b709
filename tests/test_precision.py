"""Mixed precision (issue 45): the ``precision`` key, the precision pass
(parallel/precision.py), bf16/fp16 on the emulated device against
ml_dtypes and PyTorch's CPU autocast, and checkpoints holding the float32
masters."""
import numpy as np
import pytest
import yaml

from purine_mpi.base.errors import ConfigError
from purine_mpi.base.precision import round_to, scratch_spec
from purine_mpi.job.config import validate_config
from purine_mpi.runtime.footprint import live_bytes
from tests.conftest import run_cli_here
from tests.gpt_oracle import gpt_graph, gpt_net

SOLVER = {"type": "adamw", "base_lr": 0.01, "momentum": 0.9, "momentum2": 0.99,
          "weight_decay": 1e-2, "max_iter": 10}


def _raw(**top):
    raw = {"data": {"train": {"source": "synthetic", "shape": [4], "classes": 3,
                              "batch_size": 2}},
           "net": [{"type": "fc", "name": "fc", "bottom": "data", "top": "fc",
                    "num_output": 3},
                   {"type": "softmax_loss", "name": "loss", "bottom": ["fc", "label"]}]}
    raw.update(top)
    return raw


# ------------------------------------------------------------------ rounding
@pytest.mark.parametrize("dtype,ref", [("bfloat16", "bfloat16"), ("float16", "float16")])
def test_rounding_is_ml_dtypes_round_to_nearest_even(dtype, ref):
    ml_dtypes = pytest.importorskip("ml_dtypes")  # the test extra's
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(20000) * np.exp(rng.uniform(-80, 80, 20000))).astype(np.float32)
    x[:5] = [np.inf, -np.inf, np.nan, 3.4e38, -0.0]
    # ties: halfway between two bf16 (fp16) neighbours, both parities
    x[5:9] = np.array([0x3F808000, 0x3F818000, 0xBF808000, 0x3F800001], np.uint32).view(np.float32)
    with np.errstate(over="ignore"):
        want = x.astype(getattr(ml_dtypes, ref) if ref == "bfloat16" else np.float16)
    got = x.copy()
    shape, sdt = scratch_spec(got.shape, dtype)
    with np.errstate(over="ignore"):
        round_to(got, dtype, np.empty(shape, sdt))
        np.testing.assert_array_equal(got, want.astype(np.float32))


# -------------------------------------------------------------------- config
def test_precision_defaults_to_fp32_and_tf32_true_means_precision_tf32():
    assert validate_config(_raw())["precision"] == "fp32"
    out = validate_config(_raw(tf32=True))
    assert out["precision"] == "tf32" and out["tf32"] is True
    out = validate_config(_raw(precision="tf32"))
    assert out["tf32"] is True
    # the resolved config validates again to itself (config.yaml of a run)
    assert validate_config({k: v for k, v in out.items() if k != "_path"})["precision"] == "tf32"


@pytest.mark.parametrize("tf32,precision", [(True, "fp32"), (True, "bf16"), (False, "tf32")])
def test_contradicting_precision_and_tf32_name_both_keys(tf32, precision):
    with pytest.raises(ConfigError) as e:
        validate_config(_raw(tf32=tf32, precision=precision, device=0))
    assert e.value.key == "precision" and "tf32" in str(e.value)
    assert f"precision: {precision}" in str(e.value)


def test_grad_dtype_defaults_to_fp32_and_bf16_is_accepted_where_it_is_built():
    """What grad_dtype: bf16 refuses: tests/test_grad_dtype.py."""
    assert validate_config(_raw())["parallel"]["grad_dtype"] == "fp32"
    assert validate_config(_raw(parallel={"grad_dtype": "bf16"}))["parallel"]["grad_dtype"] \
        == "bf16"
    out = validate_config(_raw(device=0, parallel={"grad_dtype": "bf16", "backend": "nccl"}))
    assert out["parallel"]["grad_dtype"] == "bf16"


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_low_precision_on_the_cpu_exits_2_with_one_line(tmp_path, precision):
    cfg = tmp_path / "p.yaml"
    cfg.write_text(yaml.safe_dump(_raw(precision=precision)))
    proc = run_cli_here("train", cfg, "--out", tmp_path / "run")
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert f"precision: {precision} is a GPU setting" in lines[0] and "device" in lines[0]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    # on a GPU both are accepted (fp16 with its loss scaling: tests/test_loss_scale.py)
    assert validate_config(_raw(precision=precision, device=0))["precision"] == precision


def test_the_pass_in_fp16_rounds_to_float16():
    """The pass and the kernels take fp16 as they take bf16 (the config
    refuses it until loss scaling is built): Cast ops ``@fp16``, GEMM
    outputs rounded to float16."""
    from purine_mpi.parallel.precision import apply_precision
    from purine_mpi.runtime.dispatcher import SerialDispatcher
    net = gpt_net(vocab=16, width=8, heads=2, blocks=1, max_length=6)
    g, _, _ = gpt_graph(net, SOLVER, 2, 6, phase="test")
    apply_precision(g, "fp16")  # on the host: the same kernels, NumPy arrays
    assert g.ops["h0_fc.fwd"].attrs["compute_dtype"] == "float16"
    assert "h0_fc/weight@fp16" in g.ops["h0_fc.fwd"].inputs
    from purine_mpi.layers.fillers import fill
    d = SerialDispatcher(g, seed=0)
    try:
        for p in g.params():
            d.workspace.set(p.name, fill(p, 1))
        d.workspace.set("data", np.arange(12, dtype=np.int32).reshape(2, 6) % 16)
        d.workspace.set("label", np.zeros((2, 6), np.int32))
        d.run(0)
        for blob in ("h0_fc/weight@fp16", "h0_m", "logits"):
            x = np.asarray(d.workspace[blob])
            assert np.array_equal(x, x.astype(np.float16).astype(np.float32)), blob
        n2 = np.asarray(d.workspace["h0_n2"])  # a layer norm's output: float32
        assert not np.array_equal(n2, n2.astype(np.float16).astype(np.float32))
    finally:
        d.close()


# ---------------------------------------------------------------------- pass
def _bf16_gpt_graph(fused_first=True):
    from purine_mpi.parallel.placement import prepare_for_device
    net = gpt_net(vocab=16, width=8, heads=2, blocks=2, max_length=6, approximate="tanh")
    # block 0 fused attention, block 1 the raw sub-graph (scores, softmax, context)
    [a for a in net if a["type"] == "attention"][1]["fused"] = False
    g, _, _ = gpt_graph(net, SOLVER, 2, 6)
    params = [p.name for p in g.params()]
    prepare_for_device(g, 0, precision="bf16")
    return g, params


def test_the_pass_marks_gemms_and_attention_bf16_and_the_rest_fp32():
    from purine_mpi.parallel.precision import LOW_OP_TYPES, dtype_table
    g, params = _bf16_gpt_graph()
    table = dtype_table(g)
    by_type = {}
    for _, op_type, dtype in table:
        by_type.setdefault(op_type, set()).add(dtype)
    low = {t for t, d in by_type.items() if d == {"bf16"}}
    assert low == {"InnerProduct", "InnerProductGradData", "InnerProductGradWeight",
                   "Attention", "AttentionGrad", "AttentionScores", "AttentionScoresGrad",
                   "AttentionContext", "AttentionContextGrad", "Cast"}
    assert low - {"Cast"} <= set(LOW_OP_TYPES)
    for fp32 in ("LayerNorm", "LayerNormGrad", "Softmax", "SoftmaxGrad", "SoftmaxLoss",
                 "SoftmaxLossGrad", "Gelu", "Eltwise", "Sum", "InnerProductGradBias",
                 "Embedding", "EmbeddingGrad", "MultiAdamUpdate", "LearningRate"):
        assert by_type[fp32] == {"fp32"}, fp32
    # master weights stay float32; each weight a GEMM reads has its copy
    # <w>@bf16, made once per iteration from the master -- by the fused
    # AdamW update that writes the master (fold_weight_casts: its output
    # <w>@bf16@new, the copy persistent) -- and read by the forward GEMM and
    # its data gradient
    for p in params:
        assert g.blobs[p].dtype == "float32" and "precision" not in g.blobs[p].attrs
    producers, consumers = g.producers(), g.consumers()
    (update,) = [op for op in g.ops.values() if op.op_type == "MultiAdamUpdate"]
    for w in ("h0_attn/qkv_weight", "h1_fc/weight", "wte/weight"):
        twin = f"{w}@bf16"
        assert g.blobs[twin].attrs["precision"] == "bfloat16"
        assert not producers[twin] and g.blobs[twin].kind == "param_copy"
        assert g.blobs[twin].attrs["copy_of"] == w
        (writer,) = producers[f"{twin}@new"]
        assert writer is update and g.blobs[f"{twin}@new"].alias_of == twin
        assert update.attrs["params"][update.attrs["copy_of"][
            update.outputs.index(f"{twin}@new") - 3]] == w
        readers = sorted(op.op_type for op in consumers[twin])
        assert readers == ["InnerProduct", "InnerProductGradData"], (w, readers)
    # the embedding reads the tied weight's master, the head its copy
    assert "wte/weight" in g.ops["wte.fwd"].inputs
    assert "wte/weight@bf16" in g.ops["lm_head.fwd"].inputs
    # the loss gradient reaches the head's GEMMs rounded
    assert "logits.grad@bf16" in g.ops["lm_head.bwd.inner_product_grad_weight"].inputs
    # no Cast without a low-precision reader, none of a blob twice
    casts = [op for op in g.ops.values() if op.op_type == "Cast"]
    assert len({c.inputs[0] for c in casts}) == len(casts)
    assert all(all(op_precision_of(r) == "bf16" for r in consumers[c.outputs[0]]) for c in casts)


def op_precision_of(op):
    from purine_mpi.base.precision import SHORT
    from purine_mpi.graph.core import op_precision
    return SHORT[op_precision(op)]


def test_fp32_and_tf32_graphs_are_unchanged_and_the_listing_shows_dtypes():
    from purine_mpi.parallel.placement import prepare_for_device
    from purine_mpi.tools.graph import to_dot
    net = gpt_net(vocab=16, width=8, heads=2, blocks=1, max_length=6)
    plain, _, _ = gpt_graph(net, SOLVER, 2, 6)
    prepare_for_device(plain, 0)
    for precision in ("fp32", "tf32"):
        g, _, _ = gpt_graph(net, SOLVER, 2, 6)
        prepare_for_device(g, 0, precision=precision)
        assert g.summary() == plain.summary() and to_dot(g) == to_dot(plain)
    assert "fp32" not in plain.summary()
    g, _ = _bf16_gpt_graph()
    text = g.summary()
    assert "h0_attn.qkv" in text
    line = next(ln for ln in text.splitlines() if ln.strip().startswith("h0_attn.qkv "))
    assert line.rstrip().endswith("bf16)")
    line = next(ln for ln in text.splitlines() if ln.strip().startswith("h0_ln1.fwd "))
    assert line.rstrip().endswith("fp32)")
    dot = to_dot(g)
    qkv = next(ln for ln in dot.splitlines() if ln.startswith('  "o:h0_attn.qkv"'))
    ln1 = next(ln for ln in dot.splitlines() if ln.startswith('  "o:h0_ln1.fwd"'))
    assert "#ffb870" in qkv and "bf16" in qkv and "#ffb870" not in ln1


# ------------------------------------- the copies made in place (memory plan)
def _cast_plan(g):
    """The device plan the trainer lays ``g`` out by, and {source: twin} of
    the Casts it computes in place (the twin on its source's bytes)."""
    from purine_mpi.runtime.factory import memory_plans
    from purine_mpi.runtime.memory_plan import batch_blobs
    _, devices = memory_plans(g, keep=batch_blobs(g))
    plan = devices[0]
    casts = {op.inputs[0]: op.outputs[0] for op in g.ops.values() if op.op_type == "Cast"}
    return plan, casts, {x: y for x, y in casts.items() if y in plan.in_place}


def _check_in_place(g, plan, casts, in_place):
    """Each copy made in place shares its source's bytes and its Cast is the
    last op to touch the source; each other copy of a transient source has
    a reader of the source that runs not before its Cast (a weight's, a
    persistent source's, keeps its own copy)."""
    deps = g.dependencies()
    cast_of = {op.outputs[0]: op.name for op in g.ops.values() if op.op_type == "Cast"}

    def ancestors(name):
        seen, stack = set(), [name]
        while stack:
            for p in deps[stack.pop()] - seen:
                seen.add(p)
                stack.append(p)
        return seen
    for x, y in casts.items():
        cast = cast_of[y]
        readers = [op.name for op in g.ops.values() if x in op.inputs and op.name != cast]
        if x in in_place:
            assert plan.in_place[y] == (x, cast) and plan.offsets[y] == plan.offsets[x]
            assert set(readers) <= ancestors(cast), (x, readers)
        elif g.storage_root(x) in plan.offsets:   # transient: another reader comes later
            assert set(readers) - ancestors(cast), (x, readers)
        else:
            assert g.storage_root(x) in plan.persistent, x


def test_a_copy_whose_source_dies_at_its_cast_is_made_in_place_gpt(monkeypatch):
    """Tiny GPT in bf16 on device 0, float32 storage (PURINE_BF16_STORAGE=0:
    with bf16 storage these copies are bits, 2 bytes an element, on no
    float32 source's bytes, or no copies at all: tests/test_bf16_storage.py):
    the memory plan puts the copy on its
    source's bytes (Cast.in_place) exactly where the Cast is the last op to
    touch a transient source -- the layer norms' outputs, the GELUs', the
    final norm's, the logits' gradient (read by nothing but its Cast), the
    unfused attention's scores gradient. Not the weights' (kept), not the
    activation gradients a float32 bias gradient also reads, not the
    softmax probabilities its gradient reads later."""
    monkeypatch.setenv("PURINE_BF16_STORAGE", "0")
    # the weights' Casts kept (fold_weight_casts off: else their updates
    # write the copies, tests/test_weight_cast_fold.py)
    monkeypatch.setenv("PURINE_FOLD_WEIGHT_CASTS", "0")
    g, params = _bf16_gpt_graph()
    plan, casts, in_place = _cast_plan(g)
    assert sorted(in_place) == sorted([
        "h0_n1", "h0_n2", "h0_m@h0_gelu", "h1_n1", "h1_n2", "h1_m@h1_gelu", "xf",
        "logits.grad", "h1_attn.scores.grad"])
    # h0_x1.grad: the residual add's gradient, which is also h0_a's (no copy:
    # ops/tensor.py _eltwise_grad), which a float32 bias gradient also reads
    for x in ("wte/weight", "h0_fc/weight", "h1_attn/qkv_weight", "h1_attn.probs",
              "h1_m.grad", "h0_x1.grad"):
        assert x in casts and x not in in_place, x
    assert all(p not in in_place for p in params)
    _check_in_place(g, plan, casts, in_place)
    _check_bytes_saved(_bf16_gpt_graph()[0], g, plan, casts, in_place)
    # with the loss's probabilities over the logits and their gradient over
    # the probabilities (SoftmaxLoss, SoftmaxLossGrad in place), one buffer
    # holds the logits, the probabilities, the gradient and its copy
    chain = ["logits", "loss.prob", "logits.grad", "logits.grad@bf16"]
    assert [plan.in_place.get(b, (None,))[0] for b in chain] == [None] + chain[:-1]
    assert len({plan.offsets[b] for b in chain}) == 1


def _live_bytes(plan):
    """The bytes of ``plan``'s blobs live at each position of its schedule
    (a blob computed in place over another counted once: arena_peak's rule)."""
    return live_bytes(plan)


def _check_bytes_saved(fresh, g, plan, casts, in_place):
    """Against the plan of ``fresh`` (the same graph, unplanned) with every
    Cast copying: the same schedule, and where each copy made in place is
    cast the live bytes are fewer by its source's size (both were live
    there); the peak and the arena are no larger."""
    from purine_mpi.ops.basic import Cast
    saved = Cast.in_place
    Cast.in_place = ()
    try:
        copying, _, none = _cast_plan(fresh)
    finally:
        Cast.in_place = saved
    assert not none and copying.order == plan.order
    with_, without = _live_bytes(plan), _live_bytes(copying)
    pos = {n: i for i, n in enumerate(plan.order)}
    for x, y in in_place.items():
        at = pos[plan.in_place[y][1]]
        assert without[at] - with_[at] == plan.sizes[x] == copying.sizes[y], x
    assert max(with_) <= max(without) and plan.total_bytes <= copying.total_bytes


def _bf16_cnn_graph():
    """A small CNN (conv, max pool, relu, conv, relu, ave pool, fc, fc, loss)
    in bf16 placed on device 0."""
    from purine_mpi.graph import Graph
    from purine_mpi.graph.grad import build_backward
    from purine_mpi.graph.solver_graph import add_solver
    from purine_mpi.job.replica import loss_blobs
    from purine_mpi.layers import build_net
    from purine_mpi.parallel.placement import prepare_for_device
    from tests.conftest import make_job
    net = [{"type": "conv", "name": "conv1", "bottom": "data", "top": "conv1", "num_output": 4,
            "kernel": 3, "pad": 1},
           {"type": "pool", "name": "pool1", "bottom": "conv1", "top": "pool1", "pool": "max",
            "kernel": 2, "stride": 2},
           {"type": "relu", "name": "relu1", "bottom": "pool1", "top": "pool1"},
           {"type": "conv", "name": "conv2", "bottom": "pool1", "top": "conv2", "num_output": 4,
            "kernel": 3, "pad": 1},
           {"type": "relu", "name": "relu2", "bottom": "conv2", "top": "conv2"},
           {"type": "pool", "name": "pool2", "bottom": "conv2", "top": "pool2", "pool": "ave",
            "kernel": 2, "stride": 2},
           {"type": "fc", "name": "ip1", "bottom": "pool2", "top": "ip1", "num_output": 6},
           {"type": "fc", "name": "ip2", "bottom": "ip1", "top": "ip2", "num_output": 3},
           {"type": "softmax_loss", "name": "loss", "bottom": ["ip2", "label"], "top": "loss"}]
    job = make_job({"data": {"train": {"source": "synthetic", "shape": [2, 8, 8], "classes": 3,
                                       "batch_size": 2}},
                    "net": [], "solver": {"type": "sgd", "base_lr": 0.1, "momentum": 0.9}},
                   check_files=False)
    g = Graph("cnn")
    g.add_blob("data", (2, 2, 8, 8), "float32", kind="data")
    g.add_blob("label", (2,), "int32", kind="data")
    build_net(net, "train", (g, "<net>"))
    g.infer_shapes()
    add_solver(g, build_backward(g, loss_blobs(g)), job.solver)
    g.infer_shapes().validate()
    params = [p.name for p in g.params()]
    prepare_for_device(g, 0, precision="bf16")
    return g, params


def test_a_copy_whose_source_dies_at_its_cast_is_made_in_place_cnn(monkeypatch):
    """Small CNN in bf16 on device 0, float32 storage (PURINE_BF16_STORAGE=0:
    with bf16 storage the fc layers' operands are bits): in place, the copy
    of the pooled
    activation the fc layer alone reads. Not the weights' copies, not the
    data's (filled by the host, kept), not the ReLU output the ReLU's
    gradient reads later, not the gradients a float32 bias gradient also
    reads (the fc layers' GEMM outputs are bf16 already: no copies)."""
    monkeypatch.setenv("PURINE_BF16_STORAGE", "0")
    g, params = _bf16_cnn_graph()
    plan, casts, in_place = _cast_plan(g)
    assert sorted(casts) == sorted(params + ["data", "pool1@relu1", "pool2", "conv1.grad",
                                             "conv2.grad", "ip2.grad"])
    assert sorted(in_place) == ["pool2"]
    _check_in_place(g, plan, casts, in_place)
    _check_bytes_saved(_bf16_cnn_graph()[0], g, plan, casts, in_place)


# -------------------------------------------- emulated device against torch
def _ours_on_the_emulated_device(monkeypatch, host_build_dir, precision, toks, iters,
                                 blocks=2, cuda_graph=False):
    """Losses of ``iters`` AdamW steps of the 2-block GPT on the emulated
    device at ``precision``, and the initial parameters."""
    from purine_mpi.layers.fillers import fill
    from purine_mpi.parallel.placement import prepare_for_device
    from purine_mpi.runtime.factory import make_dispatcher
    from tests.emulated_gpu import SimulatedRuntime, use_emulated_cupy
    use_emulated_cupy(monkeypatch, host_build_dir)
    net = gpt_net(vocab=16, width=16, heads=2, blocks=blocks, max_length=8, approximate="tanh")
    g, _, _ = gpt_graph(net, dict(SOLVER, max_iter=iters), 2, 8)
    prepare_for_device(g, 0, precision=precision)
    d = make_dispatcher(g, runtime=SimulatedRuntime(1), seed=1, cuda_graph=cuda_graph)
    try:
        init = {}
        for p in g.params():
            init[p.name] = fill(p, 1)
            d.workspace.set(p.name, init[p.name])
        losses = []
        for it in range(iters):
            d.workspace.set("data", toks[it, :, :-1].astype(np.int32))
            d.workspace.set("label", toks[it, :, 1:].astype(np.int32))
            d.workspace["iter"][...] = it
            d.run(it)
            losses.append(float(d.workspace["loss"]))
        return net, losses, init
    finally:
        d.close()


def _torch_autocast_losses(net, init, toks, iters, dtype):
    import torch
    from tests.gpt_oracle import torch_adamw, torch_gpt_from_net
    model, _ = torch_gpt_from_net(net, init)
    opt, sched = torch_adamw(model, dict(SOLVER, max_iter=iters))
    losses = []
    for it in range(iters):
        idx = torch.from_numpy(toks[it, :, :-1].astype(np.int64))
        tgt = torch.from_numpy(toks[it, :, 1:].astype(np.int64))
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            _, loss = model(idx, tgt)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
    return losses


def test_ten_adamw_steps_in_bf16_track_torch_cpu_autocast(host_build_dir, monkeypatch):
    """Our bf16 GPT on the emulated device against PyTorch's
    ``torch.autocast("cpu", dtype=torch.bfloat16)`` from the same weights:
    every step's loss within 2e-2 relative. And the precision is really
    applied: our bf16 losses differ from our fp32 ones (by more than the
    fp32 run differs from PyTorch in fp32)."""
    import torch
    iters = 10
    toks = np.random.default_rng(3).integers(0, 16, (iters, 2, 9))
    net, bf16, init = _ours_on_the_emulated_device(monkeypatch, host_build_dir, "bf16",
                                                   toks, iters)
    _, fp32, _ = _ours_on_the_emulated_device(monkeypatch, host_build_dir, "fp32", toks, iters)
    theirs = _torch_autocast_losses(net, init, toks, iters, torch.bfloat16)
    theirs32 = _torch_autocast_losses(net, init, toks, iters, None)
    np.testing.assert_allclose(bf16, theirs, rtol=2e-2)
    np.testing.assert_allclose(fp32, theirs32, rtol=1e-4)
    assert np.max(np.abs(np.subtract(bf16, fp32))) > 10 * np.max(np.abs(np.subtract(fp32, theirs32)))


# ----------------------------------------------- the trainer, checkpoints
def _train(tmp_path, name, precision, iters, resume=None, interval=0):
    import json
    from tests.conftest import FakeWorld, make_job
    from tests.gpt_nets import gpt_config, text_h5
    from purine_mpi.train.trainer import Trainer, run_and_report
    raw = gpt_config(text_h5(tmp_path), layers=2, width=16, heads=2, length=8, batch=4,
                     iters=iters)
    raw.update(device=0, precision=precision, cuda_graph=False)
    raw["data"].pop("test")
    raw["solver"].update(base_lr=0.01, test_interval=0)
    raw["checkpoint"] = {"interval": interval, "keep": 0}
    out = tmp_path / name
    t = Trainer(make_job(validate_config(raw, check_files=False)), str(out), world=FakeWorld(),
                log=lambda line: None, resume=resume)
    from purine_mpi.base.backend import to_numpy
    t.loaded = {p: np.array(to_numpy(t.train.workspace[p])) for p in t.graphs.params}
    assert run_and_report(t, FakeWorld()) == 0
    rows = [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]
    return t, out, {r["iter"]: r["loss"] for r in rows if r["phase"] == "train"}


BF16_TRACKS_FP32 = 5e-3  # relative, per iteration (measured: 4.6e-4 at most)


def test_a_bf16_run_tracks_fp32_and_resumes_in_fp32_and_back(host_build_dir, monkeypatch,
                                                             tmp_path):
    """The trainer on the emulated device: a tiny GPT's bf16 losses track its
    fp32 losses over 24 iterations within BF16_TRACKS_FP32 (and differ from
    them: the precision is applied). Its checkpoint holds the float32
    masters, bit for bit what the bf16 run trained, no @bf16 copy; an fp32
    run resumes from it, and a bf16 run from the fp32 run's checkpoint."""
    import h5py
    from tests.emulated_gpu import emulated_trainer_env
    emulated_trainer_env(monkeypatch, host_build_dir)
    t16, out16, bf16 = _train(tmp_path, "bf16", "bf16", 24, interval=12)
    g16 = t16.graphs.graph   # the weights' copies, written by the update (fold_weight_casts)
    assert any(b.kind == "param_copy" for b in g16.blobs.values())
    assert not any(op.op_type == "Cast" and g16.blobs[op.inputs[0]].kind == "param"
                   for op in g16.ops.values())
    _, _, fp32 = _train(tmp_path, "fp32", "fp32", 24)
    assert sorted(bf16) == sorted(fp32) == list(range(1, 25))
    its = sorted(bf16)
    np.testing.assert_allclose([bf16[i] for i in its], [fp32[i] for i in its],
                               rtol=BF16_TRACKS_FP32)
    assert bf16 != fp32
    assert fp32[24] < fp32[1] - 0.5 and bf16[24] < bf16[1] - 0.5  # both learn
    ckpt = out16 / "ckpt_12.h5"
    with h5py.File(ckpt, "r") as f:
        names = []
        f["params"].visit(lambda n: names.append(n) if isinstance(f["params"][n], h5py.Dataset)
                          else None)
        assert names and not any("@" in n for n in names)
        assert all(f["params"][n].dtype == np.float32 for n in names)
        saved = {n: f["params"][n][()] for n in names}
    # bf16 -> fp32: the masters come back bit for bit and training goes on
    t32, _, resumed = _train(tmp_path, "to_fp32", "fp32", 24, resume=str(ckpt))
    assert not any(op.op_type == "Cast" for op in t32.graphs.graph.ops.values())
    assert sorted(t32.loaded) == sorted(saved)
    for n, v in saved.items():
        assert t32.loaded[n].tobytes() == v.tobytes(), n
    assert sorted(resumed) == list(range(13, 25))
    np.testing.assert_allclose([resumed[i] for i in range(13, 25)],
                               [bf16[i] for i in range(13, 25)], rtol=BF16_TRACKS_FP32)
    # fp32 -> bf16 (the fp32 run's own checkpoint: its end)
    _, _, back = _train(tmp_path, "to_bf16", "bf16", 30, resume=str(tmp_path / "to_fp32" /
                                                                    "latest.h5"))
    assert sorted(back) == list(range(25, 31)) and all(np.isfinite(list(back.values())))
    rel = max(abs(bf16[i] - fp32[i]) / fp32[i] for i in its)
    print(f"bf16 vs fp32 over 24 iterations: max relative loss difference {rel:.2e}")



def test_copies_made_in_place_train_bit_for_bit_as_copies(host_build_dir, monkeypatch,
                                                          tmp_path):
    """The trainer on the emulated device, bf16 in float32 storage
    (PURINE_BF16_STORAGE=0: with bf16 storage the logits' gradient's copy
    is bits of its own, tests/test_bf16_storage.py), 4 iterations: with the
    copies made in place and the loss's probabilities and gradient over the
    logits (the logits, the probabilities, their gradient and its copy on
    one buffer of the workspace) the losses are bit for bit those of the
    same run with every Cast copying and each of those its own bytes
    (Cast, SoftmaxLoss and SoftmaxLossGrad ``in_place`` off)."""
    from purine_mpi.gpu import data_ptr
    from purine_mpi.ops.basic import Cast
    from tests.emulated_gpu import emulated_trainer_env
    emulated_trainer_env(monkeypatch, host_build_dir)
    monkeypatch.setenv("PURINE_BF16_STORAGE", "0")
    from purine_mpi.ops.softmax import SoftmaxLoss, SoftmaxLossGrad
    runs = {}
    ops = (Cast, SoftmaxLoss, SoftmaxLossGrad)
    for name, pairs in (("in_place", [c.in_place for c in ops]), ("copies", [()] * 3)):
        for c, p in zip(ops, pairs):
            monkeypatch.setattr(c, "in_place", p)
        t, _, losses = _train(tmp_path, name, "bf16", 4)
        ws = t.train.workspace
        chain = [data_ptr(ws[b]) for b in ("logits", "loss.prob", "logits.grad",
                                           "logits.grad@bf16")]
        # each blob of the chain on its predecessor's bytes (both live at its writer)
        runs[name] = ([a == b for a, b in zip(chain, chain[1:])], losses)
    assert runs["in_place"][0] == [True] * 3 and runs["copies"][0] == [False] * 3
    assert sorted(runs["in_place"][1]) == [1, 2, 3, 4]
    assert runs["in_place"][1] == runs["copies"][1]

# ------------------------------------------- gpt_tiny at 300 iterations (slow)
#: issue 45's target: gpt_tiny in bf16, validation loss at 300 iterations
#: within this many nats of the fp32 run's
BF16_GPT_TINY_NATS = 0.03
GPT_TINY_ITERS = 300


@pytest.mark.slow
@pytest.mark.long
def test_gpt_tiny_bf16_validation_within_0_03_nats_of_fp32_at_300_iterations(
        email_h5, host_build_dir, tmp_path):
    """jobs/gpt_tiny.yaml for 300 iterations (``solver.max_iter``: the cosine
    schedule ends there, as the 150-iteration test of test_gpt_jobs.py
    compresses it), everything else the job's: bf16 on the emulated device
    (tests/emulated_gpu/train.py, a process of its own) beside fp32 on the
    CPU (the CLI), the two at once. The CPU run is the fp32 reference: the
    emulated device's fp32 run has its numerics (the same validation losses,
    measured: 5.2837353 after one step, 2.777154 after 50) at half the
    cost. Both validation losses are finite, the bf16 run learned, and they
    differ by at most BF16_GPT_TINY_NATS.

    Measured (2026-11-28, 2 cores shared with other jobs): bf16 1.8869833,
    fp32 1.8927448 (-5.8e-3 nats); 24.7 min of wall at a third of the
    CPU, ~345 CPU-s for the bf16 process (1.15 a step with its validations)
    and ~170 for the fp32 one: ~6 min on two quiet cores, not the 2-2.5
    min CI would give it. It is a convergence check, not a rounding check
    (test_rounding_is_ml_dtypes_round_to_nearest_even is that): bf16
    rounded at the wrong bit, 3 mantissa bits kept, still ended within it
    (1.8888197, -3.9e-3); with none kept the run was 1.64 nats above fp32
    at step 100 (4.111089) and fails it."""
    import json
    import subprocess
    import sys

    from tests.conftest import REPO, cli_env, run_cli_args
    job = f"{REPO}/jobs/gpt_tiny.yaml"
    sets = [f"data.train.path={email_h5}", f"data.test.path={email_h5}",
            f"solver.max_iter={GPT_TINY_ITERS}"]
    bf16 = subprocess.Popen([sys.executable, "-m", "tests.emulated_gpu.train", str(host_build_dir),
                             job, str(tmp_path / "bf16"), *sets, "device=0", "precision=bf16"],
                            cwd=REPO, env=cli_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        fp32 = run_cli_args("train", job, "--out", tmp_path / "fp32",
                            *[a for s in sets for a in ("--set", s)], timeout=1800)
        _, err = bf16.communicate(timeout=1800)
    finally:
        bf16.kill()
    assert fp32.returncode == 0, fp32.stderr
    assert bf16.returncode == 0, err

    def validation(run):
        rows = [json.loads(line) for line in open(tmp_path / run / "metrics.jsonl")]
        return {r["iter"]: r["loss"] for r in rows if r["phase"] == "test"}
    low, ref = validation("bf16"), validation("fp32")
    assert GPT_TINY_ITERS in low and GPT_TINY_ITERS in ref and 0 in low, (low, ref)
    a, b = low[GPT_TINY_ITERS], ref[GPT_TINY_ITERS]
    assert np.isfinite(a) and np.isfinite(b), (low, ref)
    assert a < low[0] - 2.0, low   # it learned: from about ln 256 to below the unigram entropy
    print(f"gpt_tiny at {GPT_TINY_ITERS} iterations: validation bf16 {a} fp32 {b} "
          f"(difference {a - b:+.2e} nats)")
    assert abs(a - b) <= BF16_GPT_TINY_NATS, (a, b)


def test_the_emulated_train_process_refuses_more_than_one_blas_thread(tmp_path):
    """tests/emulated_gpu/train.py: the emulated GEMMs' bits depend on
    OpenBLAS's thread count, so it will not start without one thread."""
    import subprocess
    import sys

    from tests.conftest import REPO, cli_env
    env = dict(cli_env(), OPENBLAS_NUM_THREADS="2")
    res = subprocess.run([sys.executable, "-m", "tests.emulated_gpu.train", str(tmp_path),
                          f"{REPO}/jobs/gpt_tiny.yaml", str(tmp_path / "out")], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "OPENBLAS_NUM_THREADS=1" in res.stderr, res.stderr
    assert not (tmp_path / "out").exists()

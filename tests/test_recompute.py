"""Activation recompute (issue 44, item 1; graph/recompute.py): the weights
after 6 AdamW steps are bitwise those without recompute, with dropout, on
1 rank and on 2 ranks of data parallelism (there the train rows' losses
too); the memory plan sees the shorter lifetimes; the combinations it
cannot rewrite are refused with exit 2 (with micro-batches:
tests/test_recompute_micro.py)."""
import json
import os

import numpy as np
import pytest

from tests.conftest import REPO, run_cli_here, run_mpi_cli, train_here

TINY = os.path.join(REPO, "jobs", "gpt_tiny.yaml")
#: gpt_tiny's attention layers (net indices)
ATTENTION = (3, 11)


#: AdamW steps of the bitwise runs: a mask drawn or replayed wrong differs
#: from the first step, a stream drawn once too often from the second (the
#: runs had 20 steps; 6 check the same, ~1.3 s less a run, 12 runs)
ITERS = 6


def _sets(email_h5, dropout=0.1, iters=ITERS, fused=False, display=0):
    """gpt_tiny, small and fast: 4 sequences of 32 tokens, ITERS AdamW steps
    (warm-up, cosine, clipping as shipped), no test data, a train row every
    ``display`` iterations (0: none); the attention's raw sub-graph (its
    (N, H, T, T) tensors and attention Dropout ops) unless ``fused``."""
    sets = [f"data.train.path={email_h5}", "data.test=null", "data.train.batch_size=4",
            "data.train.sequence_length=32", f"solver.max_iter={iters}",
            f"solver.display={display}",
            "checkpoint.interval=0"]
    for i in ATTENTION:
        sets += [f"net.{i}.attn_dropout={dropout}", f"net.{i}.resid_dropout={dropout}",
                 f"net.{i}.fused={'true' if fused else 'false'}"]
    return [a for s in sets for a in ("--set", s)]


def _params(path):
    from purine_mpi.job.checkpoint_file import load_params
    return load_params(path)


def _train(email_h5, out, mode, ranks=1, dropout=0.1, fused=False, display=0):
    sets = _sets(email_h5, dropout, fused=fused, display=display) + ["--set", f"recompute={mode}"]
    if ranks == 1:  # in this process (conftest.train_here): the same job, no start-up
        from purine_mpi.job.config import load_config
        train_here(load_config(TINY, overrides=sets[1::2]), out)
    else:
        res = run_mpi_cli(ranks, "train", TINY, *sets, "--out", out, timeout=600)
        assert res.returncode == 0, res.stderr
    return _params(os.path.join(out, "latest.h5"))


def _assert_bitwise(a, b, what):
    assert sorted(a) == sorted(b) and len(a) > 10
    differ = [k for k in a if not np.array_equal(a[k], b[k])]
    assert not differ, f"{what}: {differ}"


@pytest.mark.parametrize("dropout, fused", [(0.1, False), (0.1, True), (0.0, True)])
def test_recompute_is_bitwise_on_one_rank(email_h5, tmp_path, dropout, fused):
    """full and selective give the weights of no recompute, bit for bit,
    after ITERS AdamW steps: with dropout on the raw attention sub-graph
    (masks replayed from the same Philox streams), with dropout in the
    fused Attention op (selective has nothing to do; full's copy of the op
    unpacks the original's packed mask, attr ``replay_mask``) and without
    dropout (the fused op)."""
    if dropout and fused:   # the fused op draws the dropout; full copies it
        g = _graph(email_h5, "full", *(f"net.{i}.fused=true" for i in ATTENTION))
        copies = [op for op in g.ops.values() if op.op_type == "Attention"]
        assert len(copies) == 4 and all(op.attrs["dropout"] == dropout for op in copies)
        assert not any(op.op_type in ("AttentionScores", "Softmax") for op in g.ops.values())
    base = _train(email_h5, str(tmp_path / "none"), "none", dropout=dropout, fused=fused)
    for mode in ("full", "selective"):
        _assert_bitwise(base, _train(email_h5, str(tmp_path / mode), mode, dropout=dropout,
                                     fused=fused), mode)


@pytest.mark.mpi
def test_recompute_is_bitwise_on_two_ranks(email_h5, tmp_path):
    """The same on 2 ranks of data parallelism (mpiexec), dropout on; the
    reported figures too: the train rows' losses (the mean over the window
    and the ranks) are those of no recompute, bit for bit."""
    base = _train(email_h5, str(tmp_path / "none"), "none", ranks=2, display=2)
    rows = _losses(tmp_path / "none")
    assert [i for i, _ in rows] == [2, 4, 6]
    for mode in ("full", "selective"):
        _assert_bitwise(base, _train(email_h5, str(tmp_path / mode), mode, ranks=2, display=2),
                        mode)
        assert _losses(tmp_path / mode) == rows, f"{mode}: the train rows' losses differ"


def _losses(out):
    """(iter, loss) of the train rows of the run folder ``out``."""
    with open(os.path.join(str(out), "metrics.jsonl")) as f:
        return [(r["iter"], r["loss"]) for r in map(json.loads, f) if r["phase"] == "train"]


def _graph(email_h5, mode, *extra):
    from purine_mpi.job.config import load_config
    from purine_mpi.job.job import job_of
    from purine_mpi.job.replica import build_train_graph
    # gpt_tiny's own sequences (128 tokens): the activations outweigh the weights
    sets = _sets(email_h5)[1::2] + ["data.train.batch_size=16", "data.train.sequence_length=128",
                                    f"recompute={mode}", *extra]
    return build_train_graph(job_of(load_config(TINY, overrides=sets)))[0]


def test_recompute_graph_and_plan(email_h5):
    """The backward reads the copies, never the originals; the copies wait
    for the backward; the trainer's plan (order_ops) is sound and its arena
    shrinks: by more than half under full, and under selective by the
    (N, H, T, T) tensors."""
    from purine_mpi.graph.recompute import SUFFIX
    from purine_mpi.graph.recompute import describe_recompute
    from purine_mpi.runtime.memory_plan import batch_blobs, check_plan, peak_live, plan_memory
    arena, peak = {}, {}
    for mode in ("none", "full", "selective"):
        g = _graph(email_h5, mode)
        plan = plan_memory(g, keep=batch_blobs(g), order_ops=True)
        assert check_plan(g, plan) == []
        arena[mode] = plan.planned_bytes
        peak[mode] = peak_live(g, plan)[2]["activations"]
        line = describe_recompute(g)  # graph's and the start-up block's line
        assert (line is None) == (mode == "none") and (line is None or line.startswith(mode))
        copies = [op for op in g.ops.values() if op.name.split("#")[0].endswith(SUFFIX)]
        assert bool(copies) == (mode != "none")
        redone = {b.attrs["recompute_of"] for b in g.blobs.values() if "recompute_of" in b.attrs}
        assert set(g.recompute["recomputed"]) <= redone
        deps = g.dependencies()
        forward = {op.name for op in g.topo_order() if not any(
            g.blobs[b].kind == "grad" for b in op.outputs)} - {op.name for op in copies}
        for op in g.ops.values():
            if op.name in forward or op in copies:
                continue
            assert not set(op.inputs) & redone, (op.name, set(op.inputs) & redone)
        order = [op.name for op in g.topo_order(deps)]
        first_grad = min(order.index(op.name) for op in g.ops.values()
                         if op.name not in forward and op not in copies)
        for op in copies:  # after the backward began
            assert order.index(op.name) > first_grad, op.name
            assert op.op_type != "Dropout", op.name  # masks are replayed, never redrawn
        if mode == "selective":
            assert redone and all(b.split(".")[1] in ("scores", "probs", "attn_drop")
                                  for b in redone), redone
        if mode == "full":
            assert {"x1", "h0_r", "h1_r"} <= set(g.recompute["saved"])
            # the residual stream is kept, never recomputed by the unit before
            assert not {"x1", "x2", "h0_r", "h1_r"} & redone, redone
            # a projection that feeds only a dropout and the residual add is not copied
            assert not any(op.op_type == "InnerProduct" and op.name.split(".")[0] == "h0_proj"
                           for op in copies)
        _assert_packed_masks(g, plan, mode)
    assert arena["full"] <= 0.5 * arena["none"], arena
    assert arena["selective"] < arena["none"], arena
    assert peak["full"] <= 0.5 * peak["none"] and peak["selective"] < peak["none"], peak
    # recompute_layers restricts it: only block 1's layers
    g = _graph(email_h5, "full", "recompute_layers=[h1_*]")
    assert g.recompute["units"] and all(n.startswith("h1_") for u in g.recompute["units"]
                                        for n in u)
    assert not any(b.startswith("h0_") for b in g.recompute["recomputed"])


def _assert_packed_masks(g, plan, mode):
    """Each Dropout mask a unit's backward reads is kept bit-packed: uint8,
    ceil(n / 8) bytes, its float mask gone, planned from the forward to the
    backward; the DropoutGrad ops and the copies read it."""
    from purine_mpi.graph.recompute import PACKED
    packed = g.recompute["packed"]
    assert bool(packed) == (mode != "none"), packed
    if mode == "selective":
        assert all(b.endswith("attn_drop_mask" + PACKED) for b in packed), packed
    cons = g.consumers()
    for bits in packed:
        blob, mask = g.blobs[bits], g.blobs[bits].attrs["packed_of"]
        drop = next(op for op in g.ops.values() if bits in op.outputs)
        assert drop.op_type == "Dropout" and drop.attrs["packed_mask"] and mask not in g.blobs
        n = int(np.prod(g.blobs[drop.outputs[0]].shape))
        assert blob.dtype == "uint8" and blob.shape == (-(-n // 8),), (bits, blob.shape)
        root = g.storage_root(bits)
        assert plan.sizes[root] >= blob.nbytes and plan.lifetimes[root][0] < \
            plan.lifetimes[root][1], bits
        readers = {c.op_type for c in cons[bits]}
        assert "DropoutGrad" in readers and readers <= {"DropoutGrad", "DropoutReplay"}, readers
        assert all(c.attrs.get("packed_mask") for c in cons[bits] if c.op_type == "DropoutGrad")


@pytest.mark.parametrize("fused", [False, True])
def test_recompute_draws_no_philox(email_h5, tmp_path, monkeypatch, fused):
    """One training iteration draws each Dropout's mask once from Philox,
    recompute or not: the copies and DropoutGrad unpack the packed mask.
    The same with the fused Attention op's attention dropout: its
    gradient and full recompute's copy of it (attr ``replay_mask``) unpack
    the forward's packed mask (before: the copy drew it again, one draw
    more a layer)."""
    import purine_mpi.ops.dropout as dropout
    from purine_mpi.graph.recompute import SUFFIX
    from purine_mpi.job.config import load_config
    from purine_mpi.job.job import job_of
    from purine_mpi.train.trainer import Trainer
    draws = {}

    def counted(*args, **kw):
        draws[mode] = draws.get(mode, 0) + 1
        return keep_mask(*args, **kw)
    keep_mask = dropout.keep_mask
    monkeypatch.setattr(dropout, "keep_mask", counted)
    params = {}
    for mode in ("none", "full", "selective"):
        sets = _sets(email_h5, iters=1, fused=fused)[1::2] + [f"recompute={mode}"]
        job = job_of(load_config(TINY, overrides=sets))
        trainer = Trainer(job, out_dir=str(tmp_path / mode), profile=False, log=lambda m: None)
        try:
            graph = trainer.graphs.graph
            # the forward's masks: the Dropout ops' and the fused ops' (not their copies')
            n_drop = sum((op.op_type == "Dropout" and len(op.outputs) == 2) or (
                op.op_type == "Attention" and op.attrs.get("dropout") and SUFFIX not in op.name)
                for op in graph.ops.values())
            assert fused == any(op.op_type == "Attention" for op in graph.ops.values())
            trainer.step(0)
            trainer.train.drain()
            trainer.save(1, str(tmp_path / f"{mode}.h5"))
            params[mode] = _params(str(tmp_path / f"{mode}.h5"))
        finally:
            trainer.close()
        assert n_drop > 0 and draws[mode] == n_drop, (mode, draws, n_drop)
    for mode in ("full", "selective"):
        _assert_bitwise(params["none"], params[mode], mode)


def test_packed_dropout_replays_bitwise(monkeypatch):
    """Dropout with packed_mask writes np.packbits of its keep-mask and the
    y of the float-mask Dropout; DropoutReplay and DropoutGrad (packed) give
    that y and dx bit for bit, without drawing Philox."""
    import purine_mpi.ops.dropout as dropout
    from purine_mpi.graph.core import Op
    rng = np.random.default_rng(0)
    x, dy = rng.standard_normal((3, 5, 7), np.float32), rng.standard_normal((3, 5, 7), np.float32)
    x[0, 0, :3] = [-0.0, np.inf, -2.0]
    it, attrs = np.array(11, np.int64), {"ratio": 0.3, "seed": 5}

    def run(op_type, ins, outs, **extra):
        op = Op("d", op_type, [f"i{i}" for i in range(len(ins))],
                [f"o{i}" for i in range(len(outs))], {**attrs, **extra})
        _kernel(op).run(ins, outs)
        return outs
    y, m = run("Dropout", [x, it], [np.empty_like(x), np.empty_like(x)])
    yp, bits = run("Dropout", [x, it], [np.empty_like(x),
                                        np.empty(dropout.packed_shape(x.shape), np.uint8)],
                   packed_mask=True)
    assert np.array_equal(bits, np.packbits(m.reshape(-1) != 0))
    assert y.tobytes() == yp.tobytes()
    monkeypatch.setattr(dropout, "keep_mask", lambda *a, **k: pytest.fail("Philox drawn"))
    (yr,) = run("DropoutReplay", [x, bits], [np.empty_like(x)])
    assert y.tobytes() == yr.tobytes()
    (dx,) = run("DropoutGrad", [dy, m], [np.empty_like(dy)])
    (dxp,) = run("DropoutGrad", [dy, bits], [np.empty_like(dy)], packed_mask=True)
    assert dx.tobytes() == dxp.tobytes()
    from purine_mpi.base.errors import ShapeError
    with pytest.raises(ShapeError, match="packed mask"):
        _kernel(Op("d", "DropoutGrad", [], [], {"packed_mask": True})).infer(
            {"packed_mask": True}, [((3, 5, 7), "float32"), ((13,), "uint8")])


def _kernel(op):
    from purine_mpi.ops.catalog import get_kernel_class
    return get_kernel_class(op.op_type)(op)


def test_dropout_copy_draws_its_originals_mask():
    """A Dropout op whose ``stream`` attr names another op draws that op's
    mask (the Philox stream is keyed by the named op), not its own."""
    from purine_mpi.graph.core import Op
    from purine_mpi.ops.dropout import Dropout
    x, it = np.ones((4, 64), np.float32), np.array(7, np.int64)

    def mask(name, **attrs):
        op = Op(name, "Dropout", ["x", "iter"], ["y", "m"], {"ratio": 0.5, "seed": 3, **attrs})
        y, m = np.empty_like(x), np.empty_like(x)
        Dropout(op).run([x, it], [y, m])
        return m
    assert np.array_equal(mask("a@recompute", stream="a"), mask("a"))
    assert not np.array_equal(mask("a@recompute"), mask("a"))


@pytest.mark.parametrize("sets, key", [
    (["recompute=full", "parallel.scheme=tensor", "parallel.tensor_parallel=2"], "recompute"),
    (["recompute=selective", "parallel.scheme=pipeline", "parallel.stages=2",
      "parallel.micro_batches=2"], "recompute"),
    # sharded with stages runs as a pipeline: once accepted, the copies'
    # control edges crossed the stages' ranks (a GraphError at start-up)
    (["recompute=full", "parallel.scheme=sharded", "parallel.stages=2",
      "parallel.micro_batches=2"], "recompute"),
    (["recompute=full", "recompute_layers=[nope*]"], "recompute_layers"),
    (["recompute=some"], "recompute"),
])
def test_recompute_refusals(email_h5, sets, key):
    """What the pass cannot rewrite (a pipeline, with micro-batches or
    without: micro-batches alone are accepted, tests/test_recompute_micro.py),
    a pattern matching no layer and an unknown mode: exit 2, one line
    naming the key."""
    args = [a for s in sets for a in ("--set", s)]
    res = run_cli_here("train", TINY, *_sets(email_h5), *args, "--out", "/nonexistent/x")
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and f"'{key}'" in lines[0] and "Traceback" not in res.stderr, lines


def test_a_unit_cut_before_the_residual_add_recomputes_its_outputs(email_h5, tmp_path):
    """``recompute_layers`` that stop a unit before its residual add (a
    transformer's GELU, its layer norms: the units ``[h0_gelu]``,
    ``[h0_ln1]``, ...) recompute the outputs the backward reads (GELU's
    output, the normalised rows), from the inputs kept anyway; before, a
    unit's outputs were kept in any net with residual adds, so these units
    recomputed nothing. The weights stay bitwise those of no recompute."""
    from purine_mpi.graph.recompute import SUFFIX
    from purine_mpi.job.config import load_config
    layers = "recompute_layers=[h*_gelu,h*_ln1,h*_ln2]"
    g = _graph(email_h5, "full", layers)
    redone = set(g.recompute["recomputed"])
    assert {"h0_m@h0_gelu", "h1_m@h1_gelu", "h0_n1", "h0_n2", "h1_n1", "h1_n2"} <= redone, redone
    # the weight gradients read the copies; the kept inputs are the copies' inputs
    cons = g.consumers()
    assert all(c.name.endswith(SUFFIX) or ".bwd" not in c.name for b in redone
               for c in cons.get(b, ()))
    assert {"h0_m", "x0", "h0_r"} <= set(g.recompute["saved"]), g.recompute["saved"]
    sets = _sets(email_h5, dropout=0.0, fused=True)[1::2]
    base = str(tmp_path / "none")
    train_here(load_config(TINY, overrides=sets), base)
    cut = str(tmp_path / "cut")
    train_here(load_config(TINY, overrides=sets + ["recompute=full", layers]), cut)
    _assert_bitwise(_params(os.path.join(base, "latest.h5")),
                    _params(os.path.join(cut, "latest.h5")), "cut units")


def test_a_cnn_recomputes_on_the_device_bitwise(host_build_dir, monkeypatch, tmp_path):
    """jobs/cifar10_quick.yaml (conv, pool and ReLU units) with ``recompute:
    full`` on the emulated device: the device fusions (a ReLU into its conv,
    a ReluGrad into the data gradient writing its input) keep the
    recomputed copies' waits (before: 'pool1.fwd@recompute' depends on
    unknown op 'relu1.bwd.relu_grad'), fuse no ReluGrad whose mask is
    recomputed after that data gradient (a cycle), and train 2 steps to the
    weights of no recompute, bit for bit; its device plan is sound."""
    from purine_mpi.base.backend import to_numpy
    from purine_mpi.job.config import load_config
    from purine_mpi.runtime.memory_plan import check_plan
    from purine_mpi.train.trainer import Trainer, run_and_report
    from tests.conftest import FakeWorld, make_job
    from tests.emulated_gpu import emulated_trainer_env
    emulated_trainer_env(monkeypatch, host_build_dir)

    def train(mode):
        cfg = load_config(os.path.join(REPO, "jobs", "cifar10_quick.yaml"), overrides=[
            "device=0", f"recompute={mode}", "data.train.batch_size=2",
            "data.train.num_samples=4", "solver.max_iter=2", "solver.test_interval=0",
            "checkpoint.interval=0"], check_files=False)
        cfg["data"].pop("test", None)
        t = Trainer(make_job(cfg), str(tmp_path / mode), world=FakeWorld(),
                    log=lambda line: None)
        g = t.graphs.graph
        assert check_plan(g, t.train.workspace.device_plans[0]) == []
        assert run_and_report(t, FakeWorld()) == 0
        return g, {p: np.array(to_numpy(t.train.workspace[p])) for p in t.graphs.params}

    (g, full), (g0, none) = train("full"), train("none")
    assert any("@recompute" in n for n in g.ops)
    assert any(op.attrs.get("mask_slope") is not None for op in g0.ops.values()
               if op.op_type == "ConvGradData")   # fused without recompute
    assert sorted(none) == sorted(full) and len(none) == 10   # 5 layers' weights and biases
    assert [k for k in none if not np.array_equal(none[k], full[k])] == []
    assert any(np.any(v != 0) for v in full.values())


@pytest.mark.parametrize("job", ["cifar10_quick", "nin_cifar10"])
def test_full_recompute_never_grows_a_cnns_arena(job):
    """A net without residual adds is cut into units of one layer; a unit
    whose copies would hold at least the bytes it drops is left as it is
    (a ReLU's, whose input its copy would keep beside the output the next
    layer keeps anyway; a max pool's, whose copy would keep the conv output
    a 4x larger than its mask). Before, cifar10_quick's arena grew from
    22.4 MiB to 26.1 MiB under full (conv1's 12.5 MiB output held through
    the iteration for pool1's copy), NIN's from 363.4 to 393.8 MiB on the
    host, 351.4 to 393.8 on the device. The arena with full recompute is
    at most the one without, on the host and on a GPU (placed and fused as
    the trainer does; the device plan needs no device), the plans sound;
    the summary lists what was left and why, and ``plan`` says whether
    recompute can lower each arena's peak."""
    from purine_mpi.graph.recompute import describe_recompute
    from purine_mpi.job.config import load_config
    from purine_mpi.job.replica import build_train_graph
    from purine_mpi.parallel.placement import prepare_for_device
    from purine_mpi.runtime.memory_plan import batch_blobs, check_plan, device_plans, \
        plan_memory
    from tests.conftest import make_job

    def arenas(mode):
        cfg = load_config(os.path.join(REPO, "jobs", f"{job}.yaml"),
                          overrides=[f"recompute={mode}", "data.train.batch_size=16"],
                          check_files=False)
        host_graph, _ = build_train_graph(make_job(cfg))
        host = plan_memory(host_graph, keep=batch_blobs(host_graph), order_ops=True)
        device_graph, _ = build_train_graph(make_job(cfg))
        prepare_for_device(device_graph, 0)
        device = device_plans(device_graph, keep=batch_blobs(device_graph), order_ops=True)[0]
        assert check_plan(host_graph, host) == [] and check_plan(device_graph, device) == []
        return host_graph, host, device_graph, device
    g, host_full, gpu_graph, device_full = arenas("full")
    _, host_none, _, device_none = arenas("none")
    assert host_full.total_bytes <= host_none.total_bytes
    assert device_full.total_bytes <= device_none.total_bytes
    summary = g.recompute
    left = {n for unit, _, _ in summary["no_gain"] for n in unit}
    relu = "relu1" if job == "cifar10_quick" else "relu_conv1"
    assert relu in left and all(held >= dropped for _, held, dropped in summary["no_gain"])
    assert not left & {n for unit in summary["units"] for n in unit}
    assert not any(op.name.startswith(relu + ".") and "@recompute" in op.name
                   for op in g.ops.values())
    line = describe_recompute(g)
    assert "left as they are" in line and relu in line
    from purine_mpi.runtime.footprint import WorkspacePlans, recompute_notes
    notes = recompute_notes(g, WorkspacePlans(keep=[], host=host_full))
    assert notes[0] == f"recompute {line}" and len(notes) == 2
    gpu_notes = recompute_notes(gpu_graph, WorkspacePlans(keep=[], host=None,
                                                          devices={0: device_full}))
    assert len(gpu_notes) == 2 and "the GPU 0 peak" in gpu_notes[1]
    if job == "cifar10_quick":  # its peak: pool1's gradient beside the mask it reads
        for note in (notes[1], gpu_notes[1]):
            assert note.endswith("are all read by that op itself")
            assert "recompute cannot lower this peak" in note


def test_a_unit_left_as_it_is_would_not_lower_the_plan(monkeypatch):
    """The held/dropped verdict against the memory plan itself: each unit
    of NIN that full recompute leaves as it is (``no_gain``: each ReLU,
    whose input the plan would otherwise compute it in place over, so the
    copy would hold as much as it drops), recomputed anyway (its verdict
    alone patched to "gain", the other units as they were), lowers neither
    the arena nor the activations at its peak (a ``held`` that counted
    blobs the backward keeps anyway leaves pool1 too, and recomputing it
    lowers the arena 48.8 -> 47.2 MB: this fails); and the verdict is the
    same on each rank of 2 (a data-parallel group's graphs must not differ)."""
    import purine_mpi.graph.recompute as recompute
    from purine_mpi.job.config import load_config
    from purine_mpi.job.replica import build_train_graph
    from purine_mpi.runtime.memory_plan import batch_blobs, check_plan, peak_live, plan_memory
    from tests.conftest import make_job

    def plan(rank=0):
        cfg = load_config(os.path.join(REPO, "jobs", "nin_cifar10.yaml"),
                          overrides=["data.train.batch_size=16", "recompute=full"],
                          check_files=False)
        g, _ = build_train_graph(make_job(cfg), rank, 2, True)
        p = plan_memory(g, keep=batch_blobs(g), order_ops=True)
        assert check_plan(g, p) == []
        return g, p.planned_bytes, peak_live(g, p)[2]["activations"]
    g, arena, peak = plan()
    no_gain = g.recompute["no_gain"]
    assert {u[0] for u, _, _ in no_gain} >= {"relu_conv1", "relu_cccp1", "relu_cccp6"}
    assert all(held >= dropped for _, held, dropped in no_gain)
    assert plan(rank=1)[0].recompute == g.recompute
    verdict = recompute._held_and_dropped
    for unit, _, _ in no_gain:
        def forced(graph, ops, *args, unit=unit):
            held, dropped = verdict(graph, ops, *args)
            return (0, 1) if ops[0].name.startswith(unit[0] + ".") else (held, dropped)
        with monkeypatch.context() as m:
            m.setattr(recompute, "_held_and_dropped", forced)
            g2, forced_arena, forced_peak = plan()
        assert unit in g2.recompute["units"]
        assert forced_arena >= arena and forced_peak >= peak, (unit, forced_arena, arena,
                                                               forced_peak, peak)

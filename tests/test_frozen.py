"""Frozen parameters (``lr_mult: 0``): their update changes nothing, the
weight and the solver state stay bit for bit whatever the gradient holds
(torch.optim leaves a parameter without ``grad`` alone), and under fp16 an
inf in a frozen gradient skips no step (torch's GradScaler sees no gradient
there): ops/updates.py's ``frozen``, graph/loss_scale.py (a complete
``graph:`` may still hold a frozen update). A net's frozen parameter gets no
gradient at all (graph/grad.py's ``trained``): no gradient op, no bucket or
collective, no update op, no solver state (torch's ``requires_grad=False``);
a checkpoint resumes across freezing and unfreezing, the state it lacks
starting from zero."""
import json

import numpy as np
import pytest

from purine_mpi.graph.core import Op
from purine_mpi.job.config import validate_config
from purine_mpi.ops.catalog import get_kernel_class
from purine_mpi.ops.updates import SOLVER_UPDATES

SHARED = {"momentum": 0.9, "momentum2": 0.99, "delta": 1e-8, "rms_decay": 0.9,
          "weight_decay": 0.1, "grad_scale": 0.5}


def _bad_grad(rng, shape):
    g = rng.standard_normal(shape).astype(np.float32)
    g.reshape(-1)[:2] = [np.inf, np.nan]
    return g


@pytest.mark.parametrize("solver", sorted(SOLVER_UPDATES))
def test_a_frozen_update_keeps_weight_and_state_bitwise_whatever_its_gradient(solver):
    """Each solver's update op at lr_mult 0 (decay_mult 1, weight decay set,
    states not zero): an inf/nan gradient leaves weight and states bitwise."""
    op_type, states = SOLVER_UPDATES[solver]
    rng = np.random.default_rng(0)
    w = rng.standard_normal((3, 4)).astype(np.float32)
    held = [w] + [np.abs(rng.standard_normal((3, 4))).astype(np.float32) for _ in states]
    before = [a.copy() for a in held]
    extra = [np.asarray(0.1, np.float32)] + (
        [np.asarray(5, np.int64)] if op_type in ("AdamUpdate", "AdamWUpdate") else [])
    kernel = get_kernel_class(op_type)(Op("u", op_type, [], [],
                                          dict(SHARED, lr_mult=0.0, decay_mult=1.0)))
    for _ in range(2):
        kernel.run([held[0], _bad_grad(rng, (3, 4))] + held[1:] + extra, held)
    for a, b in zip(held, before):
        np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("op_type", ["MultiSGDUpdate", "MultiAdamUpdate"])
def test_a_multi_tensor_update_leaves_its_frozen_views_alone(op_type):
    """The fused update (CPU path) with a frozen parameter between two
    moving ones: the frozen views stay bitwise under an inf/nan gradient,
    the others move and stay finite."""
    rng = np.random.default_rng(1)
    shapes, offsets = [(3, 4), (5,), (2, 3)], [0, 64, 128]
    nflat = 2 if op_type == "MultiSGDUpdate" else 3
    scalars = [np.asarray(0.1, np.float32)] + ([np.asarray(4, np.int64)] if nflat == 3 else [])
    attrs = dict(SHARED, decoupled=True, sizes=[12, 5, 6], offsets=offsets,
                 lr_mults=[1.0, 0.0, 2.0], decay_mults=[1.0, 1.0, 0.0], params=["a", "b", "c"])
    flat = [np.abs(rng.standard_normal(192)).astype(np.float32) for _ in range(nflat)]
    grads = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    grads[1] = _bad_grad(rng, shapes[1])
    multi = get_kernel_class(op_type)(Op("u", op_type, [], [], attrs))
    out = [b.copy() for b in flat]
    multi.setup(out + scalars + grads, out)
    multi.run(out + scalars + grads, out)
    for buf, old in zip(out, flat):
        np.testing.assert_array_equal(buf[64:69].view(np.uint32), old[64:69].view(np.uint32))
        assert np.isfinite(buf).all()
        assert (buf[0:12] != old[0:12]).all() and (buf[128:134] != old[128:134]).all()


def _net():
    return [{"type": "fc", "name": "fc1", "bottom": "data", "top": "fc1", "num_output": 5,
             "param": [{"lr_mult": 0}, {"lr_mult": 0}],
             "weight_filler": {"type": "constant", "value": 0.25}},
            {"type": "fc", "name": "fc2", "bottom": "fc1", "top": "fc2", "num_output": 3},
            {"type": "softmax_loss", "name": "loss", "bottom": ["fc2", "label"]}]


@pytest.mark.parametrize("device,precision,solver", [
    (-1, "fp32", "sgd"), (-1, "fp32", "adamw"), (0, "fp16", "sgd"), (0, "fp16", "adamw")])
def test_a_frozen_fc_stays_bitwise_without_gradient_or_state(
        host_build_dir, monkeypatch, tmp_path, device, precision, solver):
    """fc1 frozen (weight constant 0.25, weight decay 0.1), fc2 learning,
    4 steps: fc1's weight is 0.25 bitwise, the graph the trainer runs has
    no gradient, update or solver state of fc1 (before: fc1's gradient was
    computed and its update a no-op, its state zeros), fc2 moves. On the
    emulated device in fp16 the fused update holds fc2's parameters alone
    and no step is skipped."""
    from tests.conftest import FakeWorld, make_job
    from purine_mpi.train.trainer import Trainer, run_and_report
    from tests.test_precision import _raw
    raw = _raw(device=device, precision=precision, net=_net(),
               solver={"type": solver, "base_lr": 0.05, "momentum": 0.9, "weight_decay": 0.1,
                       "max_iter": 4, "test_interval": 0, "display": 1})
    if device >= 0:
        from tests.emulated_gpu import emulated_trainer_env
        emulated_trainer_env(monkeypatch, host_build_dir)
        raw.update(cuda_graph=False, loss_scale={"init_scale": 256.0})
    raw["checkpoint"] = {"interval": 0, "keep": 0}
    out, lines = tmp_path / "run", []
    t = Trainer(make_job(validate_config(raw, check_files=False)), str(out), world=FakeWorld(),
                log=lines.append)
    start = np.array(t.train.workspace.arrays["fc2/weight"], copy=True)
    assert run_and_report(t, FakeWorld()) == 0
    arrays = t.train.workspace.arrays
    w = np.asarray(arrays["fc1/weight"])
    np.testing.assert_array_equal(w.view(np.uint32), np.full_like(w, 0.25).view(np.uint32))
    graph = t.train.workspace.graph
    assert not [b for b in graph.blobs if b.startswith("fc1/") and "." in b], \
        "fc1's gradient or solver state"
    assert not [op.name for op in graph.ops.values() if op.name.startswith("fc1.bwd")]
    assert not [a for a in arrays if a.startswith("fc1/") and "." in a]
    assert np.isfinite(np.asarray(arrays["fc2/weight"])).all()
    assert (np.asarray(arrays["fc2/weight"]) != start).all()
    if device >= 0:  # fused: one multi-tensor update of fc2's parameters
        multi = [op for op in graph.ops.values() if op.op_type.startswith("Multi")]
        assert [op.attrs["lr_mults"] for op in multi] == [[1.0, 1.0]]
        rows = [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]
        rows = [r for r in rows if r["phase"] == "train"]
        assert [r["skipped_steps"] for r in rows] == [0] * 4, rows
        assert [r["loss_scale"] for r in rows] == [256.0] * 4
        assert not any("step skipped" in line for line in lines)


# ------------------------------------------------- no gradient work for frozen
def _conv_net(frozen):
    """conv1 (reads the data) -> relu -> fc1 -> fc2 -> loss; the layers in
    ``frozen`` at lr_mult 0, fc1's weight and bias constant (0.25, 0.5)."""
    def param(name):
        return [{"lr_mult": 0}, {"lr_mult": 0}] if name in frozen else []
    return [{"type": "conv", "name": "conv1", "bottom": "data", "top": "conv1", "num_output": 4,
             "kernel": 3, "pad": 1, "param": param("conv1")},
            {"type": "relu", "name": "relu1", "bottom": "conv1", "top": "conv1"},
            {"type": "fc", "name": "fc1", "bottom": "conv1", "top": "fc1", "num_output": 6,
             "weight_filler": {"type": "constant", "value": 0.25},
             "bias_filler": {"type": "constant", "value": 0.5}, "param": param("fc1")},
            {"type": "fc", "name": "fc2", "bottom": "fc1", "top": "fc2", "num_output": 3,
             "param": param("fc2")},
            {"type": "softmax_loss", "name": "loss", "bottom": ["fc2", "label"]}]


def _conv_raw(frozen, solver="sgd", parallel=None, iters=4, data=None):
    return {"seed": 3, "data": {"train": data or {
                "source": "synthetic", "shape": [2, 4, 4], "classes": 3, "batch_size": 4}},
            "net": _conv_net(frozen),
            "solver": {"type": solver, "base_lr": 0.05, "momentum": 0.9, "momentum2": 0.99,
                       "weight_decay": 0.01, "max_iter": iters, "test_interval": 0,
                       "display": 1},
            "parallel": parallel or {}, "checkpoint": {"interval": 2, "keep": 0}}


PARAMS = ("conv1/weight", "conv1/bias", "fc1/weight", "fc1/bias", "fc2/weight", "fc2/bias")
REDUCTIONS = ("Allreduce", "ReduceScatter", "NcclAllreduce", "NcclReduceScatter")


@pytest.mark.parametrize("parallel", [{"scheme": "data"}, {"scheme": "sharded", "shard": 2},
                                      {"scheme": "sharded", "shard": 3}])
@pytest.mark.parametrize("frozen", [("fc1",), ("conv1",)])
def test_a_frozen_layer_has_no_gradient_op_bucket_or_update(parallel, frozen):
    """Rank 0 of 2, composed offline (``graph --np 2``): a frozen layer has
    no parameter-gradient op, its parameters are in no reduction (allreduce
    or reduce-scatter: exactly the trained ones are), no update op and no
    solver state; a frozen fc1 between trained layers keeps its data
    gradient (conv1 below needs it); a frozen conv1 reading the data has no
    backward at all, and fc1 above it then no data gradient either.
    Before: ConvGradWeight/InnerProductGradWeight of the frozen layer, its
    gradient in a bucket, a no-op update."""
    from tests.conftest import make_job
    from purine_mpi.tools.graph import compose_for
    g = compose_for(make_job(_conv_raw(frozen, parallel=dict(parallel, min_buckets=1))), 2, 0)
    trained = [p for p in PARAMS if p.split("/")[0] not in frozen]
    ops = list(g.ops.values())
    for layer in frozen:
        grads = [op.name for op in ops for b in op.outputs
                 if b.startswith(f"{layer}/") and ".grad" in b]
        assert not grads, f"{layer}'s parameter gradient is computed by {grads}"
        assert not [op.name for op in ops if op.name.startswith(f"{layer}/")], "an update"
        assert not [b for b in g.blobs if b.startswith(f"{layer}/") and (
            ".momentum" in b or ".grad" in b)], "a gradient or solver state blob"
    reduced = {b.split(".grad")[0] for op in ops if op.op_type in REDUCTIONS
               for b in op.inputs if ".grad" in b}
    assert reduced == set(trained), reduced
    backward = {op.name.split(".bwd")[0] for op in ops if ".bwd." in op.name}
    if frozen == ("fc1",):
        assert "fc1.bwd.inner_product_grad_data" in g.ops  # conv1 learns below it
        assert "conv1.bwd.conv_grad_weight" in g.ops
    else:
        assert "conv1" not in backward and "relu1" not in backward
        assert "fc1.bwd.inner_product_grad_data" not in g.ops
        assert "fc1.bwd.inner_product_grad_weight" in g.ops


def _train(tmp_path, raw, resume=None, lines=None):
    from tests.conftest import FakeWorld, make_job
    from purine_mpi.train.trainer import Trainer, run_and_report
    out = tmp_path / "run"
    t = Trainer(make_job(raw), str(out), world=FakeWorld(),
                log=(lines.append if lines is not None else lambda line: None), resume=resume)
    assert run_and_report(t, FakeWorld()) == 0
    return out


def _saved(path):
    from tests.test_micro_batches import _params
    return _params(path)


def _bitwise(a, b, names):
    for n in names:
        assert a[n].dtype == b[n].dtype and a[n].shape == b[n].shape, n
        assert a[n].tobytes() == b[n].tobytes(), f"{n} differs"


@pytest.mark.parametrize("solver", ["sgd", "adamw"])
def test_frozen_layers_train_the_others_as_when_their_gradient_was_computed(
        tmp_path, monkeypatch, solver):
    """fc1 frozen, 4 steps on 1 rank: every weight (and each trained one's
    solver state) bit for bit that of the graph that still computes fc1's
    gradient and updates it with a no-op (graph/grad.py's ``trained``
    taking every learnable parameter, the code before): dropping the
    gradient work changes no result."""
    import purine_mpi.graph.grad as grad
    now = _saved(_train(tmp_path / "now", _conv_raw(("fc1",), solver)) / "ckpt_4.h5")
    monkeypatch.setattr(grad, "trained", lambda blob: blob.attrs.get("learnable", True))
    was = _saved(_train(tmp_path / "was", _conv_raw(("fc1",), solver)) / "ckpt_4.h5")
    assert "solver/fc1/weight/" + SOLVER_UPDATES[solver][1][0] in was  # the old graph's
    assert not [k for k in now if k.startswith("solver/fc1")]
    _bitwise(now, was, [k for k in now if k.startswith(("params", "solver"))])
    fc1 = now["params/fc1/weight"]
    np.testing.assert_array_equal(fc1.view(np.uint32), np.full_like(fc1, 0.25).view(np.uint32))


def _with_zero_state(src, dst, layers, solver):
    """A copy of checkpoint ``src`` whose ``layers`` hold zero solver state
    (what a frozen run wrote before: its no-op updates kept zeros)."""
    from purine_mpi.job.checkpoint_file import load_checkpoint, save_checkpoint
    ck = load_checkpoint(str(src))
    solver_state = {p: dict(v) for p, v in ck.solver.items()}
    for p in PARAMS:
        if p.split("/")[0] in layers:
            solver_state[p] = {s: np.zeros_like(ck.params[p]) for s in SOLVER_UPDATES[solver][1]}
    a = ck.attrs
    save_checkpoint(str(dst), ck.params, solver_state, ck.state, iteration=int(a["iteration"]),
                    world_size=int(a["world_size"]), seed=int(a["seed"]), config_text=a["config"],
                    run_id=str(a.get("run_id") or ""), elapsed=a.get("elapsed"))
    return dst


@pytest.mark.parametrize("solver", ["sgd", "adamw"])
def test_a_resume_across_freezing_and_unfreezing(tmp_path, solver):
    """fc1 frozen for 2 steps (its checkpoint holds no solver state of
    fc1), resumed with fc1 learning to step 4: fc1's state starts from zero
    (a note says so) and every weight and state is bit for bit that of a
    resume from the same file holding zeros for fc1 (what a frozen run
    wrote before), AdamW's step count going on from the file's for every
    parameter. Back: that run's checkpoint resumed with fc1 frozen again
    leaves fc1 bitwise and trains the others on. Before the fix of
    train/checkpoints.py, AdamW's step count restarted for all."""
    frozen = _train(tmp_path / "f", _conv_raw(("fc1",), solver, iters=2)) / "ckpt_2.h5"
    assert not [k for k in _saved(frozen) if k.startswith("solver/fc1")]
    lines = []
    thawed = _saved(_train(tmp_path / "u", _conv_raw((), solver), frozen, lines) / "ckpt_4.h5")
    assert any("frozen (lr_mult 0) in the run that wrote it" in line and "fc1/weight" in line
               for line in lines), lines
    assert not any("step count" in line for line in lines), lines
    zeros = _with_zero_state(frozen, tmp_path / "zeros.h5", ("fc1",), solver)
    ref = _saved(_train(tmp_path / "z", _conv_raw((), solver), zeros) / "ckpt_4.h5")
    assert sorted(thawed) == sorted(ref)
    _bitwise(thawed, ref, list(ref))
    assert (thawed["params/fc1/weight"] != _saved(frozen)["params/fc1/weight"]).all()
    lines.clear()
    back = _saved(_train(tmp_path / "b", _conv_raw(("fc1",), solver, iters=6),
                         tmp_path / "u" / "run" / "ckpt_4.h5", lines) / "ckpt_6.h5")
    assert any("parameter(s) (fc1/bias, fc1/weight) is not used" in line for line in lines)
    _bitwise(back, thawed, ["params/fc1/weight", "params/fc1/bias"])
    assert not [k for k in back if k.startswith("solver/fc1")]
    assert (back["params/fc2/weight"] != thawed["params/fc2/weight"]).all()


@pytest.fixture(scope="module")
def data_fc1_frozen(tmp_path_factory):
    """Scheme data on 2 ranks, AdamW, fc1 frozen, 4 steps, checkpoints at 2
    and 4, trained once for this module: (run folder, the command's output).
    The reference of test_stage3_with_a_frozen_layer_trains_as_data_parallel
    and (its checkpoint at 2) the file test_frozen_under_data_and_sharded_
    ranks_and_a_resume_into_a_shared_bucket resumes; before, that test
    trained the 2 steps in a launch of its own."""
    return _mpi_run(tmp_path_factory.mktemp("frozen_data"), "data", 2,
                    _conv_raw(("fc1",), "adamw", {"scheme": "data"}))


@pytest.mark.mpi
def test_frozen_under_data_and_sharded_ranks_and_a_resume_into_a_shared_bucket(
        tmp_path, data_fc1_frozen):
    """2 ranks, AdamW. Scheme data with fc1 frozen, 2 steps: fc1 bitwise its
    fillers', no solver state of it saved. Resumed under sharded stage 3
    (one bucket: fc1 shares it with conv1's and fc2's) with fc1 learning and
    conv1 frozen, to step 4: conv1 bitwise the file's, and every weight and
    state bit for bit that of the same resume from the file holding zeros
    for fc1. Before (each bucket's state loaded whole or not at all), the
    bucket's trained parameters lost their moments too."""
    from tests.conftest import run_mpi_cli, write_config_file
    solver = "adamw"

    def run(name, raw, *more):
        res = run_mpi_cli(2, "train", write_config_file(tmp_path, raw, f"{name}.yaml"), "--out",
                          tmp_path / name, *more)
        assert res.returncode == 0, res.stdout + res.stderr
        return tmp_path / name

    # the 2 steps: those of data_fc1_frozen's 4-step run (a fixed lr: its
    # checkpoint at 2 is a 2-step run's), not a launch of their own
    first = data_fc1_frozen[0] / "ckpt_2.h5"
    saved = _saved(first)
    for n, value in (("fc1/weight", 0.25), ("fc1/bias", 0.5)):
        w = saved[f"params/{n}"]
        np.testing.assert_array_equal(w.view(np.uint32), np.full_like(w, value).view(np.uint32))
    assert not [k for k in saved if k.startswith("solver/fc1")]
    sharded = {"scheme": "sharded", "shard": 3, "min_buckets": 1}
    thawed = _saved(run("thawed", _conv_raw(("conv1",), solver, sharded), "--resume", first)
                    / "ckpt_4.h5")
    zeros = _with_zero_state(first, tmp_path / "zeros.h5", ("fc1",), solver)
    ref = _saved(run("zeros", _conv_raw(("conv1",), solver, sharded), "--resume", zeros)
                 / "ckpt_4.h5")
    _bitwise(thawed, saved, ["params/conv1/weight", "params/conv1/bias"])
    assert sorted(thawed) == sorted(ref)
    _bitwise(thawed, ref, list(ref))
    assert (thawed["params/fc1/weight"] != saved["params/fc1/weight"]).all()


def test_a_net_whose_parameters_are_all_frozen_is_refused():
    """Nothing to train: exit 2 naming ``net`` and the frozen parameters
    (before: every update a no-op, the run trained nothing)."""
    from tests.conftest import make_job
    from purine_mpi.base.errors import ConfigError
    from purine_mpi.job.replica import build_train_graph
    with pytest.raises(ConfigError, match=r"'net'.*every one is frozen, lr_mult 0: conv1/weight"):
        build_train_graph(make_job(_conv_raw(("conv1", "fc1", "fc2"))))


# ------------------------------------------- ZeRO stage 3: frozen weights sharded
def _units(g):
    """{shard blob: (flat buffer, frozen params)} of the frozen units of ``g``."""
    out = {}
    for name, b in g.blobs.items():
        if b.kind == "param" and b.alias_of and g.blobs[b.alias_of].name.startswith("frozen_"):
            out.setdefault(f"{b.alias_of}.shard", (b.alias_of, []))[1].append(name)
    return out


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("frozen", [("fc1",), ("conv1",)])
def test_stage3_shards_frozen_weights(n, frozen):
    """Sharded stage 3 on n ranks (AdamW), composed offline for every rank:
    each frozen weight is a view of a transient flat buffer (the working
    set) that one Allgather fills from the rank's persistent 1/n shard
    before its forward readers (and another for its backward readers: a
    frozen fc1's data gradient); the shard is read by gathers alone, no
    reduce-scatter, update or solver state touches it. Per rank the weights
    row (``plan``'s, the model-state row's) is 4 bytes times the rank's
    elements of every unit, learning and frozen (``shard_range``): summed
    over the ranks 4 Psi exactly, the frozen part 4 Psi_frozen/n up to an
    element per unit (an empty shard counts one element, the arena's
    rule). The collectives' seq and signatures are the same on
    every rank. Before: the frozen weights held whole on every rank (fc1:
    rank 0's weights row 1,756 bytes on 2 ranks, not 976)."""
    from purine_mpi.comm.ops import shard_range
    from purine_mpi.comm.verify import comm_signature, compare_signatures
    from purine_mpi.parallel.sharding import PARAM_GATHERED_KIND, WORKING_SET_ATTR
    from purine_mpi.runtime.memory_plan import check_plan, plan_memory
    from purine_mpi.tools.graph import compose_for
    from purine_mpi.tools.plan import offline_footprint
    from tests.conftest import make_job
    job = make_job(_conv_raw(frozen, "adamw", {"scheme": "sharded", "shard": 3}))
    plain = compose_for(make_job(_conv_raw(frozen, "adamw")), 1, 0)
    still = [p for p in PARAMS if p.split("/")[0] in frozen]
    psi = sum(plain.blobs[p].size for p in PARAMS)
    psi_frozen = sum(plain.blobs[p].size for p in still)
    held, seqs, signatures, empty = [], [], [], 0
    for rank in range(n):
        g = compose_for(job, n, rank)
        units = _units(g)
        assert sorted(p for _, ps in units.values() for p in ps) == sorted(still), units
        mem = plan_memory(g)
        assert check_plan(g, mem) == []
        mine = 0
        for shard, (buf, params) in units.items():
            assert g.blobs[buf].attrs.get(WORKING_SET_ATTR) == "weights"
            assert buf not in mem.persistent and shard in mem.persistent
            size = g.blobs[buf].size
            lo, hi = shard_range(size, n, rank)
            assert g.blobs[shard].size == hi - lo
            mine += hi - lo
            readers = [op for op in g.ops.values() if shard in op.inputs]
            assert readers and {op.op_type for op in readers} == {"Allgather"}
            assert not [op.name for op in g.ops.values()
                        if any(g.storage_root(o) == shard for o in op.outputs)]
            gathered = {op.outputs[0] for op in readers}
            for p in params:  # every reader waits for the gather of the buffer it reads
                for op in g.ops.values():
                    reads = [x for x in op.inputs if x == p or (
                        g.blobs[x].kind == PARAM_GATHERED_KIND and x.startswith(f"{p}.bwd"))]
                    if reads:
                        root = g.storage_root(reads[0])
                        assert root in gathered, (op.name, root)
                        assert any(c in {r.name for r in readers} for c in op.control_inputs)
        if frozen == ("fc1",):  # conv1 learns below: the data gradient reads a gathered view
            grad_data = g.ops["fc1.bwd.inner_product_grad_data"]
            assert g.blobs[grad_data.inputs[1]].kind == PARAM_GATHERED_KIND, grad_data.inputs
        assert not [op.name for op in g.ops.values() if op.op_type == "ReduceScatter"
                    and any(x.split(".grad")[0] in still for x in op.inputs)]
        fp = offline_footprint(job, n, rank)
        assert fp.host["weights"] == fp.model_state["weights"]
        # every unit's shard, learning or frozen: its elements, one at least
        # (the arena's rule for an empty shard: memory_plan._root_nbytes)
        counts = [hi - lo for b in g.blobs.values() if b.kind == "param_buffer" and
                  b.attrs.get(WORKING_SET_ATTR) == "weights"
                  for lo, hi in [shard_range(b.size, n, rank)]]
        assert fp.model_state["weights"] == 4 * sum(max(c, 1) for c in counts), \
            (rank, fp.model_state)
        empty += sum(c == 0 for c in counts)
        assert abs(4 * mine - 4 * psi_frozen / n) <= 4 * len(units)
        assert fp.model_state["working"] > 0
        held.append(fp.model_state["weights"])
        seqs.append(sorted((op.attrs["seq"], op.name) for op in g.ops.values()
                           if op.op_type in ("Allgather", "ReduceScatter")))
        signatures.append(comm_signature(g))
    assert sum(held) == 4 * (psi + empty), (held, psi, empty)
    assert all(s == seqs[0] for s in seqs)
    assert compare_signatures(signatures) == []


def _mpi_run(tmp_path, name, n, raw, *more):
    """(run folder, the command's output) of ``train`` on ``n`` ranks."""
    from tests.conftest import run_mpi_cli, write_config_file
    res = run_mpi_cli(n, "train", write_config_file(tmp_path, raw, f"{name}.yaml"), "--out",
                      tmp_path / name, *more, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    return tmp_path / name, res.stdout + res.stderr


def _fillers(saved, ckpt):
    """fc1 (frozen) bit for bit its fillers in checkpoint ``saved``."""
    for n, value in (("fc1/weight", 0.25), ("fc1/bias", 0.5)):
        w = saved[f"params/{n}"]
        np.testing.assert_array_equal(w.view(np.uint32), np.full_like(w, value).view(np.uint32),
                                      err_msg=f"{n} in {ckpt}")
    assert not [k for k in saved if k.startswith("solver/fc1")]


@pytest.mark.mpi
def test_stage3_with_a_frozen_layer_trains_as_data_parallel(tmp_path, data_fc1_frozen):
    """2 ranks, AdamW, fc1 frozen (conv1 below it learns: its data
    gradient reads fc1's gathered weight), 4 steps: every weight and
    solver state of sharded stage 3 equal data parallelism's bit for bit
    (at step 2 and 4), fc1 bitwise its fillers in both checkpoints. The
    start-up block: the frozen weights in units of their own, and the
    model state's weights 4 Psi/2 (up to an element per unit), the frozen
    ones included. Before: the weights row held fc1 whole (1,756 bytes
    on rank 0, not 976); the numbers were the same."""
    from purine_mpi.tools.plan import offline_footprint
    from tests.conftest import make_job
    from tests.test_sharded import _model_state
    runs = {"data": data_fc1_frozen,
            "z3": _mpi_run(tmp_path, "z3", 2, _conv_raw(("fc1",), "adamw", {
                "scheme": "sharded", "shard": 3, "check_collectives": True}))}
    text = runs["z3"][1]
    for it in (2, 4):
        a, b = (_saved(runs[s][0] / f"ckpt_{it}.h5") for s in ("data", "z3"))
        assert sorted(a) == sorted(b) and any(k.startswith("solver/") for k in a)
        _bitwise(a, b, list(a))
        _fillers(b, f"ckpt_{it}")
    weights, _, _ = _model_state(text)  # rank 0's start-up row, as plan figures it
    job = make_job(_conv_raw(("fc1",), "adamw", {"scheme": "sharded", "shard": 3}))
    assert weights == offline_footprint(job, 2, 0).model_state["weights"]
    psi = sum(_saved(runs["data"][0] / "ckpt_4.h5")[f"params/{p}"].size for p in PARAMS)
    _half(weights, psi, 2)
    assert "sharded (ZeRO stage 3)" in text and "the frozen weights (lr_mult 0) held as 1/2 " \
        "shards too" in text, text


def _half(weights, psi, n):
    """The weights row: 4 Psi/n, up to an element per unit (6 parameters:
    at most 4 learning buckets and 2 frozen units)."""
    assert 4 * psi / n <= weights <= 4 * psi / n + 4 * 6, (weights, 4 * psi / n)


@pytest.mark.mpi
def test_stage3_frozen_checkpoint_reshards(tmp_path):
    """A 3-rank stage-3 run with fc1 frozen (global batch 12) saves at
    step 2: fc1 bitwise its fillers (joined whole from the three ranks'
    shards). Resumed on 2 ranks to step 4 under stage 3 and under scheme
    data: every weight and state of the two equal bit for bit, fc1 still
    its fillers (each rank loaded its shard of it). The stage-3 resume's
    start-up block holds the weights, the frozen ones included, as 1/2
    shards: 4 Psi/2 (before: fc1 held whole, 1,756 bytes on rank 0; the
    round trip was right then too)."""
    raw = _conv_raw(("fc1",), "adamw", {"scheme": "sharded", "shard": 3}, iters=2,
                    data={"source": "synthetic", "shape": [2, 4, 4], "classes": 3,
                          "batch_size": 4})
    first, _ = _mpi_run(tmp_path, "three", 3, raw)
    ckpt = first / "ckpt_2.h5"
    _fillers(_saved(ckpt), "the 3-rank checkpoint")
    ends = {}
    for scheme, par in (("z3", {"scheme": "sharded", "shard": 3}), ("data", {"scheme": "data"})):
        raw = _conv_raw(("fc1",), "adamw", par, data={
            "source": "synthetic", "shape": [2, 4, 4], "classes": 3, "batch_size": 6})
        out, text = _mpi_run(tmp_path, scheme, 2, raw, "--resume", ckpt)
        assert "resumed from" in text
        ends[scheme] = _saved(out / "ckpt_4.h5")
        if scheme == "z3":
            from tests.test_sharded import _model_state
            _half(_model_state(text)[0], sum(v.size for k, v in ends[scheme].items()
                                             if k.startswith("params/")), 2)
            assert "the frozen weights (lr_mult 0) held as 1/2 shards too" in text, text
    _bitwise(ends["z3"], ends["data"], list(ends["data"]))
    _fillers(ends["z3"], "the resumed stage-3 checkpoint")

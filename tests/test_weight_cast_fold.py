"""The weights' low-precision copies written by the fused Adam/AdamW update
(parallel/precision.fold_weight_casts, cuda/adam.cu's copy modes) instead of
a Cast op per weight before the forward.

- the graph: no Cast of a weight an Adam update moves; a frozen weight's,
  an SGD-updated weight's and a weight of a run with the fold off keep
  theirs (the old path);
- the kernels (emulated device; a real GPU with ``-m gpu``): the copy the
  single-parameter and the multi-tensor kernels write is, bit for bit, the
  Cast's rounding of the new weights (bfloat16 bits, bfloat16 and float16
  values in float32 storage), ties, subnormals, infinities and NaNs
  included, and the weights are those of the update without a copy;
- the trainer on the emulated device (a tiny GPT): with the fold and
  without it, the losses and the float32 masters after N steps are bitwise
  equal, and each copy is the rounding of its master; under fp16 too, with
  a skipped step (an injected inf); a resume rebuilds the copies from the
  loaded masters (its losses those of the uninterrupted run, bit for bit).
"""
import json

import numpy as np
import pytest

from purine_mpi.base.precision import BITS, round_to, scratch_spec, to_bf16_bits, wire_scratch
from tests.gpt_oracle import gpt_graph, gpt_net

SOLVER = {"type": "adamw", "base_lr": 0.01, "lr_policy": "fixed", "weight_decay": 0.1,
          "max_iter": 10}


def _graph(monkeypatch, fold=True, solver=SOLVER, freeze=None, precision="bf16"):
    from purine_mpi.parallel.placement import prepare_for_device
    monkeypatch.setenv("PURINE_FOLD_WEIGHT_CASTS", "1" if fold else "0")
    net = gpt_net(vocab=16, width=8, heads=2, blocks=2, max_length=6, approximate="tanh")
    g, _, _ = gpt_graph(net, solver, 2, 6)
    params = [p.name for p in g.params()]
    for op in g.ops.values():   # the update of ``freeze`` at lr_mult 0
        if op.op_type.endswith("Update") and op.inputs[0] == freeze:
            op.attrs["lr_mult"] = 0.0
    prepare_for_device(g, 0, precision=precision)
    return g, params


def _weight_casts(g, params):
    return sorted(op.inputs[0] for op in g.ops.values()
                  if op.op_type == "Cast" and op.inputs[0] in params)


def test_no_weight_cast_is_left_for_the_weights_the_adam_update_moves(monkeypatch):
    """Folded: no Cast reads a weight; the fused AdamW op writes each copy
    (its ``<copy>@new`` alias), and every copy a product reads is one of
    them. Off: one Cast per parameter a bf16 product reads (17 here: the
    tied embedding, per block the weights and biases of its 4 products)."""
    old, params = _graph(monkeypatch, fold=False)
    cast = _weight_casts(old, params)
    assert len(cast) == 17 and "wte/weight" in cast and "h1_fc/bias" in cast
    new, _ = _graph(monkeypatch)
    assert _weight_casts(new, params) == []
    (update,) = [op for op in new.ops.values() if op.op_type == "MultiAdamUpdate"]
    written = [update.attrs["params"][k] for k in update.attrs["copy_of"]]
    assert sorted(written) == cast
    assert len(update.outputs) == 3 + len(cast)
    for out, w, bits in zip(update.outputs[3:], written, update.attrs["copy_bits"]):
        copy = new.blobs[out].alias_of
        assert new.blobs[copy].kind == "param_copy" and new.blobs[copy].attrs["copy_of"] == w
        assert bits == (new.blobs[copy].dtype == BITS) and new.blobs[out].dtype == \
            new.blobs[copy].dtype
    # the update comes after every reader of the copies (write after read)
    deps = new.dependencies()
    cons = new.consumers()
    for out in update.outputs[3:]:
        for reader in cons[new.blobs[out].alias_of]:
            assert reader.name in _ancestors(deps, update.name), (out, reader.name)


def _ancestors(deps, name):
    seen, stack = set(), [name]
    while stack:
        for p in deps[stack.pop()] - seen:
            seen.add(p)
            stack.append(p)
    return seen


def test_a_frozen_weight_and_an_sgd_update_keep_their_casts(monkeypatch):
    """A weight at lr_mult 0 (no update writes it) keeps its Cast; an SGD
    solver's weights (its kernel writes no copy) keep all of theirs."""
    g, params = _graph(monkeypatch, freeze="h1_fc/weight")
    assert _weight_casts(g, params) == ["h1_fc/weight"]
    g, params = _graph(monkeypatch, solver=dict(SOLVER, type="sgd", momentum=0.9))
    assert len(_weight_casts(g, params)) == 17


@pytest.mark.parametrize("scheme,folds", [
    ({"scheme": "data"}, True), ({"scheme": "tensor", "tensor_parallel": 2}, True),
    ({"scheme": "sharded", "shard": 1, "backend": "nccl"}, False),
    ({"scheme": "sharded", "shard": 3, "backend": "nccl"}, False)],
    ids=["data", "tensor", "zero1", "zero3"])
def test_schemes_fold_where_the_update_writes_the_whole_weight(tmp_path, scheme, folds):
    """Rank 0 of 2 in bf16 on a GPU (composed offline): scheme data's and
    tensor's updates move each (shard of a) weight whole, so their Casts
    go; a ZeRO stage's update moves a shard of a bucket and an all-gather
    writes the weights the products read: the Casts of the gathered weights
    stay (the old path, where it was)."""
    from tests.conftest import make_job
    from tests.gpt_nets import gpt_config, text_h5
    from purine_mpi.job.config import validate_config
    from purine_mpi.tools.graph import compose_for
    raw = gpt_config(text_h5(tmp_path), layers=2, width=16, heads=2, length=8, batch=4,
                     iters=4, parallel=dict(scheme, bucket_mb=0.02))
    raw.update(device=0, precision="bf16")
    g = compose_for(make_job(validate_config(raw, check_files=False)), 2, 0)
    weight_casts = [op for op in g.ops.values() if op.op_type == "Cast" and
                    g.blobs[g.storage_root(op.inputs[0])].kind in ("param", "param_buffer",
                                                                   "bucket")]
    copies = [b for b in g.blobs.values() if b.kind == "param_copy"]
    assert (not weight_casts and copies) if folds else (weight_casts and not copies)


# ------------------------------------------------------------- kernels
def _cast(w, mode):
    """The Cast's result on the host (base/precision): bits or float32."""
    w = np.ascontiguousarray(w, np.float32)
    if mode == "bits":
        out = np.empty(w.shape, np.uint16)
        to_bf16_bits(w, out, np.empty(wire_scratch(w.size).shape, np.uint32))
        return out
    dtype = "bfloat16" if mode == "bf16" else "float16"
    out = w.copy()
    shape, sd = scratch_spec(out.shape, dtype)
    round_to(out, dtype, np.empty(shape, sd))
    return out


def _awkward(rng, n):
    """Weights whose roundings test the rules: ties (bf16 and fp16), the
    largest values (carry into infinity), float16 subnormals, infinities,
    NaNs (payload in the low bits only too), zeros of both signs."""
    w = rng.standard_normal(n).astype(np.float32)
    special = np.array([0x3f808000, 0x3f818000, 0x3f800fff, 0x7f7fffff, 0xff7fffff,
                        0x7f800000, 0xff800000, 0x7fc00001, 0x7f800001, 0x00000000,
                        0x80000000, 0x33800000, 0x387fc000, 0x477ff000, 0x477fefff,
                        0x3f801000, 0x3f803000], np.uint32).view(np.float32)
    w[:special.size] = special
    return w


@pytest.mark.parametrize("mode", ["bits", "bf16", "fp16"])
def test_the_adam_kernels_write_the_casts_bits(device, mode):
    """adam_update and adam_multi with a copy: the copy is the Cast's
    rounding of the new weights, the weights those of the kernel without a
    copy. At lr 0 the weights stay as they are, so the awkward values
    reach the rounding; then a normal step."""
    from purine_mpi.gpu import kernels
    rng = np.random.default_rng(5)
    n = 103
    precision = "float16" if mode == "fp16" else "bfloat16"
    copy_dtype = np.uint16 if mode == "bits" else np.float32
    for lr in (0.0, 0.01):
        w = _awkward(rng, n) if lr == 0 else rng.standard_normal(n).astype(np.float32)
        g = rng.standard_normal(n).astype(np.float32)
        m = (0.1 * rng.standard_normal(n)).astype(np.float32)
        v = np.abs(0.01 * rng.standard_normal(n)).astype(np.float32)
        plain = [device.to_device(a.copy()) for a in (w, m, v)]
        kernels.adam_update(plain[0], device.to_device(g), plain[1], plain[2], lr, 3,
                            weight_decay=0.1, decoupled=True)
        with_copy = [device.to_device(a.copy()) for a in (w, m, v)]
        copy = device.to_device(np.zeros(n, copy_dtype))
        device.launched.clear()
        kernels.adam_update(with_copy[0], device.to_device(g), with_copy[1], with_copy[2], lr,
                            3, weight_decay=0.1, decoupled=True, copy=copy,
                            precision=precision)
        assert device.launched == ["adam_update"]
        new_w = device.to_host(with_copy[0])
        assert new_w.tobytes() == device.to_host(plain[0]).tobytes()
        assert device.to_host(copy).tobytes() == _cast(new_w, mode).tobytes(), (lr, mode)
        # the multi-tensor kernel: two parameters in flat buffers, the
        # second's copy only (the first has none: its mode 0)
        sizes, offsets = [40, n - 40], [0, 48]
        flat = [np.zeros(48 + n - 40, np.float32) for _ in range(3)]
        for f, a in zip(flat, (w, m, v)):
            f[:40], f[48:] = a[:40], a[40:]
        flat_d = [device.to_device(f) for f in flat]
        grads = [device.to_device(g[:40].copy()), device.to_device(g[40:].copy())]
        copy2 = device.to_device(np.zeros(sizes[1], copy_dtype))
        table = kernels.MultiTensorTable(grads, offsets, [1.0, 1.0], [0.1, 0.1], np.float32,
                                         factor_dtype=np.float64, copies=[None, copy2],
                                         precision=precision)
        device.launched.clear()
        kernels.adam_multi(*flat_d, table, lr, 3, decoupled=True)
        assert device.launched == ["adam_multi"]
        got = device.to_host(flat_d[0])
        assert np.concatenate([got[:40], got[48:]]).tobytes() == new_w.tobytes()
        assert device.to_host(copy2).tobytes() == _cast(got[48:], mode).tobytes()


@pytest.mark.parametrize("mode", ["bits", "bf16"])
def test_the_update_ops_write_their_copy_output(device, mode):
    """The ops (ops/updates.py) with the fold's attrs: AdamWUpdate's fourth
    output and MultiAdamUpdate's outputs after the flat buffers are the
    Cast of the new weights -- on the device by the kernel, on the host
    (NumPy: the op's generic path, ops/basic.cast_copy after the update);
    ``infer`` gives the copies' shapes and storage."""
    from purine_mpi.graph.core import Op
    from purine_mpi.ops.catalog import get_kernel_class
    bits = mode == "bits"
    rng = np.random.default_rng(9)
    w, g = rng.standard_normal((2, 7, 5)).astype(np.float32)
    m = (0.1 * rng.standard_normal((7, 5))).astype(np.float32)
    v = np.abs(0.01 * rng.standard_normal((7, 5))).astype(np.float32)
    attrs = {"weight_decay": 0.1, "copy_dtype": "bfloat16", "copy_bits": bits}
    single = get_kernel_class("AdamWUpdate")
    shapes = single.infer(attrs, [((7, 5), "float32")] * 4 + [((1,), "float32"),
                                                               ((1,), "int64")])
    assert shapes[3] == ((7, 5), BITS if bits else "float32")
    lr, it = np.array([0.01], np.float32), np.array([2], np.int64)
    for put in (device.to_device, np.array):
        state = [put(a.copy()) for a in (w, m, v)]
        copy = put(np.zeros((7, 5), np.uint16 if bits else np.float32))
        op = single(Op("u", "AdamWUpdate", [], [], dict(attrs)))
        device.launched.clear()
        op.run([state[0], put(g), state[1], state[2], lr, it], state + [copy])
        if put is device.to_device:
            assert device.launched == ["adam_update"]   # the copy in the same pass
        new_w = np.asarray(device.to_host(state[0]) if put is device.to_device else state[0])
        got = device.to_host(copy) if put is device.to_device else copy
        assert np.asarray(got).tobytes() == _cast(new_w, mode).tobytes(), put
    # the multi-tensor op on the host: parameter 1 of 2 has a copy
    multi = get_kernel_class("MultiAdamUpdate")
    mattrs = {"sizes": [35, 35], "offsets": [0, 64], "lr_mults": [1.0, 1.0],
              "decay_mults": [1.0, 1.0], "weight_decay": 0.1, "decoupled": True,
              "params": ["a", "b"], "copy_of": [1], "copy_dtype": "bfloat16",
              "copy_bits": [bits]}
    flat = [np.zeros(99, np.float32) for _ in range(3)]
    for f, a in zip(flat, (w, m, v)):
        f[:35], f[64:] = a.reshape(-1), a.reshape(-1)
    ins = flat + [lr, it, g.copy(), g.copy()]
    shapes = multi.infer(mattrs, [(a.shape, str(a.dtype)) for a in ins])
    assert shapes[3] == ((7, 5), BITS if bits else "float32") and len(shapes) == 4
    copy = np.zeros((7, 5), np.uint16 if bits else np.float32)
    op = multi(Op("u", "MultiAdamUpdate", [], [], mattrs))
    op.setup(ins, flat + [copy])
    op.run(ins, flat + [copy])
    assert flat[0][:35].tobytes() == flat[0][64:].tobytes()
    assert copy.tobytes() == _cast(flat[0][64:].reshape(7, 5), mode).tobytes()


def test_a_copy_of_the_wrong_storage_is_refused(device):
    from purine_mpi.gpu import kernels
    w, g, m, v = (device.to_device(np.ones(8, np.float32)) for _ in range(4))
    with pytest.raises(ValueError, match="float16 copy of uint16 storage"):
        kernels.adam_update(w, g, m, v, 0.01, 0, copy=device.to_device(np.zeros(8, np.uint16)),
                            precision="float16")
    with pytest.raises(ValueError, match="8 elements"):
        kernels.adam_update(w, g, m, v, 0.01, 0, copy=device.to_device(np.zeros(4, np.uint16)))


# ------------------------------------------------------------- trainer
def _train(monkeypatch, tmp_path, name, precision, iters, fold, resume=None, interval=0,
           clip=None):
    from tests.conftest import FakeWorld, make_job
    from tests.gpt_nets import gpt_config, text_h5
    from purine_mpi.base.backend import to_numpy
    from purine_mpi.job.config import validate_config
    from purine_mpi.train.trainer import Trainer, run_and_report
    monkeypatch.setenv("PURINE_FOLD_WEIGHT_CASTS", "1" if fold else "0")
    raw = gpt_config(text_h5(tmp_path), layers=2, width=16, heads=2, length=8, batch=4,
                     iters=iters)
    raw.update(device=0, precision=precision, cuda_graph=False)
    raw["data"].pop("test")
    raw["solver"].update(base_lr=0.01, test_interval=0)
    if clip is not None:
        raw["solver"]["clip_gradients"] = clip
    raw["checkpoint"] = {"interval": interval, "keep": 0}
    out = tmp_path / name
    t = Trainer(make_job(validate_config(raw, check_files=False)), str(out), world=FakeWorld(),
                log=lambda line: None, resume=resume)
    assert run_and_report(t, FakeWorld()) == 0
    rows = [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]
    ws, g = t.train.workspace, t.graphs.graph
    masters = {p: np.array(to_numpy(ws[p])) for p in t.graphs.params}
    copies = {b: (blob.attrs["copy_of"], np.array(to_numpy(ws[b])),
                  blob.attrs.get("precision"))
              for b, blob in g.blobs.items() if blob.kind == "param_copy" and not blob.alias_of}
    casts = [op.inputs[0] for op in g.ops.values()
             if op.op_type == "Cast" and op.inputs[0] in t.graphs.params]
    losses = {r["iter"]: r["loss"] for r in rows if r["phase"] == "train"}
    return losses, masters, copies, casts, rows


def _check_copies(copies, masters):
    assert copies
    for name, (w, value, precision) in copies.items():
        mode = "bits" if value.dtype == np.uint16 else \
            ("bf16" if precision == "bfloat16" else "fp16")
        assert value.tobytes() == _cast(masters[w], mode).tobytes(), name


@pytest.mark.parametrize("precision,storage,clip", [("bf16", "1", None), ("bf16", "0", 0.05),
                                                    ("fp16", "1", None)],
                         ids=["bf16-bits", "bf16-float32-clipped", "fp16"])
def test_folded_and_separate_casts_train_bit_for_bit_alike(host_build_dir, monkeypatch,
                                                           tmp_path, precision, storage, clip):
    """A tiny GPT, 3 steps (fp16: 5) on the emulated device, with the copies written by
    the update and with the Casts: the same losses and float32 masters, bit
    for bit; the update's copies are the roundings of the final masters.
    bf16 with float32 storage (copies of bfloat16 values in float32) also
    clips the gradients (solver.clip_gradients 0.05). fp16: step 3 holds an
    injected inf, skipped alike (the masters and their copies untouched by
    it)."""
    from tests.emulated_gpu import emulated_trainer_env
    emulated_trainer_env(monkeypatch, host_build_dir)
    monkeypatch.setenv("PURINE_BF16_STORAGE", storage)
    if precision == "fp16":
        monkeypatch.setenv("PURINE_FP16_INJECT_INF", "3")
    # 3 steps: steps 2 and 3 read copies the update wrote; fp16's 5 hold the
    # skipped step 3 and two steps after it
    iters = 5 if precision == "fp16" else 3
    old = _train(monkeypatch, tmp_path, "old", precision, iters, fold=False, clip=clip)
    new = _train(monkeypatch, tmp_path, "new", precision, iters, fold=True, clip=clip)
    assert old[3] and not old[2]             # the old path: Casts, no copies kept
    assert not new[3] and new[2]             # the fold: no weight Cast
    assert sorted(new[0]) == list(range(1, iters + 1))
    assert new[0] == old[0]
    for p, value in old[1].items():
        assert new[1][p].tobytes() == value.tobytes(), p
    _check_copies(new[2], new[1])
    if precision == "fp16":
        for run in (old, new):
            assert [r["skipped_steps"] for r in run[4] if r["phase"] == "train"] == \
                [0, 0, 1, 1, 1]


def test_a_resume_rebuilds_the_copies_from_the_loaded_masters(host_build_dir, monkeypatch,
                                                              tmp_path):
    """Folded, a run resumed from its step-3 checkpoint trains steps 4-6
    bit for bit as the uninterrupted run: its copies are made from the
    loaded masters before its first step (not the fillers' copies of the
    fresh start)."""
    from tests.emulated_gpu import emulated_trainer_env
    emulated_trainer_env(monkeypatch, host_build_dir)
    whole = _train(monkeypatch, tmp_path, "whole", "bf16", 6, fold=True, interval=3)
    resumed = _train(monkeypatch, tmp_path, "resumed", "bf16", 6, fold=True,
                     resume=str(tmp_path / "whole" / "ckpt_3.h5"))
    assert sorted(resumed[0]) == [4, 5, 6]
    assert [resumed[0][i] for i in (4, 5, 6)] == [whole[0][i] for i in (4, 5, 6)]
    for p, value in whole[1].items():
        assert resumed[1][p].tobytes() == value.tobytes(), p
    _check_copies(resumed[2], resumed[1])


def test_a_weight_set_from_outside_is_copied_before_the_next_run():
    """The bookkeeping (runtime/dispatcher.py, runtime/workspace.py): a
    dispatcher whose graph keeps a weight copy (kind param_copy) makes it
    from its weight before its first run, and again after the weight is
    written from outside -- through Workspace.set, or in place followed by
    weights_changed -- and not otherwise (a write in place unannounced
    leaves the copy as it was: the copy is the update's to keep)."""
    from purine_mpi.graph.core import Graph
    from purine_mpi.runtime.dispatcher import SerialDispatcher
    g = Graph()
    g.add_blob("w", (5,), "float32", kind="param")
    g.add_blob("w@bf16", (5,), BITS, kind="param_copy",
               attrs={"copy_of": "w", "precision": "bfloat16"})
    g.add_blob("y", (5,), "float32")
    g.add_op("y.cast", "Cast", ["y0"], ["y"], {"dtype": "bfloat16"})
    g.blobs["y0"].shape = (5,)
    d = SerialDispatcher(g, seed=0)
    try:
        ws = d.workspace
        assert d.weight_copies == [("w@bf16", "w", "bfloat16")]
        first = np.array([1.0, 1.00390625, -3.3, 7e30, 1e-3], np.float32)   # a tie at [1]
        ws.set("w", first)
        d.run(0)
        assert np.asarray(ws["w@bf16"]).tobytes() == _cast(first, "bits").tobytes()
        ws.arrays["w"][...] = 2.5   # unannounced: the copy stays
        d.run(1)
        assert np.asarray(ws["w@bf16"]).tobytes() == _cast(first, "bits").tobytes()
        ws.weights_changed()
        d.run(2)
        assert np.asarray(ws["w@bf16"]).tobytes() == _cast(np.full(5, 2.5), "bits").tobytes()
        third = np.linspace(-2, 2, 5).astype(np.float32)
        ws.set("w", third)
        d.run(3)
        assert np.asarray(ws["w@bf16"]).tobytes() == _cast(third, "bits").tobytes()
    finally:
        d.close()


# ------------------------------------------------------------- memory
def test_plan_counts_the_persistent_copies_as_the_run_holds_them(host_build_dir, monkeypatch,
                                                                 tmp_path):
    """``plan``'s device figures of a bf16 AdamW GPT (emulated device, one
    iteration) against the measured peak, less the cuBLAS workspaces that
    dwarf the rest (32 MiB: the copies are under 1% of the total). Folded,
    the copies are kept between iterations (kind param_copy, outside the
    arena): the weights row is the Casts' run's plus their bytes (each
    rounded up to the device allocator's 512 bytes at most); either way the
    plan is the peak within 2%."""
    from tests.emulated_gpu.helpers import emulated_gpu_env
    emulated_gpu_env(monkeypatch, host_build_dir)
    rows = {}
    for fold in (True, False):
        monkeypatch.setenv("PURINE_FOLD_WEIGHT_CASTS", "1" if fold else "0")
        rows[fold], copies = _plan_and_peak(tmp_path)
        assert bool(copies) == fold
        if fold:
            held = copies
    grown = rows[True]["weights"] - rows[False]["weights"]
    assert sum(held) <= grown < sum(held) + 512 * len(held), (rows, held)


def _plan_and_peak(tmp_path):
    """(plan's device rows, [bytes of each weight copy the graph keeps])
    of the tiny bf16 GPT, after checking the plan's total (less the cuBLAS
    workspaces) against one iteration's measured peak."""
    import gc
    from tests.conftest import make_job
    from tests.gpt_nets import gpt_config, text_h5
    from purine_mpi.gpu import blas, import_cupy
    from purine_mpi.job.config import validate_config
    from purine_mpi.tools.bench import run_bench
    from purine_mpi.tools.graph import compose_for
    from purine_mpi.tools.plan import offline_footprint
    raw = gpt_config(text_h5(tmp_path), layers=1, width=32, heads=2, length=16, batch=4,
                     iters=1)
    raw.update(device=0, precision="bf16", cuda_graph=False)
    raw["data"].pop("test")
    job = make_job(validate_config(raw, check_files=False))
    fp = offline_footprint(job, 1, 0)
    rows = fp.devices[0]
    copies = [int(np.prod(b.shape)) * (2 if b.dtype == BITS else 4)
              for b in compose_for(job, 1, 0).blobs.values()
              if b.kind == "param_copy" and not b.alias_of]
    blas.reset()
    mark = blas.made_mark()
    gc.collect()
    held = import_cupy().get_default_memory_pool().used_bytes()
    res = run_bench(job, iters=1, warmup=0)
    workspaces = sum(blas.made_since(mark, 0).values())
    assert rows["cublas_workspaces"] == workspaces > 0
    planned = fp.device_total(0) - workspaces
    measured = res["device_peak_bytes"]["0"] - held - workspaces
    assert sum(copies) < 0.2 * measured
    assert abs(planned - measured) <= 0.02 * measured, (rows, planned, measured, copies)
    return rows, copies

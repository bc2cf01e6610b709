"""Trust review (session 71) of the features since 524c60a, as a user meets
them, on the emulated device (tests/emulated_gpu): a tiny bf16/fp16 GPT
(its head tied to the embedding) trained a few steps.

- the weight copies the fused Adam/AdamW update writes
  (parallel/precision.fold_weight_casts) in each flow where the float32
  masters change outside that update, or the update does something else
  than the plain step: the same run with ``PURINE_FOLD_WEIGHT_CASTS=0``
  (the Casts) is the truth -- the losses and every master bit for bit, and
  each copy the rounding of its master, bit for bit. The flows
  test_weight_cast_fold.py leaves out: an lr warm-up and a rate of 0,
  Adam (not W) with weight-decay exclusions and a frozen layer, micro-
  batches with recompute, a CUDA-graph run with a test pass every
  iteration, an fp16 step skipped at step 1 in a CUDA graph, a resume
  across precisions (fp32 -> bf16, bf16 -> fp32, fp16 -> bf16), ``--init``
  from a checkpoint; and the checkpoint of a folded run is the unfolded
  run's (what ``generate``, ``export onnx`` and ``inspect`` read: no copy
  in it);
- the opt-in kernels (``PURINE_GELU_BIAS_GRAD=1``, ``PURINE_LN_SUMS=1``)
  on shapes a user has, in training: an fc width not a multiple of 4 (the
  fused GELU pass falls back to the two kernels), fp16, a layer norm width
  not a multiple of 4 and one above 768 (the sums' kernel refuses both:
  the default kernels, silently) -- bit for bit the default run;
- ``bench`` of a diverging run on a GPU names the blob that went NaN.
"""
import json

import numpy as np
import pytest

from tests.test_weight_cast_fold import _check_copies


def _run(monkeypatch, tmp_path, name, precision="bf16", iters=3, fold=True, edit=None,
         resume=None, init=None, interval=0, layers=2, width=16):
    """(losses by iteration, float32 masters, {copy: (weight, value,
    precision)}, the metrics rows, the CUDA-graph report) of a tiny GPT
    trained ``iters`` steps on the emulated device (``edit``: a function of
    the raw config)."""
    from tests.conftest import FakeWorld, make_job
    from tests.gpt_nets import gpt_config, text_h5
    from purine_mpi.base.backend import to_numpy
    from purine_mpi.job.config import validate_config
    from purine_mpi.train.trainer import Trainer, run_and_report
    monkeypatch.setenv("PURINE_FOLD_WEIGHT_CASTS", "1" if fold else "0")
    raw = gpt_config(text_h5(tmp_path), layers=layers, width=width, heads=2, length=8,
                     batch=4, iters=iters)
    raw.update(device=0, cuda_graph=False)
    if precision != "fp32":
        raw["precision"] = precision
    raw["data"].pop("test")
    raw["solver"].update(base_lr=0.01, test_interval=0)
    raw["checkpoint"] = {"interval": interval, "keep": 0}
    if edit:
        edit(raw)
    out = tmp_path / name
    t = Trainer(make_job(validate_config(raw, check_files=False)), str(out), world=FakeWorld(),
                log=lambda line: None, resume=resume, init=init)
    assert run_and_report(t, FakeWorld()) == 0
    rows = [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]
    ws, g = t.train.workspace, t.graphs.graph
    masters = {p: np.array(to_numpy(ws[p])) for p in t.graphs.params}
    copies = {b: (blob.attrs["copy_of"], np.array(to_numpy(ws[b])), blob.attrs.get("precision"))
              for b, blob in g.blobs.items() if blob.kind == "param_copy" and not blob.alias_of}
    losses = {r["iter"]: r["loss"] for r in rows if r["phase"] == "train"}
    return losses, masters, copies, rows, t.train.capture_report()


def _alike(old, new):
    """The fold's run (``new``) is the Casts' run (``old``) bit for bit, and
    its copies are its masters' roundings."""
    assert new[0] == old[0]
    assert sorted(new[1]) == sorted(old[1])
    for p, value in old[1].items():
        assert new[1][p].tobytes() == value.tobytes(), p
    assert not old[2]
    _check_copies(new[2], new[1])


def _schedule(raw):
    """Adam (not W) at a warm-up, a layer norm kept out of the decay, a
    frozen fc (its Casts stay)."""
    raw["solver"].update(type="adam", warmup_iters=3, weight_decay=0.05)
    for layer in raw["net"]:
        if layer["name"] == "b0_ln1":
            layer["param"] = [{"decay_mult": 0}, {"decay_mult": 0}]
        if layer["name"] == "b1_fc":
            layer["param"] = [{"lr_mult": 0}, {"lr_mult": 0}]


def _rate_zero(raw):
    raw["solver"].update(base_lr=0.0)


def _micro_recompute(raw):
    raw.update(parallel={"micro_batches": 2}, recompute="full")


def _graph_and_test(raw):
    """Captured iterations, and a test pass after each step (the test
    graph reads the weights and keeps its own Casts)."""
    from tests.gpt_nets import gpt_config
    raw.update(cuda_graph=True)
    raw["data"]["test"] = gpt_config(raw["data"]["train"]["path"])["data"]["test"]
    raw["solver"].update(test_interval=1, test_iter=1)


FLOWS = {"schedule": _schedule, "rate_zero": _rate_zero, "micro_recompute": _micro_recompute,
         "cuda_graph_test": _graph_and_test}


@pytest.mark.parametrize("flow", sorted(FLOWS))
def test_the_fold_trains_as_the_casts_in_each_flow(host_build_dir, monkeypatch, tmp_path,
                                                    flow):
    from tests.emulated_gpu import emulated_trainer_env
    emulated_trainer_env(monkeypatch, host_build_dir)
    old = _run(monkeypatch, tmp_path, "old", fold=False, edit=FLOWS[flow])
    new = _run(monkeypatch, tmp_path, "new", fold=True, edit=FLOWS[flow])
    _alike(old, new)
    if flow == "schedule":   # the frozen fc's weight has no copy: its Cast stayed
        assert "b1_fc/weight" not in {w for w, _, _ in new[2].values()}
        assert "b0_fc/weight" in {w for w, _, _ in new[2].values()}
    if flow == "cuda_graph_test":
        assert new[4]["captured"] > 0 and not new[4]["failed"], new[4]
        assert [r["iter"] for r in new[3] if r["phase"] == "test"] == [0, 1, 2, 3]
        assert [r["loss"] for r in new[3] if r["phase"] == "test"] == \
            [r["loss"] for r in old[3] if r["phase"] == "test"]


def test_an_fp16_step_skipped_first_in_a_cuda_graph_leaves_the_copies_alike(
        host_build_dir, monkeypatch, tmp_path):
    """fp16, step 1 skipped (an injected inf: the copies made before it are
    kept, not rewritten), captured iterations after it."""
    from tests.emulated_gpu import emulated_trainer_env
    emulated_trainer_env(monkeypatch, host_build_dir)
    monkeypatch.setenv("PURINE_FP16_INJECT_INF", "1")
    def graph(raw):
        raw.update(cuda_graph=True)
    old = _run(monkeypatch, tmp_path, "old", "fp16", fold=False, edit=graph)
    new = _run(monkeypatch, tmp_path, "new", "fp16", fold=True, edit=graph)
    _alike(old, new)
    assert [r["skipped_steps"] for r in new[3] if r["phase"] == "train"] == [1, 1, 1]
    assert new[4]["captured"] > 0


@pytest.mark.parametrize("first,then", [("fp32", "bf16"), ("bf16", "fp32"), ("fp16", "bf16")])
def test_a_resume_across_precisions_makes_the_copies_from_the_loaded_masters(
        host_build_dir, monkeypatch, tmp_path, first, then):
    """A checkpoint of a ``first`` run resumed in ``then`` precision (steps
    3-4): with the fold as with the Casts."""
    from tests.emulated_gpu import emulated_trainer_env
    emulated_trainer_env(monkeypatch, host_build_dir)
    _run(monkeypatch, tmp_path, "first", first, iters=2, interval=2)
    ckpt = str(tmp_path / "first" / "ckpt_2.h5")
    old = _run(monkeypatch, tmp_path, "old", then, iters=4, fold=False, resume=ckpt)
    new = _run(monkeypatch, tmp_path, "new", then, iters=4, fold=True, resume=ckpt)
    assert sorted(new[0]) == [3, 4]
    if then == "fp32":   # no copies: nothing to fold
        assert new[0] == old[0] and not new[2]
    else:
        _alike(old, new)


def test_init_from_a_checkpoint_makes_the_copies_from_its_weights(host_build_dir, monkeypatch,
                                                                   tmp_path):
    from tests.emulated_gpu import emulated_trainer_env
    emulated_trainer_env(monkeypatch, host_build_dir)
    _run(monkeypatch, tmp_path, "first", "fp32", iters=2, interval=2)
    ckpt = str(tmp_path / "first" / "ckpt_2.h5")
    old = _run(monkeypatch, tmp_path, "old", iters=2, fold=False, init=ckpt)
    new = _run(monkeypatch, tmp_path, "new", iters=2, fold=True, init=ckpt)
    fresh = _run(monkeypatch, tmp_path, "fresh", iters=2, fold=True)
    assert new[0] != fresh[0]   # the loaded weights were trained on
    _alike(old, new)


def _h5_contents(path):
    """{dataset: bytes} and {object: attrs} of an HDF5 file, less the root's
    run_id and elapsed (a run's own)."""
    import h5py
    out = {}
    with h5py.File(path) as f:
        def visit(name, obj):
            if isinstance(obj, h5py.Dataset):
                out[name] = (obj.dtype.str, np.asarray(obj[()]).tobytes())
            out[name + "@attrs"] = {k: str(v) for k, v in obj.attrs.items()}
        f.visititems(visit)
        out["/@attrs"] = {k: str(v) for k, v in f.attrs.items()
                          if k not in ("run_id", "elapsed")}
    return out


def test_a_folded_runs_checkpoint_is_the_casts_runs(host_build_dir, monkeypatch, tmp_path):
    """What ``generate``, ``export onnx``, ``inspect``, ``--init`` and
    ``--resume`` read of a folded run: the same datasets, bytes and
    attributes as the Casts' run's checkpoint (no copy in it)."""
    from tests.emulated_gpu import emulated_trainer_env
    emulated_trainer_env(monkeypatch, host_build_dir)
    _run(monkeypatch, tmp_path, "old", iters=2, fold=False, interval=2)
    _run(monkeypatch, tmp_path, "new", iters=2, fold=True, interval=2)
    old = _h5_contents(tmp_path / "old" / "ckpt_2.h5")
    new = _h5_contents(tmp_path / "new" / "ckpt_2.h5")
    assert sorted(new) == sorted(old) and any(k.startswith("params/wte") for k in new)
    assert not [k for k in old if "@bf16" in k or "copy" in k]
    assert [k for k in old if old[k] != new[k]] == []


@pytest.mark.mpi
@pytest.mark.slow
def test_two_emulated_gpus_fold_alike_in_schemes_data_tensor_pipeline(host_build_dir, tmp_path):
    """2 ranks, each on an emulated GPU (tests/mpi_scripts/fold_schemes_gpu.py:
    captured iterations, bf16): schemes data, tensor (2-way) and pipeline
    (2 stages x 2 micro-batches) with the fold and with the Casts -- the
    same losses and checkpoints, bit for bit."""
    from tests.mpi_scripts.launch import run_mpi
    proc, _ = run_mpi("fold_schemes_gpu.py", 2, host_build_dir, tmp_path, "data", "tensor",
                      "pipeline", timeout=300, env={"OPENBLAS_NUM_THREADS": "1"})
    assert proc.stdout.count("OK fold_schemes_gpu") == 2, proc.stdout + proc.stderr
    for scheme in ("data", "tensor", "pipeline"):
        runs = {fold: tmp_path / f"{scheme}-{fold}" for fold in ("1", "0")}
        losses = {fold: [json.loads(r)["loss"] for r in (d / "metrics.jsonl").read_text()
                         .splitlines() if json.loads(r)["phase"] == "train"]
                  for fold, d in runs.items()}
        assert len(losses["1"]) == 3 and losses["1"] == losses["0"], (scheme, losses)
        old, new = (_h5_contents(runs[f] / "ckpt_3.h5") for f in ("0", "1"))
        assert sorted(new) == sorted(old)
        assert [k for k in old if k != "/@attrs" and old[k] != new[k]] == [], scheme


# ------------------------------------------------- opt-in backward kernels
def _fc_width(n):
    def edit(raw):
        for layer in raw["net"]:
            if layer["name"].endswith("_fc"):
                layer["num_output"] = n
    return edit


@pytest.mark.parametrize("var,width,fc,precision", [
    ("PURINE_GELU_BIAS_GRAD", 12, 33, "bf16"),   # fc width odd: the two kernels
    ("PURINE_GELU_BIAS_GRAD", 10, 40, "fp16"),   # the fused pass, under loss scaling
    ("PURINE_LN_SUMS", 10, 40, "bf16"),          # width not a multiple of 4: refused
    ("PURINE_LN_SUMS", 772, 16, "bf16")],        # width above 768: refused
    ids=["gelu-odd", "gelu-fp16", "ln-10", "ln-772"])
def test_the_opt_in_kernels_train_bit_for_bit_as_the_default(host_build_dir, monkeypatch,
                                                              tmp_path, var, width, fc,
                                                              precision):
    """Two steps with the opt-in on and off: the same losses and weights,
    bit for bit (LN_SUMS on a width its kernel takes gives dg and db in
    another order: its last bits, documented; not here)."""
    from tests.emulated_gpu import emulated_trainer_env
    emulated_trainer_env(monkeypatch, host_build_dir)
    runs = {}
    for on in ("1", "0"):
        monkeypatch.setenv(var, on)
        runs[on] = _run(monkeypatch, tmp_path, f"run{on}", precision, iters=2, layers=1,
                        width=width, edit=_fc_width(fc))
    assert runs["1"][0] == runs["0"][0]
    for p, value in runs["0"][1].items():
        assert runs["1"][1][p].tobytes() == value.tobytes(), p


def test_the_opt_in_passes_apply_on_those_shapes(monkeypatch):
    """The shapes above are the passes' (the ops marked), so that the
    fallback is what ran."""
    from purine_mpi.parallel.fuse import fold_gelu_bias_grads, fold_layernorm_sums
    from purine_mpi.parallel.placement import prepare_for_device
    from tests.gpt_oracle import gpt_graph, gpt_net
    net = gpt_net(vocab=16, width=12, heads=2, blocks=1, max_length=6, approximate="tanh")
    g, _, _ = gpt_graph(net, {"type": "adamw", "base_lr": 0.01, "max_iter": 2}, 2, 6)
    prepare_for_device(g, 0, precision="bf16")
    assert fold_gelu_bias_grads(g) and fold_layernorm_sums(g)


def test_bench_of_a_diverging_gpu_run_names_the_blob(host_build_dir, monkeypatch, tmp_path):
    """On a GPU (the loss read back only at displays) bench's refusal names
    the first weight holding NaN or inf (trust71: before, 'the loss or the
    weights hold NaN or inf')."""
    from tests.conftest import make_job
    from tests.emulated_gpu.helpers import emulated_gpu_env
    from tests.gpt_nets import gpt_config, text_h5
    from purine_mpi.job.checkpoint_check import NonFiniteWeights
    from purine_mpi.job.config import validate_config
    from purine_mpi.tools.bench import run_bench
    emulated_gpu_env(monkeypatch, host_build_dir)
    raw = gpt_config(text_h5(tmp_path), layers=1, width=16, heads=2, length=8, batch=4, iters=1)
    raw.update(device=0, precision="bf16")
    raw["solver"].update(type="sgd", base_lr=1e30)
    raw["data"].pop("test")
    with np.errstate(all="ignore"), pytest.raises(NonFiniteWeights) as e:
        run_bench(make_job(validate_config(raw, check_files=False)), iters=2, warmup=1)
    assert str(e.value).startswith("bench: gpt_test diverged: 'wte/weight' holds NaN or inf "
                                   "after the 3 iterations"), str(e.value)

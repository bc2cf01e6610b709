"""The solvers besides SGD (Nesterov, AdaGrad, RMSProp, AdaDelta, Adam,
AdamW): each update op against torch.optim step by step, the config keys,
a training graph on the simulated GPU, and a bit-exact resume with Adam."""
import numpy as np
import pytest
import torch

from purine_mpi.base.errors import ConfigError
from purine_mpi.graph import Graph
from purine_mpi.graph.solver_graph import solver_states
from purine_mpi.job.checkpoint_file import load_checkpoint
from purine_mpi.job.config import validate_config
from purine_mpi.job.replica import build_train_graph
from purine_mpi.ops.updates import SOLVER_UPDATES
from purine_mpi.runtime.dispatcher import SerialDispatcher
from tests.conftest import make_job, write_config_file
from tests.test_train import h5_arrays, resume_config, train_cli

#: solver.type -> (our solver keys, the torch.optim constructor for them)
CASES = {
    "nesterov": ({"momentum": 0.9, "weight_decay": 0.01},
                 lambda p, lr: torch.optim.SGD(p, lr=lr, momentum=0.9, weight_decay=0.01,
                                               nesterov=True)),
    "adagrad": ({"delta": 1e-10, "weight_decay": 0.01},
                lambda p, lr: torch.optim.Adagrad(p, lr=lr, eps=1e-10, weight_decay=0.01)),
    "rmsprop": ({"rms_decay": 0.95, "delta": 1e-8, "weight_decay": 0.01},
                lambda p, lr: torch.optim.RMSprop(p, lr=lr, alpha=0.95, eps=1e-8,
                                                  weight_decay=0.01)),
    "adadelta": ({"momentum": 0.9, "delta": 1e-6, "weight_decay": 0.01},
                 lambda p, lr: torch.optim.Adadelta(p, lr=lr, rho=0.9, eps=1e-6,
                                                    weight_decay=0.01)),
    "adam": ({"momentum": 0.8, "momentum2": 0.99, "delta": 1e-2, "weight_decay": 0.05},
             lambda p, lr: torch.optim.Adam(p, lr=lr, betas=(0.8, 0.99), eps=1e-2,
                                            weight_decay=0.05)),
    "adamw": ({"momentum": 0.8, "momentum2": 0.99, "delta": 1e-2, "weight_decay": 0.05},
              lambda p, lr: torch.optim.AdamW(p, lr=lr, betas=(0.8, 0.99), eps=1e-2,
                                              weight_decay=0.05)),
}
#: our state blob -> (torch.optim state key, factor: ours = factor * torch's)
TORCH_STATE = {"nesterov": {"momentum": ("momentum_buffer", "lr")},
               "adagrad": {"history": ("sum", 1)},
               "rmsprop": {"history": ("square_avg", 1)},
               "adadelta": {"history": ("square_avg", 1), "update_history": ("acc_delta", 1)},
               "adam": {"m": ("exp_avg", 1), "v": ("exp_avg_sq", 1)},
               "adamw": {"m": ("exp_avg", 1), "v": ("exp_avg_sq", 1)}}


def update_graph(kind, shape, attrs):
    op_type, states = SOLVER_UPDATES[kind]
    g = Graph(kind)
    g.add_blob("w", shape, kind="param")
    g.add_blob("grad", shape, kind="grad")
    g.add_blob("w@new", shape, alias_of="w")
    for s in states:
        g.add_blob(s, shape, kind="state")
        g.add_blob(f"{s}@new", shape, alias_of=s)
    g.add_blob("lr", (), kind="lr")
    g.add_blob("iter", (), "int64", kind="iter")
    extra = ["lr", "iter"] if kind in ("adam", "adamw") else ["lr"]
    g.add_op("w.update", op_type, ["w", "grad", *states, *extra],
             ["w@new"] + [f"{s}@new" for s in states], attrs)
    g.infer_shapes().validate()
    return SerialDispatcher(g)


@pytest.mark.parametrize("kind", sorted(CASES))
def test_update_matches_torch_optim_step_by_step(kind):
    attrs, make = CASES[kind]
    rng = np.random.default_rng(3)
    shape, lr = (4, 5), 0.01 if kind.startswith("adam") or kind == "rmsprop" else 0.1
    if kind == "adadelta":
        lr = 1.0
    w0 = rng.standard_normal(shape).astype(np.float32)
    d = update_graph(kind, shape, dict(attrs))
    d.workspace.set("w", w0)
    d.workspace.set("lr", np.float32(lr))
    wt = torch.tensor(w0, requires_grad=True)
    opt = make([wt], lr)
    for it in range(6):
        g = rng.standard_normal(shape).astype(np.float32)
        d.workspace.set("grad", g)
        d.workspace.set("iter", np.int64(it))
        d.run()
        wt.grad = torch.tensor(g)
        opt.step()
        # the distance travelled, so that a small error in the step shows
        np.testing.assert_allclose(d.workspace["w"] - w0, wt.detach().numpy() - w0,
                                   rtol=1e-4, atol=1e-7, err_msg=f"{kind}, step {it}")
        for ours, (theirs, factor) in TORCH_STATE[kind].items():
            expect = opt.state[wt][theirs].numpy() * (lr if factor == "lr" else factor)
            np.testing.assert_allclose(d.workspace[ours], expect, rtol=1e-4, atol=1e-9,
                                       err_msg=f"{kind} {ours}, step {it}")
    assert not np.allclose(d.workspace["w"], w0)


def test_adam_and_adamw_differ_only_in_decay():
    """Without weight decay they are the same; with it, AdamW shrinks w by
    exactly (1 - lr * wd) before the Adam step."""
    shape = (3, 3)
    w0 = np.full(shape, 2.0, np.float32)
    g = np.ones(shape, np.float32)
    out = {}
    for kind in ("adam", "adamw"):
        for wd in (0.0, 0.1):
            d = update_graph(kind, shape, {"momentum": 0.9, "momentum2": 0.999, "delta": 1e-8,
                                           "weight_decay": wd})
            for name, value in (("w", w0), ("grad", g), ("lr", np.float32(0.1)),
                                ("iter", np.int64(0))):
                d.workspace.set(name, value)
            d.run()
            out[kind, wd] = d.workspace["w"].copy()
    np.testing.assert_array_equal(out["adam", 0.0], out["adamw", 0.0])
    # first Adam step moves by lr * m_hat / (sqrt(v_hat) + eps) = lr * sign(g)
    np.testing.assert_allclose(out["adamw", 0.1], 2.0 * (1 - 0.1 * 0.1) - 0.1, rtol=1e-6)
    np.testing.assert_allclose(out["adam", 0.0], 2.0 - 0.1, rtol=1e-6)


def test_multipliers_and_grad_scale_apply_to_every_solver():
    """lr_mult scales the rate, decay_mult the decay, grad_scale the
    gradient: AdaGrad's first step in closed form."""
    shape = (4,)
    w, g = np.array([1.0, -2.0, 3.0, 0.5], np.float32), np.array([0.5, 1, -1, 2], np.float32)
    d = update_graph("adagrad", shape, {"delta": 1e-8, "weight_decay": 0.1, "lr_mult": 2.0,
                                        "decay_mult": 0.5, "grad_scale": 0.25})
    for name, value in (("w", w), ("grad", g), ("lr", np.float32(0.1))):
        d.workspace.set(name, value)
    d.run()
    gg = 0.25 * g + 0.1 * 0.5 * w
    np.testing.assert_allclose(d.workspace["history"], gg * gg, rtol=1e-6)
    np.testing.assert_allclose(d.workspace["w"], w - 0.2 * gg / (np.abs(gg) + 1e-8), rtol=1e-5)


def _config(kind, **solver):
    return {"name": "s", "seed": 1,
            "data": {"train": {"source": "synthetic", "shape": [1, 4, 4], "classes": 3,
                               "num_samples": 16, "batch_size": 4}},
            "net": [{"type": "fc", "name": "fc", "bottom": "data", "top": "fc",
                     "num_output": 3},
                    {"type": "softmax_loss", "name": "loss", "bottom": ["fc", "label"],
                     "top": "loss"}],
            "solver": {"type": kind, "base_lr": 0.01, **solver}}


@pytest.mark.parametrize("kind", sorted(SOLVER_UPDATES))
def test_training_graph_has_the_solvers_state(kind):
    graph, grads = build_train_graph(make_job(validate_config(_config(kind), check_files=False)))
    op_type, states = SOLVER_UPDATES[kind]
    updates = [op for op in graph.ops.values() if op.op_type == op_type]
    assert sorted(op.inputs[0] for op in updates) == sorted(grads)
    for op in updates:
        for s in solver_states(kind):
            assert f"{op.inputs[0]}.{s}" in op.inputs
            assert graph.blobs[f"{op.inputs[0]}.{s}"].kind == "state"


def test_solver_config_errors():
    with pytest.raises(ConfigError, match="solver.type.*adamw"):
        validate_config(_config("adamx"), check_files=False)
    with pytest.raises(ConfigError, match="solver.momentum2"):
        validate_config(_config("adam", momentum2=1.5), check_files=False)
    with pytest.raises(ConfigError, match="solver.delta"):
        validate_config(_config("adam", delta=0), check_files=False)
    with pytest.raises(ConfigError, match="solver.momentum.*takes no momentum"):
        validate_config(_config("adagrad", momentum=0.9), check_files=False)
    cfg = _config("adam")
    cfg["parallel"] = {"mode": "async"}
    with pytest.raises(ConfigError, match="supports solver type 'sgd' only"):
        validate_config(cfg, check_files=False)


def test_adam_resume_is_bit_exact(digits_h5, tmp_path):
    cfg = resume_config(digits_h5)
    cfg["solver"].update({"type": "adam", "base_lr": 0.001, "momentum": 0.9,
                          "momentum2": 0.999, "max_iter": 60, "stepsize": 30,
                          "weight_decay": 1e-4})
    cfg["checkpoint"] = {"interval": 30, "keep": 5}
    path = write_config_file(tmp_path, cfg)
    train_cli(path, "--out", tmp_path / "straight")
    train_cli(path, "--out", tmp_path / "split", "--iters", 30)
    train_cli(path, "--out", tmp_path / "split", "--resume", "auto")
    a = h5_arrays(tmp_path / "straight" / "latest.h5")
    b = h5_arrays(tmp_path / "split" / "latest.h5")
    assert a.keys() == b.keys()
    assert any(k.endswith("/m") for k in a) and any(k.endswith("/v") for k in a)
    for k in a:
        assert np.array_equal(a[k], b[k]), k
    assert load_checkpoint(tmp_path / "split" / "latest.h5").iteration == 60

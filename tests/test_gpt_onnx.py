"""export onnx of a GPT (issue 37): token input, LayerNormalization, Gelu,
attention as ONNX's Attention op (opset 23; the raw path's scores and
context as MatMul, Softmax and a Trilu causal mask), the tied head; under
onnxruntime the model gives our test forward's logits and `test`'s loss."""
import json

import numpy as np
import pytest

from purine_mpi.job.config import load_config
from tests.conftest import run_cli_args, write_config_file
from tests.gpt_nets import gpt_config, text_h5
from tests.test_onnx_export import our_forward

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 2-block GPT trained 4 iterations (weights off their init)."""
    d = tmp_path_factory.mktemp("gpt_onnx")
    cfg = gpt_config(text_h5(d))
    path = write_config_file(d, cfg)
    res = run_cli_args("train", path, "--out", d / "run")
    assert res.returncode == 0, res.stdout + res.stderr
    return d, cfg, d / "run" / "latest.h5"


def _export(d, cfg, weights, name, *extra):
    path = write_config_file(d, cfg, f"{name}.yaml")
    out = d / f"{name}.onnx"
    res = run_cli_args("export", "onnx", path, "--weights", weights, "--out", out, *extra)
    assert res.returncode == 0, res.stdout + res.stderr
    model = onnx.load(str(out))
    onnx.checker.check_model(model)
    return path, out, model, res.stdout


def _cross_entropy(logits, labels):
    z = logits - logits.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return -np.take_along_axis(logp, labels[..., None].astype(np.int64), -1).mean()


@pytest.mark.parametrize("fused", [True, False])
def test_gpt_under_onnxruntime_equals_our_forward_and_test(trained, fused):
    d, cfg, weights = trained
    cfg = dict(cfg, net=gpt_config("x", fused=fused)["net"])
    path, out, model, line = _export(d, cfg, weights, f"gpt_{fused}")
    assert "input data: int32 token ids (batch x sequence)" in line
    assert model.opset_import[0].version == 23
    types = {n.op_type for n in model.graph.node}
    assert {"Gather", "LayerNormalization", "Gelu", "MatMul"} <= types
    assert ("Attention" in types) == fused and ("Trilu" in types) == (not fused)
    assert model.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.INT32
    dims = [x.dim_param or x.dim_value for x in model.graph.input[0].type.tensor_type.shape.dim]
    assert dims == ["batch", "sequence"]
    assert [o.name for o in model.graph.output] == ["logits"]
    ours = our_forward(load_config(path), str(weights))
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    (logits,) = session.run(["logits"], {"data": ours["data"]})
    np.testing.assert_allclose(logits, ours["logits"], rtol=1e-4, atol=1e-5)
    # a shorter sequence runs too (the position table's first T rows)
    (short,) = session.run(["logits"], {"data": ours["data"][:, :5]})
    np.testing.assert_allclose(short, ours["logits"][:, :5], rtol=1e-4, atol=1e-5)
    # `test` on the same batches gives the loss of the exported logits
    res = run_cli_args("test", path, "--weights", weights, "--set", "solver.test_iter=1")
    assert res.returncode == 0, res.stdout + res.stderr
    final = json.loads(res.stdout.strip().splitlines()[-1])
    assert final["samples"] == 4
    assert final["loss"] == pytest.approx(_cross_entropy(logits, ours["label"]), rel=1e-5)

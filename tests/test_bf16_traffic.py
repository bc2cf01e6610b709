"""benchmarks/bf16_traffic.py: the offline memory-traffic and FLOP count of a
GPT iteration (docs/gpu.md, "Precision", *An offline bound*), on the
2-block ``jobs/gpt_tiny.yaml`` at 2 x 16 tokens: the bytes of a few ops
against a hand count, bf16 storage moving fewer bytes than float32
storage, and the graph's FLOPs against PaLM's closed form."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tests.emulated_gpu.helpers import emulated_gpu_env
from tests.gpt_nets import text_h5

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "benchmarks", "bf16_traffic.py")
B, T, C, V = 2, 16, 128, 256     # gpt_tiny: 128 wide, byte vocabulary
JOB = os.path.join(REPO, "jobs", "gpt_tiny.yaml")


def _module():
    spec = importlib.util.spec_from_file_location("bf16_traffic", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return text_h5(tmp_path_factory.mktemp("traffic"))


def _sets(data):
    return [f"data.train.path={data}", f"data.test.path={data}", f"data.train.batch_size={B}",
            f"data.train.sequence_length={T}", f"data.test.sequence_length={T}"]


@pytest.fixture
def graphs(data, monkeypatch, host_build_dir):
    emulated_gpu_env(monkeypatch, host_build_dir)
    bt = _module()
    return bt, {name: bt.job_graph(JOB, _sets(data), precision, storage)
                for name, precision, storage in bt.CONFIGS}


def test_bytes_of_ops_match_a_hand_count(graphs):
    bt, g = graphs
    n, f32, bits = B * T, 4, 2
    on, off = g["bf16_bits_storage"], g["bf16_float32_storage"]
    # layer norm: x (float32), weight and bias, y (bits with storage), mean, rstd
    assert bt.op_bytes(on, on.ops["h0_ln1.fwd"]) == (
        n * C * f32 + 2 * C * f32 + n * C * bits + 2 * n * f32, 0)
    assert bt.op_bytes(off, off.ops["h0_ln1.fwd"]) == (
        n * C * f32 + 2 * C * f32 + n * C * f32 + 2 * n * f32, 0)
    # the MLP's fc: x, w (C -> 4C), a float32 bias, y; with storage the
    # operands are bits and y is written as bits from GemmEx's float32
    # result in scratch (+ 4 + 4 bytes an element: bias_bits)
    assert bt.op_bytes(on, on.ops["h0_fc.fwd"]) == (
        n * C * bits + 4 * C * C * bits + 4 * C * f32 + n * 4 * C * bits, 8 * n * 4 * C)
    # under PURINE_FC_EPILOGUE=cublaslt: one cuBLASLt product writes y's bits,
    # its bias's bf16 bits written and read (+ 2 + 2 a bias element)
    assert bt.op_bytes(on, on.ops["h0_fc.fwd"], "cublaslt") == (
        n * C * bits + 4 * C * C * bits + 4 * C * f32 + n * 4 * C * bits, 4 * 4 * C)
    assert bt.op_bytes(off, off.ops["h0_fc.fwd"], "cublaslt") == \
        bt.op_bytes(off, off.ops["h0_fc.fwd"])   # float32 storage: no bits y
    # without: float32 operands narrowed to bits (+ 2 + 2), y rounded in place (+ 4 + 4)
    assert bt.op_bytes(off, off.ops["h0_fc.fwd"]) == (
        n * C * f32 + 4 * C * C * f32 + 4 * C * f32 + n * 4 * C * f32,
        4 * (n * C + 4 * C * C) + 8 * n * 4 * C)
    # the fused attention: qkv in, ctx and the (B, H, T, 1) statistics out;
    # float32 storage narrows qkv and widens ctx for cuDNN (+ 2 + 2 each)
    heads = 4
    assert bt.op_bytes(on, on.ops["h0_attn.attn"]) == (
        n * 3 * C * bits + n * C * bits + B * heads * T * f32, 0)
    assert bt.op_bytes(off, off.ops["h0_attn.attn"]) == (
        n * 3 * C * f32 + n * C * f32 + B * heads * T * f32, 4 * (n * 3 * C + n * C))
    # AdamW over the flat weights: w, m, v and the gradients read, w, m, v
    # written, 4 bytes each, and the lr and the iteration (4 + 8); and the
    # copies of the weights the products read, which it writes in the same
    # pass (parallel/precision.fold_weight_casts): every parameter but the
    # layer norms' and the position embedding, 2 bytes an element as bits
    # (the weights), 4 as float32 (the biases, read by the fc's epilogue)
    p = sum(b.size for b in on.params())
    copied = {b.name: b.size for b in on.params() if "ln" not in b.name
              and not b.name.startswith("wpe")}
    weights = sum(n for name, n in copied.items() if name.endswith("weight"))
    assert sorted(on.blobs[on.blobs[c].alias_of].attrs["copy_of"] for c in
                  on.ops["solver.update"].outputs[3:]) == sorted(copied)
    assert bt.op_bytes(on, on.ops["solver.update"]) == (
        7 * p * f32 + 4 + 8 + weights * bits + (sum(copied.values()) - weights) * f32, 0)
    # fp32: no casts, no conversions
    fp32 = g["fp32"]
    assert all(bt.op_bytes(fp32, op)[1] == 0 and bt.op_class(op) != "casts"
               for op in fp32.ops.values())


def test_storage_moves_fewer_bytes_and_flops_are_the_closed_form(graphs):
    bt, g = graphs
    bw = {"datasheet": bt.HBM_DATASHEET}
    peak = bt.peaks()["bf16"]
    s = {name: bt.summary(graph, peak, bw) for name, graph in g.items()}
    on, off, fp32 = s["bf16_bits_storage"], s["bf16_float32_storage"], s["fp32"]
    assert on["bytes"] < off["bytes"]
    assert on["non_product_bytes"] < off["non_product_bytes"]
    assert on["classes"]["casts"]["bytes"] < off["classes"]["casts"]["bytes"]
    assert fp32["classes"]["casts"]["bytes"] == 0
    assert on["bounds"]["serial_ms"]["datasheet"] < off["bounds"]["serial_ms"]["datasheet"]
    # the class and type rows add up to the total
    for fig in s.values():
        assert sum(c["bytes"] for c in fig["classes"].values()) == fig["bytes"]
        assert sum(t["bytes"] for t in fig["op_types"].values()) == fig["bytes"]
    # the same products in every precision; PaLM's 6N counts 6 FLOPs a token
    # for each bias and layer-norm parameter too, which no product reads
    flops = {fig["flops"]["graph"] for fig in s.values()}
    assert len(flops) == 1
    closed = on["flops"]["closed_form"]
    assert closed["tokens"] == B * T and closed["layers"] == 2 and closed["seq"] == T
    vectors = sum(b.size for b in g["fp32"].params() if len(b.shape) == 1)
    assert closed["flops"] - on["flops"]["graph"] == 6 * vectors * B * T
    assert on["flops"]["compute_ms"] == pytest.approx(on["flops"]["graph"] / peak * 1e3,
                                                      abs=1e-3)


def test_script_prints_three_configurations(data):
    env = dict(os.environ, PYTHONPATH=REPO)
    res = subprocess.run([sys.executable, SCRIPT, "--job", JOB] +
                         [a for s in _sets(data) for a in ("--set", s)],
                         capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout)
    assert list(out["configs"]) == ["fp32", "bf16_float32_storage", "bf16_bits_storage"]
    assert set(out["hbm_bytes_per_s"]) == {"datasheet", "measured"}
    for fig in out["configs"].values():
        b = fig["bounds"]
        for k in ("datasheet", "measured"):
            assert b["overlapped_ms"][k] <= b["serial_ms"][k] + 1e-3
            assert b["serial_ms"][k] >= fig["flops"]["compute_ms"] - 1e-3

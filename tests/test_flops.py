"""Model FLOPs and MFU of ``bench --json`` (tools/flops.py, issue 45 item 4):
the count read off a small GPT's training graph against the closed forms,
a CNN's conv/fc count, the CPU peak's words, and bench's fields consistent
(achieved = FLOPs per sample x samples/s, mfu = achieved / peak)."""
import json
import math

import numpy as np
import pytest

from purine_mpi.tools.flops import (cpu_peak, device_peak, gpt_closed_form, gpt_figures,
                                    graph_flops)
from tests.conftest import (MPIEXEC, PYTHON, REPO, cli_env, make_job, run_cli_args, run_cli_here,
                            write_config_file)
from tests.gpt_oracle import gpt_net

V, C, H, L, T, B = 96, 48, 4, 3, 24, 2


@pytest.fixture(scope="module")
def text_h5(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "json.h5"
    res = run_cli_here("data", "text", "--from", json.__file__, "--out", path)
    assert res.returncode == 0, res.stderr
    return str(path)


def _gpt(text_h5, fused=True, micro=1):
    net = gpt_net(vocab=V, width=C, heads=H, blocks=L, max_length=T, approximate="tanh")
    if not fused:
        for layer in net:
            if layer["type"] == "attention":
                layer["fused"] = False
    return make_job({"name": "g", "net": net, "parallel": {"micro_batches": micro},
                     "data": {"train": {"source": "text", "path": text_h5, "batch_size": B,
                                        "sequence_length": T}}})


@pytest.mark.parametrize("fused", [True, False])
def test_gpt_count_is_the_closed_form(text_h5, fused):
    from purine_mpi.job.replica import build_train_graph
    graph, _ = build_train_graph(_gpt(text_h5, fused))
    per_token = graph_flops(graph) / (B * T)
    # the matrix products: 6 x (qkv, proj, fc, proj weights of L blocks + the tied lm_head)
    # per token, and 12·L·C·T for q·kᵀ and P·v forward and backward
    matmul_weights = L * (3 * C * C + C * C + 4 * C * C + 4 * C * C) + V * C
    assert per_token == 6 * matmul_weights + 12 * L * C * T
    n, layers, width, seq = gpt_figures(graph)
    assert (layers, width, seq) == (L, C, T)
    params = sum(int(np.prod(b.shape)) for b in graph.params())
    assert n == params - T * C  # without wpe, as nanoGPT's get_num_params
    closed = gpt_closed_form(n, layers, width, seq)
    # the closed form also counts 6 per bias and norm parameter (what is not a matmul)
    assert closed - per_token == 6 * (n - matmul_weights)


def test_micro_batches_do_not_change_the_count_per_sample(text_h5):
    from purine_mpi.job.replica import build_train_graph
    one, _ = build_train_graph(_gpt(text_h5))
    two, _ = build_train_graph(_gpt(text_h5, micro=2))
    assert graph_flops(one) == 2 * graph_flops(two)


def test_cnn_counts_conv_and_fc(digits_h5):
    from purine_mpi.job.replica import build_train_graph
    net = [{"type": "conv", "name": "c1", "bottom": "data", "top": "c1", "num_output": 6,
            "kernel": 3},
           {"type": "fc", "name": "f1", "bottom": "c1", "top": "f1", "num_output": 10},
           {"type": "softmax_loss", "name": "loss", "bottom": ["f1", "label"]}]
    job = make_job({"name": "c", "net": net, "data": {"train": {
        "source": "hdf5", "path": digits_h5, "split": "train", "batch_size": 4}}})
    graph, _ = build_train_graph(job)
    x = graph.blobs["data"].shape  # (4, 1, 8, 8) digits
    oh, ow = x[2] - 2, x[3] - 2
    conv = 2 * 4 * 6 * oh * ow * x[1] * 9
    fc = 2 * 4 * 10 * 6 * oh * ow
    # the first conv computes no data gradient (data needs none): forward + weight gradient
    assert graph_flops(graph) == 2 * conv + 3 * fc


def test_cpu_peak_names_its_figures(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Test CPU\nflags\t\t: fpu sse avx avx2 fma "
                    "avx512f\ncpu MHz\t\t: 2000.000\ncore id\t\t: 0\nphysical id\t: 0\n")
    peak, words = cpu_peak(str(info), cores=3)
    import os
    if not os.path.exists("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq"):
        assert peak == 3 * 16 * 2 * 2 * 2.0e9
        assert "cpu MHz" in words
    assert "AVX-512" in words and "Test CPU" in words and "3 core(s)" in words
    info.write_text("processor\t: 0\nmodel name\t: X\nflags\t\t: fpu sse\n")
    peak, words = cpu_peak(str(info), cores=1)
    if not os.path.exists("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq"):
        assert peak is None and "clock: unknown" in words
    assert device_peak("NVIDIA H100 80GB HBM3", "bf16")[0] == 989e12
    assert device_peak("NVIDIA H200", "tf32")[0] == 495e12
    assert device_peak("NVIDIA H100 80GB HBM3", "fp32")[0] == 67e12
    assert device_peak("Tesla V100", "fp32")[0] is None
    # a PCIe or NVL card of those names has lower peaks than the SXM ones (an
    # H100 PCIe 756 TFLOP/s dense bf16): none is claimed, rather than the
    # SXM's 989 (before: 989e12, an MFU about a third too low)
    for name in ("NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA H200 NVL"):
        peak, words = device_peak(name, "bf16")
        assert peak is None and "mfu is null" in words, (name, peak)


def test_bench_json_fields_are_consistent(text_h5, tmp_path):
    net = gpt_net(vocab=256, width=C, heads=H, blocks=L, max_length=T, approximate="tanh")
    path = write_config_file(tmp_path, {"name": "g", "net": net, "data": {"train": {
        "source": "text", "path": text_h5, "batch_size": B, "sequence_length": T}}})
    res = run_cli_args("bench", path, "--iters", "2", "--warmup", "1", "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["tokens_per_s"] > 0 and out["precision"] == "fp32"
    assert math.isclose(out["tokens_per_s_elapsed"], out["images_per_s_elapsed"] * T,
                        rel_tol=1e-3)
    assert math.isclose(out["achieved_flops_per_s"],
                        out["model_flops_per_iter_sample"] * out["images_per_s"], rel_tol=1e-6)
    assert math.isclose(out["model_flops_per_token"] * T, out["model_flops_per_iter_sample"],
                        rel_tol=1e-6)
    assert out["model_flops_per_token_closed_form"] > out["model_flops_per_token"]
    assert "peak_source" in out and "mfu" in out
    if out["peak_flops_per_s"] is not None:
        assert math.isclose(out["mfu"], out["achieved_flops_per_s"] / out["peak_flops_per_s"],
                            rel_tol=1e-3)
    else:
        assert out["mfu"] is None and "unknown" in out["peak_source"]


def test_mfu_peak_is_the_hardware_the_ranks_occupy(text_h5, tmp_path):
    """MFU divides by the peak of the hardware the job occupies: two ranks
    bound to a core each (``mpiexec -bind-to core``) occupy two cores, not
    rank 0's one (before: its affinity's, half the peak, MFU doubled)."""
    import os
    import subprocess
    if MPIEXEC is None or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs mpiexec and two CPUs")
    net = gpt_net(vocab=256, width=C, heads=H, blocks=L, max_length=T, approximate="tanh")
    path = write_config_file(tmp_path, {"name": "g", "net": net, "data": {"train": {
        "source": "text", "path": text_h5, "batch_size": B, "sequence_length": T}}})
    res = subprocess.run([MPIEXEC, "-n", "2", "-bind-to", "core", PYTHON, "-m", "purine_mpi",
                          "bench", path, "--iters", "2", "--warmup", "1", "--json"],
                         cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    two_cores, _ = cpu_peak(cores=2)    # this host's ISA and clock, two physical cores
    if two_cores is None:
        pytest.skip("no clock known: the peak is null")
    assert out["peak_flops_per_s"] == two_cores, (
        f"peak {out['peak_flops_per_s']} for two ranks bound to a core each, "
        f"two cores' is {two_cores}: {out['peak_source']}")
    assert math.isclose(out["mfu"], out["achieved_flops_per_s"] / two_cores, rel_tol=1e-3)
    assert "2 core(s)" in out["peak_source"] and "2 rank(s)" in out["peak_source"]


def test_occupied_counts_gpus_once_and_not_the_servers_cores():
    from purine_mpi.tools.flops import occupied
    a = [("0", "0"), ("0", "1")]
    # two workers on GPUs 0 and 1 of host a, a parameter server on a's CPU: two GPUs
    assert occupied([("a", 0, a), ("a", 1, a), ("a", -1, a)]) == ("gpu", 2)
    # two ranks sharing GPU 0, one on host b's GPU 0: two GPUs
    assert occupied([("a", 0, a), ("a", 0, a), ("b", 0, a)]) == ("gpu", 2)
    # the CPU: unbound ranks share the host's cores; two hosts add theirs
    assert occupied([("a", -1, a), ("a", -1, a)]) == ("cpu", 2)
    assert occupied([("a", -1, a[:1]), ("a", -1, a[1:]), ("b", -1, a)]) == ("cpu", 4)

"""benchmarks/gpt_gpu.py (issue 45's bf16 GPT speed harness) and
gpu_throughput.py's ``--precision bf16`` without a GPU: the CPU dry runs
build and step every side at a tiny size and print the real JSON keys with
null figures; the GPU run refuses to report CPU numbers."""
import importlib.util
import json
import os
import re
import subprocess
import sys
import types

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPT_GPU = os.path.join(REPO, "benchmarks", "gpt_gpu.py")
THROUGHPUT = os.path.join(REPO, "benchmarks", "gpu_throughput.py")


def _run(*args):
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True,
                          env=env, timeout=600)


@pytest.fixture(scope="module")
def gpt_dry_run():
    """One ``--dry-run`` of jobs/gpt_tiny.yaml, every side named (torch_compile
    among them: a GPU run's only, so left out), shared by the tests that read
    its JSON: a launch is ~5 s of torch's import and set-up."""
    pytest.importorskip("torch")
    res = _run(GPT_GPU, "--dry-run", "--config", "jobs/gpt_tiny.yaml", "--sides", "purine",
               "purine_fc_cublaslt", "torch_eager", "torch_compile")
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_gpt_gpu_times_ours_with_the_cublaslt_epilogue_beside_the_default(gpt_dry_run):
    """``--sides purine purine_fc_cublaslt`` (the session's gpt stage): our
    job twice in one run, the second with PURINE_FC_EPILOGUE=cublaslt set
    around its set-up and steps, their tokens/s ratio reported; only the
    default side profiled."""
    out = gpt_dry_run
    sides = out["sides"]
    assert list(sides)[:2] == ["purine", "purine_fc_cublaslt"]
    assert sides["purine"]["environment"] == {}
    assert sides["purine_fc_cublaslt"]["environment"] == {"PURINE_FC_EPILOGUE": "cublaslt"}
    assert sides["purine_fc_cublaslt"]["tokens_per_s"] > 0
    assert out["purine_fc_cublaslt_vs_purine"] == pytest.approx(
        sides["purine_fc_cublaslt"]["tokens_per_s"] / sides["purine"]["tokens_per_s"], rel=2e-3)
    assert sides["purine"]["op_breakdown"] is not None
    assert "timed only" in sides["purine_fc_cublaslt"]["kernels_note"]


def test_gpt_gpu_dry_run_steps_ours_and_pytorch_side_by_side(gpt_dry_run):
    out = gpt_dry_run
    assert out["benchmark"] == "gpt_gpu" and out["dry_run"] is True
    assert out["peak_flops_per_s"] is None and out["cut_short"] is None
    # the sides run unless --sides names others: torch.compile a GPU run's only
    # (the shared run names it: --dry-run leaves it out)
    spec = importlib.util.spec_from_file_location("gpt_gpu_sides", GPT_GPU)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.DEFAULT_SIDES == ("purine", "torch_eager", "torch_compile")
    assert list(out["sides"]) == ["purine", "purine_fc_cublaslt", "torch_eager"]
    sides = {s: out["sides"][s] for s in ("purine", "torch_eager")}
    # the job as written: no recompute unless --recompute-layers asks (docs/gpu.md)
    assert out["recompute_layers"] is None
    # one FLOPs figure for every side: PaLM's closed form of the job
    assert out["model_flops_per_token"] > 0 and "6N + 12*L*H*Q*T" in out["closed_form"]
    for side in sides.values():
        assert side["tokens_per_s"] > 0 and side["mfu"] is None
        assert side["model_flops_per_token"] == out["model_flops_per_token"]
        assert side["peak_memory_bytes"] is None   # no device: no device memory
        assert side["attention_note"]
    # the attention's SDPA kernels and its other GPU work: CUPTI's, a GPU's only;
    # ours also the Attention ops' spans from our trace (the secondary figure)
    for side in sides.values():
        assert side["attention_ms_per_iter"] is None and side["attention_kernels"] is None
        assert "not measured" in side["attention_note"]
        assert side["attention_other_ms_per_iter"] is None
        assert "not measured" in side["attention_other_note"]
    assert sides["purine"]["attention_span_ms_per_iter"] > 0
    assert "not the kernels alone" in sides["purine"]["attention_span_note"]
    assert sides["torch_eager"]["attention_span_ms_per_iter"] is None
    assert "ours only" in sides["torch_eager"]["attention_span_note"]
    assert out["purine_attention_vs_torch_eager"] is None
    assert out["purine_vs_torch_eager"] > 0
    # where our step's time goes: the op table from our trace (host times here)
    ours = sides["purine"]
    bd = ours["op_breakdown"]
    assert "eager dispatch" in ours["op_breakdown_note"]
    assert bd["steps"] == 1 and bd["step_ms"] > 0 and bd["ops_per_iter"] > 0
    assert 0 < bd["busy_ms_per_iter"] <= bd["step_ms"]
    assert bd["idle_ms_per_iter"] == pytest.approx(bd["step_ms"] - bd["busy_ms_per_iter"],
                                                   abs=1e-3)
    for table, key in ((bd["by_type"], "op_type"), (bd["by_op"], "name")):
        assert 2 <= len(table) <= 16 and table[-1][key] == "other"
        top = table[:-1]
        assert [r["ms_per_iter"] for r in top] == sorted((r["ms_per_iter"] for r in top),
                                                         reverse=True)
        for r in table:
            assert {key, "ms_per_iter", "span_ms_per_iter", "count_per_iter", "share",
                    "on"} <= set(r)
            assert r["count_per_iter"] > 0 and r["on"] == ["host"]
            assert 0 <= r["ms_per_iter"] <= r["span_ms_per_iter"] + 1e-4
            assert r["share"] == pytest.approx(r["ms_per_iter"] / bd["step_ms"], abs=1e-3)
        # the rows add up to the time some op ran, never more than the step
        total = sum(r["ms_per_iter"] for r in table)
        assert total == pytest.approx(bd["busy_ms_per_iter"], abs=2e-3)
        assert total <= bd["step_ms"] + 2e-3
        assert sum(r["count_per_iter"] for r in table) == pytest.approx(bd["ops_per_iter"])
    by_type = {r["op_type"]: r for r in bd["by_type"]}
    attention = sum(by_type[t]["span_ms_per_iter"] for t in ("Attention", "AttentionGrad")
                    if t in by_type)
    assert attention == pytest.approx(ours["attention_span_ms_per_iter"], abs=2e-3)
    # CUPTI's kernels: a GPU's only, each side saying why not
    for side in sides.values():
        assert side["kernels"] is None and "not measured" in side["kernels_note"]
    assert "CUDA device" in ours["kernels_note"]


def test_gpt_gpu_op_breakdown_splits_overlapping_spans():
    """Two ops at once share the time they overlap; the rows add up to the
    union of the spans inside the steps' window, the rest is idle."""
    spec = importlib.util.spec_from_file_location("gpt_gpu_table", GPT_GPU)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)

    def op(name, op_type, ts, dur, tid="gpu0"):
        return {"name": name, "ph": "X", "ts": ts, "dur": dur, "tid": tid,
                "args": {"op_type": op_type}}
    events = [op("a1", "A", 0, 10_000), op("b1", "B", 5_000, 7_000, "gpu0:1"),
              op("a2", "A", 20_000, 10_000), op("c1", "C", 35_000, 10_000, "0"),
              op("early", "A", -5_000, 4_000), {"name": "meta", "ph": "M"}]
    bd = bench.op_breakdown(events, (0, 40_000), 2, top=2)
    # per step (2 steps): A 2.5 alone + 1.25 shared with B + 5; B 1.25 shared + 1;
    # C 2.5 of its 5 inside the window; the union 13.5 of 20
    assert bd["step_ms"] == 20 and bd["busy_ms_per_iter"] == 13.5
    assert bd["idle_ms_per_iter"] == 6.5 and bd["ops_per_iter"] == 2
    a, c, other = bd["by_type"]
    assert (a["op_type"], a["ms_per_iter"], a["span_ms_per_iter"], a["count_per_iter"],
            a["share"], a["on"]) == ("A", 8.75, 10, 1, 0.4375, ["gpu"])
    assert (c["op_type"], c["ms_per_iter"], c["span_ms_per_iter"], c["on"]) == (
        "C", 2.5, 2.5, ["host"])
    assert (other["op_type"], other["ms_per_iter"], other["span_ms_per_iter"],
            other["count_per_iter"], other["rows"], other["on"]) == (
        "other", 2.25, 3.5, 0.5, 1, ["gpu"])
    assert [(r["name"], r["op_type"], r["ms_per_iter"]) for r in bd["by_op"]] == [
        ("a2", "A", 5), ("a1", "A", 3.75), ("other", None, 4.75)]


def test_gpt_gpu_without_a_gpu_says_it_needs_one():
    pytest.importorskip("torch")
    res = _run(GPT_GPU, "--config", "jobs/gpt_tiny.yaml")
    assert res.returncode == 1 and not res.stdout
    assert "gpt_gpu: needs CuPy" in res.stderr


def test_gpu_throughput_bf16_dry_run_runs_pytorch_channels_last_autocast():
    pytest.importorskip("torch")
    res = _run(THROUGHPUT, "--dry-run", "--precision", "bf16", "--configs",
               "jobs/cifar10_quick.yaml", "--batches", "2")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["precision"] == "bf16" and out["dry_run"] is True
    (entry,) = out["results"]
    assert entry["dry_run_torch_loss"] > 0 and entry["dry_run_purine_loss"] > 0


def test_gpu_throughput_bf16_graph_inputs_keep_the_pinned_channels_last_layout():
    """The whole-step CUDA graph's input buffers take their pinned host
    tensors' strides: bf16's channels-last images copied into an NCHW buffer
    went through a pageable contiguous temporary, which a capture refuses
    (bench_bf16.json of 2026-11-29: torch_graph_error "Cannot copy between
    CPU and CUDA tensors during CUDA graph capture unless the CPU tensor is
    pinned")."""
    torch = pytest.importorskip("torch")
    spec = importlib.util.spec_from_file_location("gpu_throughput_graph", THROUGHPUT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    config = bench.load(os.path.join(REPO, "jobs", "cifar10_quick.yaml"), 2)
    for precision, channels_last in (("bf16", True), ("fp32", False)):
        *_, x_host, y_host = bench._torch_setup(dict(config, precision=precision), None, False)
        assert x_host.is_contiguous(memory_format=torch.channels_last) == channels_last
        assert x_host.is_contiguous() != channels_last
        static_x, static_y = bench.static_inputs(torch, torch.device("cpu"), x_host, y_host)
        for host, static in ((x_host, static_x), (y_host, static_y)):
            assert static.shape == host.shape and static.dtype == host.dtype
            assert static.stride() == host.stride()   # one memcpy, no temporary


def test_gpu_session_gpt_stage_runs_both_bf16_benchmarks():
    text = open(os.path.join(REPO, "benchmarks", "gpu_session.sh")).read()
    stage = text.split("\n  gpt)", 1)[1].split(";;", 1)[0]
    assert "gpu_throughput.py" in stage and "--precision bf16" in stage
    assert "benchmarks/gpt_gpu.py" in stage and "--budget-s" in stage and "--deadline-s" in stage
    # ours with the cuBLASLt epilogue beside the default, in the same run
    assert "--sides purine purine_fc_cublaslt torch_eager torch_compile" in stage
    # the kernel microbenchmarks, new against old, each through `micro`, which
    # runs benchmarks/NAME.py under a timeout of its cap (after the headline)
    micro = stage.split("micro() {", 1)[1].split("\n    }\n", 1)[0]
    assert 'timeout --kill-after=5 "$cap" "$PYTHON" "benchmarks/$name.py"' in micro, micro
    for script in ("loss_kernel_gpu", "bias_gelu_gpu", "layernorm_kernel_gpu", "adam_copy_gpu"):
        assert re.search(rf"^    micro {script} \d+ \d+$", stage, re.M), script
        assert stage.index(f"micro {script} ") > stage.index("benchmarks/gpt_gpu.py"), script


def _bench(name="gpt_gpu_kernels"):
    spec = importlib.util.spec_from_file_location(name, GPT_GPU)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


FPROP = "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x64"
BPROP = "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x64"


def _cupti_trace(steps, forward=("purine::Attention",), backward=("purine::AttentionGrad",),
                 graph=False):
    """A torch.profiler Chrome trace (µs) of ``steps`` steps as CUPTI and
    the host profiler write it: per step the forward's host ranges
    (``forward``, nested in that order) on thread 11 launch the SDPA fprop
    (200 µs) and a memset (10 µs); the backward's on thread 12 the bprop
    (500 µs) and a cast (30 µs); outside them thread 11 launches a GEMM
    (1 ms) and another SDPA fprop (a second attention's, 200 µs: counted
    as a kernel, not attributed), and thread 13 launches a cast (40 µs)
    while thread 11's forward range is open (another thread: not the
    attention's). ``graph``: one cudaGraphLaunch a step instead, on thread
    1 outside every range (the CUDA-graph steps: nothing attributed)."""
    events, corr = [], iter(range(1, 10 ** 6))

    def host(name, tid, ts, dur):
        events.append({"ph": "X", "cat": "user_annotation" if name.startswith("purine")
                       else "cpu_op", "name": name, "pid": 5, "tid": tid, "ts": ts,
                       "dur": dur})

    def launch(tid, ts, api="cudaLaunchKernel", cat="cuda_runtime"):
        c = next(corr)
        events.append({"ph": "X", "cat": cat, "name": api, "pid": 5, "tid": tid, "ts": ts,
                       "dur": 3, "args": {"correlation": c}})
        return c

    def gpu(name, ts, dur, c, cat="kernel"):
        events.append({"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": 7, "ts": ts,
                       "dur": dur, "args": {"correlation": c}})
        events.append({"ph": "f", "cat": "ac2g", "name": "ac2g", "id": c, "ts": ts})

    for s in range(steps):
        t = 10000.0 * s
        work = [(FPROP, 200, "kernel"), ("Memset (Device)", 10, "gpu_memset"),
                (BPROP, 500, "kernel"), ("from_bf16_bits", 30, "kernel"),
                ("nvjet_sm90_gemm", 1000, "kernel"), (FPROP, 200, "kernel"),
                ("to_bf16_bits", 40, "kernel")]
        if graph:
            c = launch(1, t, "cudaGraphLaunch")
            cs = [c] * len(work)
        else:
            for i, name in enumerate(forward):
                host(name, 11, t + 10 + i, 100 - 2 * i)
            for i, name in enumerate(backward):
                host(name, 12, t + 200 + i, 100 - 2 * i)
            cs = [launch(11, t + 20, "cuLaunchKernelEx", "cuda_driver"),
                  launch(11, t + 30, "cudaMemsetAsync"),
                  launch(12, t + 220, "cuLaunchKernelEx", "cuda_driver"),
                  launch(12, t + 250), launch(11, t + 400), launch(11, t + 420),
                  launch(13, t + 40)]
        for (name, dur, cat), c, k in zip(work, cs, range(len(work))):
            gpu(name, t + 1000 + 1500 * k, dur, c, cat)
    return events


def test_the_attention_work_of_a_cupti_trace_splits_sdpa_kernels_from_the_rest():
    """attention_work on a made-up CUPTI trace: the SDPA kernels (ours
    cuDNN's, by name, wherever launched) summed per step; the rest of the
    GPU work launched inside the attention's host ranges (on their thread,
    nested ranges once: PyTorch's) apart; nothing attributed without ranges."""
    bench = _bench()
    sdpa = [[BPROP, 0.5, 1.0], [FPROP, 0.4, 2.0]]
    other = [["from_bf16_bits", 0.03, 1.0], ["Memset (Device)", 0.01, 1.0]]
    ours = bench.attention_work(_cupti_trace(3), 3)
    assert ours == {"kernel_ms_per_iter": 0.9, "kernels": sdpa, "other_ms_per_iter": 0.04,
                    "other": other, "other_launches_per_iter": 2.0, "attributed": 2.0}
    theirs = bench.attention_work(_cupti_trace(
        2, forward=("aten::scaled_dot_product_attention",
                    "aten::_scaled_dot_product_cudnn_attention"),
        backward=("autograd::engine::evaluate_function: ScaledDotProductCudnnAttentionBackward0",
                  "aten::_scaled_dot_product_cudnn_attention_backward")), 2)
    assert theirs == ours   # nested ranges: each launch once
    # Inductor's Triton kernels named after the SDPA operator they feed: not SDPA kernels
    glue = _cupti_trace(1)
    glue += [dict(e, name="triton_poi_fused__scaled_dot_product_cudnn_attention_0")
             for e in glue if e.get("name") == "nvjet_sm90_gemm"]
    assert bench.attention_work(glue, 1)["kernels"] == [[BPROP, 0.5, 1.0], [FPROP, 0.4, 2.0]]
    for trace in (_cupti_trace(2, graph=True), _cupti_trace(2, forward=("other",),
                                                            backward=("aten::mm",))):
        got = bench.attention_work(trace, 2)
        assert got["kernels"] == sdpa and got["kernel_ms_per_iter"] == 0.9
        assert got["other"] is None and got["other_ms_per_iter"] is None and \
            got["attributed"] == 0
    fields = bench.attention_fields(_cupti_trace(1), 1, "its steps")
    assert fields["attention_ms_per_iter"] == 0.9 and fields["attention_kernels"] == sdpa
    assert "what issue 45's target is judged on" in fields["attention_note"]
    assert fields["attention_other_ms_per_iter"] == 0.04 and \
        fields["attention_other_launches_per_iter"] == 2.0
    none = bench.attention_fields([e for e in _cupti_trace(1) if "sdpa" not in e["name"]], 1,
                                  "its steps")
    assert none["attention_ms_per_iter"] is None and "not measured" in none["attention_note"]


def test_our_attention_ops_run_in_host_ranges_the_profiler_sees_on_their_thread(tmp_path):
    """attention_ranges: our Attention and AttentionGrad ops' runs as
    ``purine::Attention`` / ``purine::AttentionGrad`` host ranges that
    torch.profiler records on the thread that runs them (our dispatcher's
    workers: every thread profiled), the classes as before after."""
    torch = pytest.importorskip("torch")
    import threading

    import numpy as np
    from torch.profiler import ProfilerActivity, profile

    from purine_mpi.graph.core import Op
    from purine_mpi.ops import attention
    from purine_mpi.ops.registry import make_kernel
    bench = _bench()
    real = (attention.Attention.run, attention.AttentionGrad.run)
    qkv = np.random.default_rng(0).standard_normal((1, 4, 12)).astype(np.float32)
    fwd = make_kernel(Op("a", "Attention", ["qkv"], ["ctx"], {"num_heads": 2}))
    bwd = make_kernel(Op("g", "AttentionGrad", ["dctx", "qkv"], ["dqkv"], {"num_heads": 2}))
    ctx, dqkv = np.zeros((1, 4, 4), np.float32), np.zeros_like(qkv)
    fwd.setup([qkv], [ctx])
    bwd.setup([ctx, qkv], [dqkv])
    tids = []

    def work():
        tids.append(threading.get_native_id())
        fwd.run([qkv], [ctx])
        bwd.run([ctx, qkv], [dqkv])
    from torch.profiler import _ExperimentalConfig
    with bench.attention_ranges():
        with profile(activities=[ProfilerActivity.CPU],
                     experimental_config=_ExperimentalConfig(profile_all_threads=True)) as prof:
            t = threading.Thread(target=work)
            t.start()
            t.join()
    assert (attention.Attention.run, attention.AttentionGrad.run) == real
    path = os.path.join(str(tmp_path), "trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        ranges = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and
                  str(e.get("name")).startswith("purine::")]
    assert sorted(e["name"] for e in ranges) == ["purine::Attention", "purine::AttentionGrad"]
    assert {e["tid"] for e in ranges} == {tids[0]}   # the worker's, as CUPTI's calls name it
    assert np.abs(dqkv).sum() > 0
    # outside the block: no ranges
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fwd.run([qkv], [ctx])
    assert not [e for e in prof.events() if e.name.startswith("purine::")]


def test_the_sdpa_kernel_pattern_takes_the_sdpa_kernels_and_nothing_else():
    """ATTENTION_KERNELS on CUPTI names: every SDPA backend's kernels (cuDNN,
    flash 2 and 3, memory-efficient), none of the work beside them: Inductor's
    Triton kernels named after the operator they feed, PyTorch's elementwise
    and reduction templates, whose names carry their functor's (a lambda of
    an attention function), the math backend's GEMMs and softmax, and every
    kernel our sources define (the non-SDPA path's softmax and products)."""
    bench = _bench()
    sdpa = [FPROP, BPROP,
            "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 64, 4, "
            "false, false, cutlass::bfloat16_t>, false, true>(pytorch_flash::Flash_fwd_params)",
            "void pytorch_flash::flash_bwd_dot_do_o_kernel<true, Flash_bwd_kernel_traits<64>>"
            "(pytorch_flash::Flash_bwd_params)",
            "void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<"
            "flash::CollectiveMainloopFwdSm90<2>>>>(flash::Params)",
            "fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<"
            "cutlass::bfloat16_t, cutlass::arch::Sm80, true, 64, 64, 64, true, true>::Params)",
            "fmha_cutlassB_bf16_aligned_64x64_k64_sm80(PyTorchMemEffAttention::"
            "AttentionBackwardKernel<cutlass::arch::Sm80, cutlass::bfloat16_t>::Params)"]
    other = ["triton_poi_fused__scaled_dot_product_cudnn_attention_0",
             "triton_per_fused__softmax_attn_1",
             "void at::native::vectorized_elementwise_kernel<4, at::native::(anonymous "
             "namespace)::_scaled_dot_product_attention_math(at::Tensor const&)::{lambda(float)"
             "#1}, std::array<char*, 2ul>>(int, at::native::(anonymous namespace)::"
             "_scaled_dot_product_attention_math(at::Tensor const&)::{lambda(float)#1}, "
             "std::array<char*, 2ul>)",
             "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, "
             "at::native::flash_sum_attn_functor<float>, unsigned int, float, 4>>(...)",
             "void at::native::(anonymous namespace)::cunn_SoftMaxForward<8, c10::BFloat16, "
             "float, c10::BFloat16, at::native::(anonymous namespace)::"
             "SoftMaxForwardEpilogue>(c10::BFloat16*, c10::BFloat16 const*, int)",
             "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_"
             "execute_segment_k_off_kernel__5x_cublas",
             "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", "Memcpy DtoD (Device -> Device)"]
    names = set()
    for path in [os.path.join(REPO, "cuda", f) for f in os.listdir(os.path.join(REPO, "cuda"))]:
        with open(path) as f:
            names |= set(re.findall(r"__global__\s+void\s+(\w+)", f.read()))
    assert len(names) > 20, names   # the sources were read
    pattern = re.compile(bench.ATTENTION_KERNELS, re.I)
    assert [n for n in sdpa if not pattern.search(n)] == []
    assert [n for n in other + sorted(names) if pattern.search(n)] == []


def test_pytorchs_sdpa_backend_is_reported_beside_its_attention_time():
    """Which SDPA backend a side ran (the operator PyTorch's dispatcher
    chose, from the host's ranges; ours from the kernels' names): cuDNN,
    flash, memory-efficient, or the math backend, whose GEMMs and softmax
    are no SDPA kernel -- its time is null with a note naming it, never 0,
    and the ratio against it is null and says why."""
    bench = _bench()
    cudnn = bench.attention_fields(_cupti_trace(
        1, forward=("aten::scaled_dot_product_attention",
                    "aten::_scaled_dot_product_cudnn_attention"),
        backward=("aten::_scaled_dot_product_cudnn_attention_backward",)), 1, "its steps")
    assert cudnn["attention_backend"] == ["cudnn"] and cudnn["attention_ms_per_iter"] == 0.9
    flash = [dict(e, name=e["name"].replace("cudnn", "flash")) for e in _cupti_trace(
        1, forward=("aten::scaled_dot_product_attention",
                    "aten::_scaled_dot_product_cudnn_attention"), backward=())]
    assert bench.attention_fields(flash, 1, "its steps")["attention_backend"] == ["flash"]
    # the math backend: bmm and softmax inside aten::_scaled_dot_product_attention_math
    math_trace = [dict(e, name={FPROP: "void at::native::(anonymous namespace)::"
                                "cunn_SoftMaxForward<8, float>", BPROP: "nvjet_tst_bmm"}.get(
                                    e["name"], e["name"]))
                  for e in _cupti_trace(1, forward=("aten::scaled_dot_product_attention",
                                                    "aten::_scaled_dot_product_attention_math"),
                                        backward=("aten::bmm",))]
    got = bench.attention_fields(math_trace, 1, "its steps")
    assert got["attention_ms_per_iter"] is None and got["attention_backend"] == ["math"]
    assert "math" in got["attention_note"] and "not measured" in got["attention_note"]
    # ours: no operator ranges in the CUDA-graph steps, the backend from the kernels
    ours = bench.attention_fields(None, 2, "our steps", work={
        "kernel_ms_per_iter": 0.9, "kernels": [[BPROP, 0.5, 1.0]], "other": None})
    assert ours["attention_backend"] == ["cudnn"]
    none = bench.attention_fields(None, 2, "our steps", work={
        "kernel_ms_per_iter": 0.0, "kernels": [], "other": None})
    assert none["attention_backend"] is None and none["attention_ms_per_iter"] is None
    assert "attention_backend" in bench.PROFILE_FIELDS["attention"]
    sides = {"purine": dict(ours, attention_ms_per_iter=1.0),
             "torch_eager": dict(got), "torch_compile": dict(cudnn, attention_ms_per_iter=0.8)}
    ratios = bench.attention_ratios(sides)
    assert ratios["purine_attention_vs_torch_compile"] == 1.25
    assert "ours cudnn, theirs cudnn" in ratios["purine_attention_vs_torch_compile_note"]
    assert ratios["purine_attention_vs_torch_eager"] is None
    assert "math" in ratios["purine_attention_vs_torch_eager_note"]


def test_gpt_gpu_kernel_tables_from_cupti_figures(monkeypatch, tmp_path):
    """The kernel tables' GPU path on the CPU, kernel_stats (CUPTI) standing
    in with a made-up trace: ours around the profiled steps of a trainer of
    its own (the SDPA kernels' time from the CUDA-graph steps, the
    attention's other work from eager steps in our ops' host ranges),
    PyTorch's from one profile, each against the side's timed step."""
    torch = pytest.importorskip("torch")
    import types
    bench = _bench()
    import gpu_throughput   # on the path gpt_gpu set
    args = types.SimpleNamespace(batch=2, micro_batches=1, seq=32, warmup=1, profile_iters=2,
                                 config=os.path.join(REPO, "jobs", "gpt_tiny.yaml"), device=-1)
    config = bench.load(args, bench.token_file(str(tmp_path)), -1, "fp32")
    # no CUDA PyTorch: kernel_stats has nothing, and the table says so
    assert bench.purine_kernels(config, args, 20.0) == (
        (None, "not measured: torch.profiler saw no CUDA device"), {})
    steps, traces = [], []

    def stats(step, iters, match=None, events=None):
        for i in range(iters):
            steps.append(step(i))
        trace = traces.pop(0)
        if events is not None:
            events.extend(trace)
        found = {}
        if match:   # the CUDA-graph steps: the matched kernels from a CUDA-only profile
            found = {"matched_table": bench.attention_work(trace, iters, match)["kernels"]}
        return {**found, "kernels_per_iter": 12.0, "kernel_ms_per_iter": 5.0,
                "top_kernels": [["gemm", 4.0, 2.0], ["cupy_add", 1.0, 10.0]]}
    monkeypatch.setattr(gpu_throughput, "kernel_stats", stats)
    traces.append(_cupti_trace(2, graph=True))
    (table, note), fields = bench.purine_kernels(config, args, 20.0)
    assert note is None and len(steps) == 2
    assert table == {"source": "torch.profiler (CUPTI) around 2 of our CUDA-graph steps (as "
                     "train runs them)", "kernels_per_iter": 12.0, "kernel_ms_per_iter": 5.0,
                     "iter_ms": 20.0, "gpu_busy": 0.25,
                     "top_kernels": [["gemm", 4.0, 2.0], ["cupy_add", 1.0, 10.0]]}
    assert fields["attention_ms_per_iter"] == 0.9 and "CUDA-graph" in fields["attention_note"]
    assert not any(k.startswith("attention_other") for k in fields)
    # the eager trace: our spans, then as many steps under CUPTI in our ranges
    traces.append(_cupti_trace(2))
    got = bench.profile_side("purine", "trace", config, args, 20.0, None)
    assert len(steps) == 4 and got["attention_span_ms_per_iter"] > 0
    assert got["attention_other_ms_per_iter"] == 0.04 and \
        got["attention_other"][0] == ["from_bf16_bits", 0.03, 1.0]
    assert "eager steps" in got["attention_other_note"]
    assert set(got) == {f for g in bench.PROFILE_GROUPS[("purine", "trace")]
                        for f in bench.PROFILE_FIELDS[g] + (f"{g}_note",)}
    side = bench.TorchSide(torch, config, torch.device("cpu"), 1, 2, False, "fp32")
    cpu = side.profile(2, 25.0)
    assert cpu["kernels"] is None and cpu["attention_ms_per_iter"] is None and \
        cpu["attention_note"] == "not measured: torch.profiler's CUDA kernels need a GPU"
    side.dev = types.SimpleNamespace(type="cuda")   # the GPU branch, stepping on the CPU
    traces.append(_cupti_trace(2, forward=("aten::scaled_dot_product_attention",),
                               backward=("aten::_scaled_dot_product_cudnn_attention_backward",)))
    got = side.profile(2, 25.0)
    assert got["attention_ms_per_iter"] == 0.9 and len(steps) == 6
    assert got["attention_kernels"][0] == [BPROP, 0.5, 1.0]
    assert got["attention_other_ms_per_iter"] == 0.04
    assert got["kernels"]["gpu_busy"] == 0.2 and \
        got["kernels"]["top_kernels"][0] == ["gemm", 4.0, 2.0]


def test_gpt_gpu_recompute_layers_reach_the_job():
    """--recompute-layers sets recompute: full on those layers, at one
    micro-batch and at several (recompute combines with micro-batches: once
    refused, the benchmark then dropped it), and the default runs the job
    as written."""
    import argparse
    spec = importlib.util.spec_from_file_location("gpt_gpu_for_test", GPT_GPU)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def config(layers, micro_batches=1):
        args = argparse.Namespace(config=os.path.join(REPO, "jobs", "gpt_tiny.yaml"), batch=2,
                                  micro_batches=micro_batches, seq=None,
                                  recompute_layers=layers)
        return module.load(args, "tokens.h5", 0, "bf16")

    asked = config("h*_ln1,h*_gelu")
    assert asked["recompute"] == "full" and asked["recompute_layers"] == ["h*_ln1", "h*_gelu"]
    assert config("").get("recompute", "none") == "none"
    at_two = config("h*_gelu", micro_batches=2)
    assert at_two["recompute"] == "full" and at_two["recompute_layers"] == ["h*_gelu"]
    assert at_two["parallel"]["micro_batches"] == 2


def _tiny_gpt_on_the_emulated_device(host_build_dir, monkeypatch, tmp_path, name):
    """benchmarks/gpt_gpu.py loaded as module ``name`` on the emulated
    device, cuBLAS and cuBLASLt reset, and the bf16 tiny GPT's config
    (jobs/gpt_tiny.yaml, batch 2 x 32 tokens of purine_mpi/data's sources
    written to ``tmp_path``): ``(bench, config)``."""
    import gc

    from purine_mpi.data.text import write_text
    from tests.emulated_gpu.helpers import emulated_gpu_env
    emulated_gpu_env(monkeypatch, host_build_dir)
    spec = importlib.util.spec_from_file_location(name, GPT_GPU)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    from purine_mpi.gpu import blas, blaslt
    from purine_mpi.job.config import load_config
    blas.reset()
    blaslt.reset()
    gc.collect()
    tokens = str(tmp_path / "tokens.h5")
    write_text(os.path.join(REPO, "purine_mpi", "data"), tokens, glob="*.py", val_fraction=0.1)
    config = load_config(os.path.join(REPO, "jobs", "gpt_tiny.yaml"), overrides=[
        f"data.train.path={tokens}", f"data.test.path={tokens}", "data.train.batch_size=2",
        "data.train.sequence_length=32", "device=0", "precision=bf16",
        "checkpoint.interval=0"], check_files=False)
    return bench, config


def test_our_sides_in_one_process_each_report_their_own_peak(host_build_dir, monkeypatch,
                                                            tmp_path):
    """gpt_gpu.run_purine, the default side then PURINE_FC_EPILOGUE=cublaslt,
    in one process on the emulated device (the bf16 tiny GPT): each side's
    ``peak_memory_bytes`` is its own -- the cuBLASLt side's no more than the
    default's (issue 45: on an H200 it read 19.1 GB against 9.64, about
    twice, as the default side's trainer kept its device arena in use: its
    data reader's prefetch thread held it, runtime/dispatcher
    ``_stop_prefetch``). Fails before: the second side's figure was the
    first's plus its own (2.0x). ``device_memory`` says what each side made
    (the cuBLASLt plans only on its side, none refused) and left."""
    bench, config = _tiny_gpt_on_the_emulated_device(host_build_dir, monkeypatch, tmp_path,
                                                     "gpt_gpu_sides")
    args = types.SimpleNamespace(device=0, iters=2, warmup=1)
    sides = {}
    for side in ("purine", "purine_fc_cublaslt"):
        with bench.environment(bench.OURS[side]):
            sides[side] = bench.run_purine(config, args)
    ours, lt = sides["purine"], sides["purine_fc_cublaslt"]
    assert ours["peak_memory_bytes"] > 0
    assert lt["peak_memory_bytes"] <= ours["peak_memory_bytes"] * 1.01, (ours, lt)
    mem, lt_mem = ours["device_memory"], lt["device_memory"]
    assert lt_mem["peak_with_earlier_bytes"] == lt["peak_memory_bytes"] + \
        lt_mem["in_use_before_bytes"]
    assert mem["arena_bytes"] > 0 and lt_mem["arena_bytes"] == mem["arena_bytes"]
    assert lt_mem["cublaslt_plans"] > 0 and mem["cublaslt_plans"] == 0
    assert lt_mem["cublaslt_refused"] == mem["cublaslt_refused"] == 0
    assert mem["cublas_handles"] > 0 and mem["cublas_workspace_bytes"] > 0


def test_a_side_reusing_memory_released_during_it_still_reports_its_own_peak(
        host_build_dir, monkeypatch, tmp_path):
    """gpt_gpu.run_purine when memory in use before the side is given back
    during it (an earlier side's leftovers collected once the side runs):
    the side's new allocations then reuse those bytes, so the most in use
    at once less what was in use when it began understated the side's own
    peak -- here by the 64 MiB held and let go. The figure is now the most
    in use beyond the least in use seen before an allocation
    (gpu/memory.PeakMemory ``own_peak``): at least what the side held at
    once, its arena plus its cuBLAS workspaces. Fails before: the peak
    read 64 MiB less than those."""
    import gc

    from purine_mpi.tools import bench as tools_bench
    bench, config = _tiny_gpt_on_the_emulated_device(host_build_dir, monkeypatch, tmp_path,
                                                     "gpt_gpu_release")
    import cupy
    held = [cupy.zeros(64 << 20, dtype=cupy.uint8)]   # an earlier side's, still in use
    real = tools_bench.run_bench

    def releasing(*a, **kw):
        held.clear()        # ... let go once the side has begun
        gc.collect()
        return real(*a, **kw)
    monkeypatch.setattr(tools_bench, "run_bench", releasing)
    args = types.SimpleNamespace(device=0, iters=2, warmup=1)
    res = bench.run_purine(config, args)
    mem = res["device_memory"]
    assert mem["in_use_before_bytes"] >= 64 << 20, mem
    held_at_once = mem["arena_bytes"] + mem["cublas_workspace_bytes"]
    assert res["peak_memory_bytes"] >= held_at_once, (res["peak_memory_bytes"], mem)

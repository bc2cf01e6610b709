#!/usr/bin/env python
"""GPT training speed on one GPU in bf16: purine_mpi's ``jobs/gpt2_124m.yaml``
against PyTorch with the same model, side by side in one run (issue 45).

    python benchmarks/gpt_gpu.py [--config jobs/gpt2_124m.yaml] [--batch 16]
        [--micro-batches 1] [--recompute-layers 'h*_ln1,h*_ln2,h*_gelu'] [--seq T]
        [--iters 10] [--warmup 3] [--rounds 2]
        [--sides purine purine_fc_cublaslt torch_eager torch_compile] [--profile-iters 3]
        [--budget-s S] [--deadline-s S] [--device 0]
    python benchmarks/gpt_gpu.py --dry-run --config jobs/gpt_tiny.yaml
        CPU smoke run at a tiny size: every side but torch.compile, no figures

The sides, interleaved (round 1: each side once, in order; round 2: again;
...), each ``--warmup`` untimed then ``--iters`` timed training steps of
``--micro-batches`` micro-batches of ``--batch`` sequences of ``--seq``
tokens (the job shortened: its 32 micro-batches of 16 would make one step
take seconds):

- ``purine``: ``bench``'s own timing loop (tools/bench.run_bench) of the job
  with ``--set precision=bf16 device=N parallel.micro_batches=M
  data.train.batch_size=B*M`` (and with ``--recompute-layers
  'h*_ln1,h*_ln2,h*_gelu'`` ``recompute=full recompute_layers=[...]``, in
  each micro-batch:
  the layer norms' and GELU's outputs computed again from their kept
  inputs just before the weight gradients read them, instead of kept,
  12 x 192 MiB and 24 x 48 MiB at 16 x 1024 tokens, as torch.compile's
  partitioner recomputes pointwise ops; bitwise the same; docs/gpu.md;
  not by default: the job as written),
  CUDA-graph replay as ``train`` runs it, on
  a token file written from this repository's own sources (nothing is read
  from the network);
- ``purine_fc_cublaslt`` (only where ``--sides`` names it): ``purine`` with
  ``PURINE_FC_EPILOGUE=cublaslt`` (docs/gpu.md, "Precision": each biased
  fully connected output stored as bits is one cuBLASLt product whose
  epilogue adds the bias rounded to bf16, in place of GemmEx into float32
  scratch + ``bias_bits``); ``purine_fc_cublaslt_vs_purine``: the
  tokens/s ratio of the two, interleaved in one process;
- ``torch_eager``: nanoGPT's model.py (benchmarks/gpt_torch.py's
  ``torch_gpt``: the same sizes, ``F.scaled_dot_product_attention`` with
  ``is_causal``, a tied lm_head) under ``torch.autocast(bfloat16)``, the job's
  AdamW as ``torch.optim.AdamW(fused=True)``, clipping at the job's norm,
  gradient accumulation over the micro-batches;
- ``torch_compile``: the same under ``torch.compile`` (default mode).

Every step is timed as ``bench`` times ours (to the end of the step, the
median of the steps). One JSON object on stdout; per side in ``sides``:
``tokens_per_s`` (median over the rounds; ``tokens_per_s_rounds`` each),
``iter_ms_median``, ``mfu`` (the same model FLOPs per token for every side:
PaLM's closed form from purine_mpi/tools/flops.py, ``model_flops_per_token``;
against ``peak_flops_per_s``, the device's dense bf16 peak, named in
``peak_source``), ``peak_memory_bytes`` (ours: ``bench --json``'s
``device_own_peak_bytes``, its ``device_peak_bytes`` less what was in use
when the side began and stayed in use while it allocated, and
``device_memory``: that figure's parts -- ``in_use_before_bytes``,
``left_in_use_after_bytes``, the arena, scratch, capture pools, the
cuBLAS handles and workspaces and cuBLASLt plans the side made, the
products cuBLASLt refused; ``run_purine``; PyTorch's:
``torch.cuda.max_memory_allocated`` over the side's set-up and steps, less
what the other sides hold),
``attention_ms_per_iter`` (the SDPA kernels' time per step, every side
alike: CUPTI's kernels of the profiled steps named like one,
``ATTENTION_KERNELS``, listed in ``attention_kernels``; ours from the
CUDA-graph steps; what issue 45's attention target is judged on;
``attention_backend``: the SDPA backend the side ran, ``SDPA_BACKENDS``,
PyTorch's from the operator its dispatcher chose, ours from the kernels),
``attention_other_ms_per_iter`` (with ``attention_other`` and
``attention_other_launches_per_iter``: the rest of the GPU work, kernels,
memsets, copies, that CUDA calls inside the attention's host ranges
launched, ``ATTENTION_RANGES``; ours from eager steps with our Attention
ops' runs as ranges, ``attention_ranges``), ``attention_span_ms_per_iter``
(ours only, secondary: the Attention ops' spans in our eager trace, timed
by CUDA events, which hold the host's launching and waits too), each null
with its ``*_note`` saying why when not measured, and ``kernels``:
torch.profiler's (CUPTI) kernels of
``--profile-iters`` steps (ours: CUDA-graph steps, as ``train`` runs them,
in a trainer of their own), ``kernel_ms_per_iter`` (the union of the kernel
intervals) against ``iter_ms`` (the timed median: ``gpu_busy``),
``kernels_per_iter`` and ``top_kernels`` ([name, ms, launches] per step,
the 15 longest; gpu_throughput.kernel_stats); null with ``kernels_note``
saying why (the CPU dry run: no CUDA device). Ours also has
``op_breakdown``, where the step's time goes in our trace of the same eager
steps as its attention's time: every op's span (GPU ops: CUDA events) with
the time it overlaps other ops split evenly among them, summed by op type
(``by_type``) and by op (``by_op``): ``ms_per_iter`` (the rows add up to
``busy_ms_per_iter``, never more than ``step_ms``, the traced steps' wall
time each), ``span_ms_per_iter`` (the spans whole), ``count_per_iter``,
``share`` (of ``step_ms``), ``on`` (gpu, host, comm); the 15 longest, then
``other``; ``idle_ms_per_iter``: no op running (the host between launches).
``purine_vs_torch_eager`` / ``_compile``: the tokens/s ratios;
``purine_attention_vs_torch_eager`` / ``_compile``: our SDPA kernels' time
over theirs (the target: at most 1.10), with ``..._note``: both backends, or
why null (PyTorch's math backend launches no SDPA kernel: not compared).
``--budget-s``: rounds after the first, and the profiles after the rounds
(ours eager: our trace's steps, then as many under CUPTI; ours in CUDA
graphs; PyTorch's: in that order), are skipped
once that many seconds have passed (``cut_short``: "budget"; with
``--deadline-s``, the end a stage's timeout sets, a profile of ours, a
trainer more, begins only where a round of ours fits before it, 5 s
spare), and a SIGTERM (a stage's ``timeout``) ends the run with the JSON
of what was measured (``cut_short``: "terminated"), so the JSON comes back
inside a session stage's budget.

Without CuPy, a CUDA device and a CUDA PyTorch it exits 1 saying so (it
never reports CPU figures as GPU ones); ``--dry-run`` runs every side but
``torch_compile`` for one step on the CPU in fp32 (bf16 is a GPU setting of
ours, so no autocast either), prints the same JSON with ``"dry_run": true``.
"""
import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
sys.path.insert(0, HERE)

SIDES = ("purine", "purine_fc_cublaslt", "torch_eager", "torch_compile")
#: the sides run unless --sides names others (purine_fc_cublaslt: asked for)
DEFAULT_SIDES = ("purine", "torch_eager", "torch_compile")
#: our sides, and the environment each runs in (set around its set-up and steps)
OURS = {"purine": {}, "purine_fc_cublaslt": {"PURINE_FC_EPILOGUE": "cublaslt"}}
#: the SDPA kernels themselves, by CUPTI's kernel name: cuDNN's
#: (``cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_...`` and
#: ``..._bprop_...``: ours, and PyTorch's cuDNN backend, which PyTorch 2.11
#: took on an H200), PyTorch's flash backend (``flash_fwd_kernel``,
#: ``flash_fwd_splitkv_kernel``, ``flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel``
#: with its ``flash_bwd_dot_do_o_kernel`` and ``flash_bwd_convert_dq_kernel``;
#: FlashAttention-3's ``flash::...``) and memory-efficient backend
#: (``fmha_cutlassF_*``, ``fmha_cutlassB_*``); not Inductor's Triton kernels,
#: which take the names of the operators they feed
#: (``triton_poi_fused__scaled_dot_product_cudnn_attention_0``: a layout copy),
#: nor PyTorch's elementwise and reduction templates (``void at::native::...``),
#: whose names carry their functor's type, a lambda of an attention function
#: among them (no SDPA backend's kernel lies in ``at::native``)
ATTENTION_KERNELS = r"^(?!triton_)(?!(void )?at::native::).*(flash|fmha|attention|sdpa|attn)"
#: the SDPA backend a side ran: (name, the operator PyTorch's dispatcher ran
#: for it, as torch.profiler's host ranges name it, and where no operator is
#: recorded -- our CUDA-graph steps -- its kernels' names). The math backend
#: (GEMMs and a softmax) launches no SDPA kernel: its time is not comparable
SDPA_BACKENDS = (
    ("cudnn", r"^aten::_scaled_dot_product_cudnn_attention", r"cudnn.*sdpa"),
    ("flash", r"^aten::_(scaled_dot_product_)?flash_attention", r"flash_(fwd|bwd)|flash::"),
    ("efficient", r"^aten::_(scaled_dot_product_)?efficient_attention", r"fmha_cutlass"),
    ("math", r"^aten::_scaled_dot_product_attention_math", None),
    ("overrideable", r"^aten::_scaled_dot_product_fused_attention_overrideable", None))
#: the host ranges whose GPU work is the attention's: our Attention ops'
#: runs (``purine::Attention``, ``purine::AttentionGrad``: ranges this
#: benchmark opens, ``attention_ranges``) and PyTorch's SDPA operators
#: (``aten::scaled_dot_product_attention``,
#: ``aten::_scaled_dot_product_{cudnn,flash,efficient}_attention[_backward]``,
#: ``aten::_{flash,efficient}_attention_{forward,backward}``)
ATTENTION_RANGES = (r"^purine::Attention|"
                    r"^aten::_*(scaled_dot_product|flash_attention|efficient_attention|"
                    r"cudnn_attention)")
#: a Chrome trace's (torch.profiler's) categories of GPU work and of the
#: host's CUDA calls that launch it (matched by ``args.correlation``)
GPU_WORK = ("kernel", "gpu_memset", "gpu_memcpy")
HOST_CALLS = ("cuda_runtime", "cuda_driver")


class Terminated(Exception):
    """A SIGTERM: report what was measured."""


def _terminated(signum, frame):
    raise Terminated()


def fail(message):
    print(f"gpt_gpu: {message}", file=sys.stderr, flush=True)
    sys.exit(1)


def token_file(directory):
    """A byte-token file of this repository's Python sources (ids < 256 fit
    any vocabulary): the data of our side, written here, nothing fetched."""
    from purine_mpi.data.text import write_text
    path = os.path.join(directory, "tokens.h5")
    write_text(os.path.join(REPO, "purine_mpi"), path, glob="*.py", val_fraction=0.1)
    return path


def load(args, tokens, device, precision):
    from purine_mpi.job.config import load_config
    sets = [f"data.train.path={tokens}", f"data.test.path={tokens}",
            f"parallel.micro_batches={args.micro_batches}",
            f"data.train.batch_size={args.batch * args.micro_batches}",
            f"device={device}", f"precision={precision}", "checkpoint.interval=0"]
    if args.seq:
        sets.append(f"data.train.sequence_length={args.seq}")
    layers = getattr(args, "recompute_layers", None)
    if layers:   # in each micro-batch copy (recompute combines with micro-batches)
        sets += ["recompute=full", f"recompute_layers=[{layers}]"]
    return load_config(args.config, overrides=sets, check_files=False)


def flops_per_token(config):
    """PaLM's closed form (tools/flops.py) of the job's one-micro-batch graph, and its words."""
    from purine_mpi.job.job import job_of
    from purine_mpi.job.replica import build_train_graph
    from purine_mpi.tools.flops import gpt_closed_form, gpt_figures
    graph, _ = build_train_graph(job_of(config))
    n, layers, width, t = gpt_figures(graph)
    return gpt_closed_form(n, layers, width, t), (
        f"PaLM's 6N + 12*L*H*Q*T with N = {n:,} (the parameters without position "
        f"embeddings, as nanoGPT's estimate_mfu), L = {layers}, H*Q = {width}, T = {t}")


# ----------------------------------------------------------- purine_mpi ---

@contextlib.contextmanager
def environment(values):
    """``os.environ`` with ``values`` set for the block (our opt-in side's
    ``PURINE_FC_EPILOGUE``: read at each set-up and product), then as before."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _in_use(device):
    """Bytes in use in CuPy's default pool on ``device`` (after a collection
    and the pool's free blocks given back: ``_free_cupy``), or None without
    a GPU."""
    from purine_mpi.base.backend import cupy_available
    if device < 0 or not cupy_available():
        return None
    import cupy
    _free_cupy()
    with cupy.cuda.Device(device):
        return int(cupy.get_default_memory_pool().used_bytes())


def _lt_counts():
    """(cuBLASLt plans made so far, the products cuBLASLt refused) of this
    process (gpu/blaslt.py: the cache is the process's, so a side's own are
    the difference)."""
    from purine_mpi.gpu import blaslt
    return blaslt.plan_count(), len(blaslt.refused())


def _workspaces(device):
    """(handles, workspace bytes) of the cuBLAS handles made so far on
    ``device`` (gpu/blas.made_totals; the process's, as ``_lt_counts``:
    a side's are the difference, counted also after its close released
    them)."""
    from purine_mpi.gpu import blas
    return blas.made_totals(device) if device >= 0 else (0, 0)


def run_purine(config, args):
    """``bench``'s loop: {tokens_per_s, iter_ms_median, peak_memory_bytes,
    device_memory}. The peak is this side's own: ``bench --json``'s
    ``device_peak_bytes`` (the most bytes in use at once in CuPy's pool,
    plus the captures' pools) less what was in use when the side began --
    what an earlier side left (``in_use_before_bytes``; as PyTorch's
    figure is the side's less what was held before it) -- and stayed in
    use while the side allocated: ``device_own_peak_bytes``
    (gpu/memory.PeakMemory ``own_peak``; what an earlier side let go
    during this one and this one reused counts as this one's). A side sharing
    the process once read about twice its own peak: the side before it
    kept its whole device arena in use through its data reader's prefetch
    thread (issue 45; runtime/dispatcher ``_stop_prefetch``). What the side
    leaves in use after it (``left_in_use_after_bytes``) says whether one
    still does."""
    from purine_mpi.job.job import job_of
    from purine_mpi.tools.bench import run_bench
    device = int(args.device)
    before = _in_use(device)
    plans, refused = _lt_counts()
    handles = _workspaces(device)
    res = run_bench(job_of(config), args.iters, args.warmup)
    seq = config["data"]["train"]["sequence_length"]
    peaks = res.get("device_peak_bytes") or {}
    raw = int(peaks[str(device)]) if str(device) in peaks else None
    # the most in use beyond what earlier sides held, also where some of it
    # was let go while this side ran (its bytes then reused: peak less
    # in_use_before would read that much too low; gpu/memory own_peak)
    own = (res.get("device_own_peak_bytes") or {}).get(str(device))
    peak = None if raw is None else int(own) if own is not None else raw - (before or 0)
    out = {"tokens_per_s": round(res["images_per_s"] * seq, 1),
           "iter_ms_median": res["iter_ms_median"],
           "peak_memory_bytes": peak,
           "peak_memory_source": "bench --json device_own_peak_bytes: device_peak_bytes "
                                 "less what was in use before the side and stayed in use "
                                 "(device_memory.in_use_before_bytes)",
           "cuda_graph": bool((res.get("cuda_graph") or {}).get("segments")),
           "bench_mfu": res.get("mfu")}
    after = _in_use(device)
    if raw is not None:
        key = str(device)
        pools = ((res.get("cuda_graph") or {}).get("capture_pool_bytes") or {}).get(key, 0)
        made = [a - b for a, b in zip(_workspaces(device), handles)]
        plans_after, refused_after = _lt_counts()
        out["device_memory"] = {
            "peak_bytes": peak,
            "peak_with_earlier_bytes": raw,
            "in_use_before_bytes": before,
            "left_in_use_after_bytes": None if after is None else after - (before or 0),
            "arena_bytes": (res.get("device_arena_bytes") or {}).get(key),
            "scratch_bytes": (res.get("device_scratch_bytes") or {}).get(key),
            "capture_pool_bytes": int(pools),
            "cublas_handles": made[0],
            "cublas_workspace_bytes": made[1],
            "cublaslt_plans": plans_after - plans,
            "cublaslt_refused": refused_after - refused}
    return out


def purine_steps(config, args, cuda_graph, measure, steps=None):
    """Our trainer on synthetic data (``cuda_graph`` False: eager stream
    dispatch; None: the job's own, CUDA-graph replay as ``train`` runs it):
    ``--warmup`` steps, then ``measure(trainer, step, steps)`` with ``step(i)``
    the i-th of ``steps`` (default ``--profile-iters``) more; what it returns."""
    from purine_mpi.comm.world import get_world
    from purine_mpi.job.job import job_of
    from purine_mpi.tools.bench import synthetic_config
    from purine_mpi.train.trainer import Trainer
    job = synthetic_config(job_of(config if cuda_graph is None
                                  else dict(config, cuda_graph=cuda_graph)))
    steps = steps or max(1, args.profile_iters)
    job = job.with_training(max_iter=args.warmup + steps)
    trainer = Trainer(job, out_dir="/nonexistent-bench-output", world=get_world(),
                      profile=False, log=lambda m: None)
    try:
        for it in range(args.warmup):
            trainer.step(it)
        trainer.train.drain()
        return measure(trainer, lambda i: trainer.step(args.warmup + i), steps)
    finally:
        trainer.close()
        _free_cupy()


def purine_trace(config, args):
    """Our trace of ``--profile-iters`` eager steps (no CUDA graphs: the
    stream dispatcher times each op with CUDA events), then as many more
    under CUPTI with our attention ops' runs as host ranges
    (``attention_ranges``): (events, the traced steps' window on the
    trace's clock in µs, steps, the CUPTI steps' Chrome events or None
    where torch.profiler sees no CUDA device)."""
    from gpu_throughput import kernel_stats
    from purine_mpi.runtime.trace import Profiler
    steps = max(1, args.profile_iters)

    def measure(trainer, step, _):
        d = trainer.train
        d.profiler = prof = Profiler(0)
        t0 = time.perf_counter()
        for i in range(steps):
            step(i)
        d.drain()
        t1 = time.perf_counter()
        d.profiler = None
        cupti = []

        def cupti_step(i):
            step(steps + i)
            if i == steps - 1:
                d.drain()
        with attention_ranges():
            found = kernel_stats(cupti_step, steps, events=cupti)
        return prof.events, ((t0 - prof.t0) * 1e6, (t1 - prof.t0) * 1e6), steps, (
            cupti if found is not None else None)
    return purine_steps(config, args, False, measure, steps=2 * steps)


def purine_attention(events, steps, on_gpu):
    """The Attention ops' spans per step from our trace, or (None, why):
    the secondary figure (``attention_span_ms_per_iter``)."""
    spans = [e for e in events if str(e.get("args", {}).get("op_type", "")).startswith(
        "Attention")]
    if not spans:
        return None, "our trace has no Attention op spans"
    where = "GPU (CUDA events)" if on_gpu else "host (the CPU dry run)"
    return round(sum(e["dur"] for e in spans) / 1e3 / steps, 4), (
        f"our trace: the Attention ops' spans, timed on the {where}, eager dispatch, "
        f"{steps} step(s): each from the event before its first launch to the event after "
        "its last, so it holds the host's launching and the waits on its inputs too, not "
        "the kernels alone (attention_ms_per_iter: the kernels, what issue 45 is judged on)")


@contextlib.contextmanager
def attention_ranges():
    """Our Attention and AttentionGrad ops' runs as torch.profiler host
    ranges (``purine::Attention``, ``purine::AttentionGrad``) for the
    block, so ``attention_work`` finds the GPU work they launch; as before
    after it (nothing without PyTorch)."""
    try:
        from torch.profiler import record_function
    except ImportError:
        yield
        return
    from purine_mpi.ops import attention
    classes = (attention.Attention, attention.AttentionGrad)
    real = {cls: cls.__dict__["run"] for cls in classes}

    def ranged(cls):
        run, name = real[cls], f"purine::{cls.op_type}"

        def run_in_range(self, ins, outs):
            with record_function(name):
                return run(self, ins, outs)
        return run_in_range
    try:
        for cls in classes:
            cls.run = ranged(cls)
        yield
    finally:
        for cls in classes:
            cls.run = real[cls]


def attention_work(events, steps, kernels=ATTENTION_KERNELS, ranges=ATTENTION_RANGES):
    """The attention's GPU work per step in a torch.profiler trace (Chrome
    events, µs) of ``steps`` steps:

    - ``kernel_ms_per_iter``: the SDPA kernels (names matching ``kernels``,
      case ignored, wherever launched; their durations summed), with
      ``kernels``, [name, ms, launches] per step, the longest first;
    - ``other_ms_per_iter``: the rest of the GPU work (kernels, memsets,
      copies) that a CUDA call made inside a host range named like
      ``ranges`` launched (the call on the range's thread, within it; each
      once, nested ranges too), with ``other`` ([name, ms, launches] per
      step) and ``other_launches_per_iter``; None (and ``attributed`` 0)
      where no SDPA kernel was launched in such a range: then the ranges
      were missing or on no thread of the calls, and nothing can be said
      about what else they launched."""
    import re
    kern, rng = re.compile(kernels, re.I), re.compile(ranges)
    spans = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") not in GPU_WORK + HOST_CALLS and \
                rng.search(str(e.get("name", ""))):
            t0 = float(e["ts"])
            spans.setdefault((e.get("pid"), e.get("tid")), []).append((t0, t0 + float(
                e.get("dur", 0))))
    inside = set()   # correlation ids of the CUDA calls made inside a range
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in HOST_CALLS:
            continue
        corr = (e.get("args") or {}).get("correlation")
        t = float(e["ts"])
        if corr is not None and any(a <= t <= b for a, b in
                                    spans.get((e.get("pid"), e.get("tid")), ())):
            inside.add(corr)
    sdpa, other, attributed = {}, {}, 0
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in GPU_WORK:
            continue
        name = str(e.get("name", "?"))
        is_sdpa = e.get("cat") == "kernel" and bool(kern.search(name))
        launched_inside = (e.get("args") or {}).get("correlation") in inside
        if is_sdpa:
            attributed += launched_inside
            row = sdpa.setdefault(name, [0.0, 0])
        elif launched_inside:
            row = other.setdefault(name, [0.0, 0])
        else:
            continue
        row[0] += float(e.get("dur", 0))
        row[1] += 1

    def table(rows):
        return [[name[:120], round(us / 1e3 / steps, 4), round(n / steps, 2)]
                for name, (us, n) in sorted(rows.items(), key=lambda kv: -kv[1][0])]

    def ms(rows):
        return round(sum(us for us, _ in rows.values()) / 1e3 / steps, 4)
    return {"kernel_ms_per_iter": ms(sdpa), "kernels": table(sdpa),
            "other_ms_per_iter": ms(other) if attributed else None,
            "other": table(other) if attributed else None,
            "other_launches_per_iter": round(sum(n for _, n in other.values()) / steps, 2)
            if attributed else None, "attributed": round(attributed / steps, 2)}


def sdpa_backend(events, kernel_names=()):
    """The SDPA backends a side ran (``SDPA_BACKENDS``' names, in that
    order): from the operators in a torch.profiler trace's host ranges
    (``events``), else from the SDPA kernels' names; None where neither says."""
    import re
    ops = {str(e.get("name", "")) for e in events or () if e.get("ph") == "X"
           and e.get("cat") == "cpu_op"}
    found = [name for name, op, _ in SDPA_BACKENDS if any(re.search(op, o) for o in ops)]
    if not found:
        found = [name for name, _, kern in SDPA_BACKENDS
                 if kern and any(re.search(kern, n, re.I) for n in kernel_names)]
    return found or None


def attention_ratios(sides):
    """Issue 45's attention target: our SDPA kernels' time over each PyTorch
    side's (at most 1.10), ``purine_attention_vs_<side>``, with a note naming
    both sides' SDPA backends, or why there is no ratio (null, never 0)."""
    out, ours = {}, sides.get("purine")
    for theirs in ("torch_eager", "torch_compile"):
        if ours is None or theirs not in sides:
            continue
        a, b = ours.get("attention_ms_per_iter"), sides[theirs].get("attention_ms_per_iter")
        backends = "ours {}, theirs {}".format(
            *(", ".join(side.get("attention_backend") or ["unknown"])
              for side in (ours, sides[theirs])))
        key = f"purine_attention_vs_{theirs}"
        if a and b:
            out[key] = round(a / b, 3)
            out[key + "_note"] = f"SDPA kernels' time, ours over theirs; backends: {backends}"
        else:
            missing = [f"{name}'s: {side.get('attention_note')}" for name, side, v in
                       (("ours", ours, a), ("theirs", sides[theirs], b)) if not v]
            out[key] = None
            out[key + "_note"] = (f"not compared (backends: {backends}): no SDPA kernel time, "
                                  + "; ".join(missing))
    return out


def attention_fields(events, steps, what, kernels=True, work=None):
    """A side's attention fields from the CUPTI trace of ``steps`` of
    ``what`` (``attention_work``, or ``work``, its figures): with
    ``kernels`` the SDPA kernels' (``attention_ms_per_iter``,
    ``attention_kernels``, ``attention_note``), and the rest of the
    attention's GPU work (``attention_other*``)."""
    work = work or attention_work(events, steps)
    out = {}
    if kernels:
        backend = sdpa_backend(events, [row[0] for row in work["kernels"]])
        ran = f"; SDPA backend: {', '.join(backend)}" if backend else ""
        if work["kernels"]:
            note = (f"torch.profiler (CUPTI) around {steps} of {what}: the SDPA kernels "
                    f"(names matching /{ATTENTION_KERNELS}/i), their durations summed; "
                    f"what issue 45's target is judged on{ran}")
        elif backend and "math" in backend:
            note = ("not measured: PyTorch ran SDPA's math backend "
                    "(aten::_scaled_dot_product_attention_math: GEMMs and a softmax, no SDPA "
                    "kernel), not comparable with an SDPA kernel's time")
        else:
            note = f"not measured: no kernel named like an SDPA kernel in the profile{ran}"
        out.update(attention_ms_per_iter=work["kernel_ms_per_iter"] if work["kernels"] else None,
                   attention_kernels=work["kernels"] or None, attention_backend=backend,
                   attention_note=note)
    if work["other"] is None:
        out.update(attention_other_ms_per_iter=None, attention_other=None,
                   attention_other_launches_per_iter=None, attention_other_note=(
                       f"not measured: no SDPA kernel of {steps} of {what} was launched "
                       "inside an attention's host range, so nothing is attributed to them"))
    else:
        out.update(attention_other_ms_per_iter=work["other_ms_per_iter"],
                   attention_other=work["other"],
                   attention_other_launches_per_iter=work["other_launches_per_iter"],
                   attention_other_note=(
                       f"torch.profiler (CUPTI, host ranges of every thread) around {steps} "
                       f"of {what}: the GPU work (kernels, memsets, copies) other than the "
                       f"SDPA kernels that the CUDA calls inside the attention's host ranges "
                       f"(/{ATTENTION_RANGES}/) launched, their durations summed"))
    return out


#: rows of the op tables (by type, by op) before "other"
TOP_OPS = 15


def split_overlaps(spans):
    """Each (start, end) span's share of the time: every stretch of time
    split evenly among the spans open over it (ops on several streams or
    threads at once), so the shares add up to the spans' union."""
    edges = sorted((t, kind, i) for i, (s, e) in enumerate(spans) if e > s
                   for t, kind in ((s, 1), (e, 0)))   # at one instant: ends first
    out, active, prev = [0.0] * len(spans), set(), None
    for t, kind, i in edges:
        if active and t > prev:
            part = (t - prev) / len(active)
            for j in active:
                out[j] += part
        prev = t
        if kind:
            active.add(i)
        else:
            active.discard(i)
    return out


def op_breakdown(events, window, steps, top=TOP_OPS):
    """Where our step's time goes, from our trace (Chrome events, µs): each
    op's span cut to ``window`` (the ``steps`` profiled steps, µs) and its
    overlaps with other ops' split evenly (``split_overlaps``), summed by op
    type and by op: ``ms_per_iter`` (these add up to ``busy_ms_per_iter``,
    the time some op ran, never more than ``step_ms``), ``span_ms_per_iter``
    (the spans whole, as ``attention_ms_per_iter`` counts them),
    ``count_per_iter``, ``share`` (of ``step_ms``, the steps' wall time
    each); the ``top`` longest, then ``other``. ``idle_ms_per_iter``: no op
    running (the host between launches, waits)."""
    w0, w1 = window
    ops = [e for e in events if e.get("ph") == "X" and w0 <= float(e["ts"]) <= w1]
    spans = [(float(e["ts"]), min(float(e["ts"]) + float(e["dur"]), w1)) for e in ops]
    shares = split_overlaps(spans)
    step_ms = (w1 - w0) / 1e3 / steps

    def ms(us):
        return round(us / 1e3 / steps, 4)

    def rows(key, extra):
        totals = {}
        for e, part, (s, t) in zip(ops, shares, spans):
            row = totals.setdefault(key(e), [0.0, 0.0, 0, set()])
            row[0] += part
            row[1] += t - s
            row[2] += 1
            row[3].add(_place(e))
        ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])
        out = [{**extra(k), "ms_per_iter": ms(v[0]), "span_ms_per_iter": ms(v[1]),
                "count_per_iter": round(v[2] / steps, 2), "share": round(v[0] / 1e3 / steps
                                                                          / step_ms, 4),
                "on": sorted(v[3])} for k, v in ranked[:top]]
        rest = ranked[top:]
        if rest:
            us = sum(v[0] for _, v in rest)
            out.append({**extra("other"), "ms_per_iter": ms(us),
                        "span_ms_per_iter": ms(sum(v[1] for _, v in rest)),
                        "count_per_iter": round(sum(v[2] for _, v in rest) / steps, 2),
                        "share": round(us / 1e3 / steps / step_ms, 4),
                        "on": sorted(set().union(*(v[3] for _, v in rest))), "rows": len(rest)})
        return out

    busy = sum(shares)
    types = {e["name"]: e.get("args", {}).get("op_type") for e in ops}
    return {"steps": steps, "step_ms": round(step_ms, 4), "busy_ms_per_iter": ms(busy),
            "idle_ms_per_iter": round(step_ms - busy / 1e3 / steps, 4),
            "ops_per_iter": round(len(ops) / steps, 2),
            "by_type": rows(lambda e: e.get("args", {}).get("op_type", "?"),
                            lambda k: {"op_type": k}),
            "by_op": rows(lambda e: e["name"],
                          lambda k: {"name": k, "op_type": types.get(k)})}


def _place(event):
    """Where a traced op ran: gpu (a CUDA stream), comm or host."""
    tid = str(event.get("tid", ""))
    return "gpu" if tid.startswith("gpu") else "comm" if tid == "comm" else "host"


def purine_kernels(config, args, iter_ms):
    """The CUDA kernels of ``--profile-iters`` of our CUDA-graph steps, by
    CUPTI (gpu_throughput.kernel_stats), against ``iter_ms`` (the timed
    steps' median): (the table of ``kernel_table``, None), and the SDPA
    kernels' fields (``attention_fields``: the attention's time per step);
    (None, why) and {} where not measured."""
    from gpu_throughput import kernel_stats

    def measure(trainer, step, steps):
        def last_drained(i):
            step(i)
            if i == steps - 1:
                trainer.train.drain()
        return kernel_stats(last_drained, steps, match=ATTENTION_KERNELS), steps
    stats, steps = purine_steps(config, args, None, measure)
    if not stats:
        return (None, "not measured: torch.profiler saw no CUDA device"), {}
    what = "our CUDA-graph steps (as train runs them)"
    table = stats.get("matched_table") or []
    fields = attention_fields(None, steps, what, work={
        "kernel_ms_per_iter": round(sum(row[1] for row in table), 4), "kernels": table,
        "other": None})
    for key in [k for k in fields if k.startswith("attention_other")]:
        del fields[key]   # one replay a step: no host range; the eager trace's, ours
    return (kernel_table(stats, steps, iter_ms, what), None), fields


#: the fields each profile fills, by the group whose ``<group>_note`` says
#: where they come from or why they are null
PROFILE_FIELDS = {
    "attention": ("attention_ms_per_iter", "attention_kernels", "attention_backend"),
    "attention_other": ("attention_other_ms_per_iter", "attention_other",
                        "attention_other_launches_per_iter"),
    "attention_span": ("attention_span_ms_per_iter",),
    "op_breakdown": ("op_breakdown",), "kernels": ("kernels",)}
#: which groups each (side, profile) fills: ours, a PyTorch side
PROFILE_GROUPS = {("purine", "trace"): ("attention_span", "attention_other", "op_breakdown"),
                  ("purine", "kernels"): ("attention", "kernels"),
                  ("torch", "kernels"): ("attention", "attention_other", "kernels")}


def profile_side(side, job, config, args, iter_ms, torch_side):
    """One profile of a side, {field: value} with each group's
    ``<group>_note`` (PROFILE_GROUPS): our eager trace ("trace": the
    attention's spans, its other GPU work, the op table), a side's kernels
    ("kernels": the SDPA kernels' time, the kernel table)."""
    if side != "purine":
        return torch_side.profile(args.profile_iters, iter_ms)
    if job == "kernels":
        (table, why), fields = purine_kernels(config, args, iter_ms)
        out = {"kernels": table, "kernels_note": why}
        if not fields:
            out.update({f: None for f in PROFILE_FIELDS["attention"]}, attention_note=why)
        return {**out, **fields}
    events, window, steps, cupti = purine_trace(config, args)
    where = "GPU (CUDA events)" if args.device >= 0 else "host (the CPU dry run)"
    span, span_note = purine_attention(events, steps, args.device >= 0)
    if cupti is None:
        why = "not measured: torch.profiler saw no CUDA device"
        other = {f: None for f in PROFILE_FIELDS["attention_other"]}
        other["attention_other_note"] = why
    else:
        other = attention_fields(cupti, steps, "our eager steps (stream dispatch, after the "
                                 "traced ones)", kernels=False)
    return {**other, "attention_span_ms_per_iter": span, "attention_span_note": span_note,
            "op_breakdown": op_breakdown(events, window, steps), "op_breakdown_note": (
                f"our trace: every op's span, timed on the {where}, eager dispatch, {steps} "
                "step(s); ms_per_iter splits overlapping spans evenly (they add up to "
                "busy_ms_per_iter), share: of step_ms, these steps' wall time")}


def kernel_table(stats, steps, iter_ms, what):
    """kernel_stats' figures of ``steps`` steps as a side's ``kernels``:
    ``kernel_ms_per_iter`` (the union of the kernels' intervals) against
    ``iter_ms`` (``gpu_busy``), ``top_kernels`` ([name, ms, launches] per
    step, the longest first)."""
    return {"source": f"torch.profiler (CUPTI) around {steps} of {what}",
            "kernels_per_iter": stats["kernels_per_iter"],
            "kernel_ms_per_iter": stats["kernel_ms_per_iter"], "iter_ms": iter_ms,
            "gpu_busy": round(stats["kernel_ms_per_iter"] / iter_ms, 4) if iter_ms else None,
            "top_kernels": stats["top_kernels"]}


def _free_cupy():
    try:
        from purine_mpi.base.backend import cupy_available
        if cupy_available():
            import cupy
            gc.collect()   # a closed trainer's cycles: their arrays back to the pool
            cupy.get_default_memory_pool().free_all_blocks()
    except ImportError:
        pass


# -------------------------------------------------------------- PyTorch ---

class TorchSide:
    """nanoGPT's model and fused AdamW on ``dev``, bf16 autocast; built once,
    stepped in every round (``compiled``: under torch.compile)."""

    def __init__(self, torch, config, dev, micro_batches, batch, compiled, precision):
        import gpt_torch
        self.torch, self.dev, self.config = torch, dev, config
        self.solver = config["solver"]
        before = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        torch.manual_seed(int(config.get("seed", 0)))
        self.model = gpt_torch.torch_gpt(config).to(dev).train()
        self.opt = gpt_torch.adamw(self.model, self.solver, fused=dev.type == "cuda")
        self.forward = torch.compile(self.model) if compiled else self.model
        d, seq = gpt_torch.dims(config), config["data"]["train"]["sequence_length"]
        gen = torch.Generator().manual_seed(0)
        w = torch.randint(0, min(256, d["vocab"]), (micro_batches, batch, seq + 1), generator=gen)
        self.x, self.y = w[..., :-1].to(dev), w[..., 1:].to(dev)
        self.dtype = torch.bfloat16 if precision == "bf16" else None   # the dry run: fp32
        self.held_before, self.it = before, 0

    def step(self):
        torch = self.torch
        for group in self.opt.param_groups:
            group["lr"] = __import__("gpt_torch").lr_at(self.solver, self.it)
        self.it += 1
        m = self.x.shape[0]
        for i in range(m):
            ctx = torch.autocast(self.dev.type, dtype=self.dtype) if self.dtype else \
                contextlib.nullcontext()
            with ctx:
                loss = self.forward(self.x[i], self.y[i]) / m
            loss.backward()
        if self.solver.get("clip_gradients"):
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.solver["clip_gradients"])
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss

    def sync(self):
        if self.dev.type == "cuda":
            self.torch.cuda.synchronize(self.dev)

    def run(self, iters, warmup):
        """Steps timed as bench times ours: each to its end, the median."""
        for _ in range(warmup):
            self.step()
        self.sync()
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            loss = self.step()
            self.sync()
            times.append(time.perf_counter() - t0)
        med = statistics.median(times)
        x = self.x
        return {"tokens_per_s": round(x.shape[0] * x.shape[1] * x.shape[2] / med, 1),
                "iter_ms_median": round(1e3 * med, 3), "last_loss": float(loss.detach()) * x.shape[0]}

    def peak_memory(self):
        """The side's own peak: max_memory_allocated since its set-up, less what was held then."""
        if self.dev.type != "cuda":
            return None
        return int(self.torch.cuda.max_memory_allocated(self.dev) - self.held_before)

    def profile(self, steps, iter_ms):
        """torch.profiler's kernels over ``steps`` steps, the host's ranges
        too: {field: value} of its groups (PROFILE_GROUPS: the SDPA kernels'
        time, the attention's other GPU work, the kernel table) with their
        notes; None and why where not measured."""
        groups = PROFILE_GROUPS[("torch", "kernels")]
        if self.dev.type != "cuda":
            return not_measured(groups, "not measured: torch.profiler's CUDA kernels need "
                                "a GPU")
        from gpu_throughput import kernel_stats
        events = []
        stats = kernel_stats(lambda i: self.step(), steps, events=events)
        if not stats:
            return not_measured(groups, "not measured: torch.profiler saw no CUDA device")
        return {"kernels": kernel_table(stats, steps, iter_ms, "its steps"),
                "kernels_note": None, **attention_fields(events, steps, "its steps")}


def not_measured(groups, why):
    """Every field of ``groups`` (PROFILE_FIELDS) null, each group's note ``why``."""
    out = {}
    for group in groups:
        out.update({f: None for f in PROFILE_FIELDS[group]}, **{f"{group}_note": why})
    return out


# ------------------------------------------------------------------ main ---

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=os.path.join(REPO, "jobs", "gpt2_124m.yaml"))
    ap.add_argument("--batch", type=int, default=None,
                    help="sequences per micro-batch (default 16, nanoGPT's; 2 with --dry-run)")
    ap.add_argument("--micro-batches", type=int, default=1)
    ap.add_argument("--recompute-layers", default="",
                    help="ours: recompute: full on these layers (in each micro-batch), e.g. "
                    "'h*_ln1,h*_ln2,h*_gelu' (the layer norms' and GELU's outputs computed "
                    "again from their kept inputs before the weight gradients read them, as "
                    "torch.compile's partitioner recomputes pointwise ops; bitwise the same; "
                    "plan: 15.8 -> 12.4 GiB); default '': none, the job as written")
    ap.add_argument("--seq", type=int, default=None,
                    help="tokens per sequence (default: the job's; 32 with --dry-run)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds of every side")
    ap.add_argument("--sides", nargs="+", choices=SIDES, default=list(DEFAULT_SIDES))
    ap.add_argument("--no-compile", action="store_true", help="drop torch_compile")
    ap.add_argument("--profile-iters", type=int, default=3,
                    help="steps profiled for the attention's time, our op table and the "
                    "kernel tables (0: not measured)")
    ap.add_argument("--deadline-s", type=float, default=None,
                    help="the seconds the run may take at most (a stage's timeout): a profile "
                    "of ours begins only where a round of ours fits before it, less 5 s")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="skip the rounds after the first once this many seconds have passed")
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU smoke run at a tiny size (one step of each side but torch.compile)")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    import signal
    signal.signal(signal.SIGTERM, _terminated)
    sides = [s for s in args.sides if not (s == "torch_compile" and
                                           (args.no_compile or args.dry_run))]
    if not args.dry_run:   # refused before torch's seconds-long import
        from purine_mpi.base.backend import cupy_available
        if not cupy_available():
            fail("needs CuPy and a CUDA device (purine_mpi[gpu]); none found, so there is "
                 "nothing to measure (--dry-run: the CPU smoke run)")
    import torch
    if args.dry_run:
        args.batch, args.seq = args.batch or 2, args.seq or 32
        args.iters, args.warmup, args.rounds, args.device = 1, 1, 1, -1
        args.profile_iters = min(args.profile_iters, 1)
        dev, precision, device_name = torch.device("cpu"), "fp32", "cpu (dry run: no figures)"
    else:
        args.batch = args.batch or 16
        if not torch.cuda.is_available():
            fail(f"torch {torch.__version__} sees no CUDA device (a CPU-only build?)")
        dev, precision = torch.device("cuda", args.device), "bf16"
        device_name = torch.cuda.get_device_name(dev)
    if min(args.iters, args.warmup, args.rounds, args.batch, args.micro_batches) < 1:
        fail("--iters, --warmup, --rounds, --batch and --micro-batches must be >= 1")
    from purine_mpi.tools.flops import device_peak
    with tempfile.TemporaryDirectory(prefix="gpt_gpu_") as tmp:
        config = load(args, token_file(tmp), args.device, precision)
        per_token, closed_form = flops_per_token(config)
        peak, peak_source = device_peak(None if args.dry_run else device_name, "bf16")
        if args.dry_run:
            peak, peak_source = None, "dry run on the CPU: no peak, mfu is null"
        torch_sides, rounds = {}, {s: [] for s in sides}
        cut_short, round_s = None, 0.0   # round_s: the longest round of ours, seconds
        try:
            for r in range(args.rounds):
                if r and args.budget_s is not None and \
                        time.perf_counter() - t_start > args.budget_s:
                    cut_short = "budget"
                    break
                for side in sides:
                    print(f"gpt_gpu: round {r + 1}, {side}", file=sys.stderr, flush=True)
                    if side in OURS:
                        t_round = time.perf_counter()
                        with environment(OURS[side]):
                            rounds[side].append(run_purine(config, args))
                        round_s = max(round_s, time.perf_counter() - t_round)
                        continue
                    if side not in torch_sides:
                        torch_sides[side] = TorchSide(torch, config, dev, args.micro_batches,
                                                      args.batch, side == "torch_compile",
                                                      precision)
                    res = torch_sides[side].run(args.iters, args.warmup)
                    if r == 0:
                        res["peak_memory_bytes"] = torch_sides[side].peak_memory()
                    rounds[side].append(res)
        except Terminated:
            cut_short = "terminated"
        out_sides = {}
        for side in [s for s in sides if rounds[s]]:
            runs = rounds[side]
            tps = [r["tokens_per_s"] for r in runs]
            med = statistics.median(tps)
            entry = {"tokens_per_s": round(med, 1), "tokens_per_s_rounds": tps,
                     "iter_ms_median": statistics.median(r["iter_ms_median"] for r in runs),
                     "model_flops_per_token": per_token,
                     "achieved_flops_per_s": round(per_token * med, 1),
                     "mfu": None if not peak else round(per_token * med / peak, 4),
                     "peak_memory_bytes": runs[0].get("peak_memory_bytes"),
                     "peak_memory_source": runs[0].get(
                         "peak_memory_source", "torch.cuda.max_memory_allocated over the "
                         "side's set-up and steps, less what was held before it"),
                     **not_measured(PROFILE_FIELDS, None)}
            if side in OURS:
                entry["cuda_graph"] = runs[0]["cuda_graph"]
                entry["bench_mfu"] = runs[0]["bench_mfu"]
                entry["environment"] = OURS[side]
                # round 1's (the peak's round): what this side holds, made and left
                entry["device_memory"] = runs[0].get("device_memory")
                if side != "purine":
                    entry.update(not_measured(PROFILE_FIELDS, "not profiled: this side of "
                                              "ours is timed only"))
            else:
                entry["last_loss"] = runs[-1]["last_loss"]
                entry.update(not_measured(["attention_span", "op_breakdown"], (
                    "ours only: our trace's op spans (PyTorch's attention: its kernels, "
                    "attention_ms_per_iter)")))
            out_sides[side] = entry
        # the profiles, after the timed rounds (profiling slows what it watches),
        # what we know least first: our eager trace (the attention, the op table),
        # our CUDA-graph steps' kernels (a trainer of their own), PyTorch's kernels
        jobs = [("purine", "trace"), ("purine", "kernels")] if "purine" in out_sides else []
        jobs += [(side, "kernels") for side in out_sides if side not in OURS]
        skipped = False
        for side, job in jobs:
            entry = out_sides[side]
            groups = PROFILE_GROUPS[(side if side == "purine" else "torch", job)]
            if not cut_short and args.budget_s is not None and \
                    time.perf_counter() - t_start > args.budget_s:
                cut_short = "budget"
            why = None
            if not args.profile_iters:
                why = "not measured (--profile-iters 0)"
            elif cut_short:
                why = f"not measured: the run was cut short ({cut_short})"
            elif side == "purine" and job == "kernels" and args.dry_run:
                why = "not measured: CUPTI's kernel profile needs a CUDA device (a CPU dry run)"
            elif side == "purine" and args.deadline_s is not None and \
                    time.perf_counter() - t_start + round_s > args.deadline_s - 5:
                # a trainer of ours more, about a round's time: not begun where the
                # stage's timeout would end it (and the run, in its trainer's close)
                why = (f"not measured: a profile of ours takes about a round of ours "
                       f"({round_s:.0f} s), past --deadline-s")
                skipped = True
            if why is None:
                try:
                    found = profile_side(side, job, config, args, entry["iter_ms_median"],
                                         torch_sides.get(side))
                except Terminated:
                    cut_short, why = "terminated", "not measured: terminated"
                except Exception as exc:  # a profile that fails is reported, not fatal
                    why = f"not measured: {type(exc).__name__}: {exc}".splitlines()[0]
            if why is not None:
                found = not_measured(groups, why)
            entry.update(found)
        cut_short = cut_short or ("budget" if skipped else None)
    spec = config["data"]["train"]
    report = {"benchmark": "gpt_gpu", "dry_run": bool(args.dry_run), "device": device_name,
              "config": os.path.relpath(os.path.abspath(args.config), REPO),
              "precision": precision, "batch": args.batch, "micro_batches": args.micro_batches,
              "sequence_length": spec["sequence_length"],
              "recompute_layers": config.get("recompute_layers") if
              config.get("recompute", "none") != "none" else None,
              "tokens_per_step": args.batch * args.micro_batches * spec["sequence_length"],
              "iters": args.iters, "warmup": args.warmup, "rounds": args.rounds,
              "cut_short": cut_short, "model_flops_per_token": per_token,
              "closed_form": closed_form, "peak_flops_per_s": peak, "peak_source": peak_source,
              "versions": _versions(torch), "sides": out_sides}
    if "purine" in out_sides and "purine_fc_cublaslt" in out_sides and \
            out_sides["purine"]["tokens_per_s"]:
        report["purine_fc_cublaslt_vs_purine"] = round(
            out_sides["purine_fc_cublaslt"]["tokens_per_s"] / out_sides["purine"]["tokens_per_s"],
            3)
    for theirs in ("torch_eager", "torch_compile"):
        if "purine" in out_sides and theirs in out_sides and out_sides[theirs]["tokens_per_s"]:
            report[f"purine_vs_{theirs}"] = round(
                out_sides["purine"]["tokens_per_s"] / out_sides[theirs]["tokens_per_s"], 3)
    # issue 45's attention target: our SDPA kernels' time over theirs (<= 1.10)
    report.update(attention_ratios(out_sides))
    print(json.dumps(report, indent=1))
    torch_sides.clear()
    gc.collect()
    return 0


def _versions(torch):
    out = {"torch": torch.__version__, "numpy": np.__version__}
    try:
        import cupy
        out["cupy"] = cupy.__version__
    except ImportError:
        out["cupy"] = None
    return out


if __name__ == "__main__":
    sys.exit(main())

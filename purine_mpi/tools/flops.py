"""Model FLOPs and MFU for ``bench --json`` (docs/formats.md, "bench --json").

``graph_flops(graph)``: the multiply-add FLOPs (2 per multiply-add) of one
training iteration of a graph's matrix products, read off its ops and
their blob shapes: InnerProduct (fc, the attention's qkv and proj, a tied
lm_head) and its two gradient products, Conv and its two, and attention's
q·kᵀ and P·v (fused or not) and their gradients. Element-wise ops,
softmax, normalisation, embeddings' lookups and the solver are not counted
(as in PaLM's and nanoGPT's MFU); causal attention is counted whole (as
PaLM does: 12·L·H·Q·T per token), and the fused attention gradient's
recomputation of the probabilities is not (model FLOPs, not hardware
FLOPs).

``gpt_closed_form(n_params, layers, width, seq)``: PaLM's 6N + 12·L·H·Q·T
per token (appendix B; nanoGPT's ``estimate_mfu``), N the parameters
without the position embedding (nanoGPT's ``get_num_params(non_embedding=
True)``: the token embedding stays, it is also the lm_head's weight).

``device_peak(...)``: the dense peak FLOP/s MFU divides by, with the words
saying where it came from (``peak_source``); ``occupied(places)``: how
many of it the job occupies (its GPUs, or its ranks' cores).
"""
import os
import re
import socket

#: dense peak FLOP/s per GPU by precision (NVIDIA's H100 SXM and H200
#: datasheets, without sparsity): bf16 and fp16, TF32 tensor cores and plain fp32
GPU_PEAKS = {"H100": {"bf16": 989e12, "fp16": 989e12, "tf32": 495e12, "fp32": 67e12},
             "H200": {"bf16": 989e12, "fp16": 989e12, "tf32": 495e12, "fp32": 67e12}}
#: the cards of those names whose peaks are lower than the SXM figures above
#: (an "NVIDIA H100 PCIe": 756 TFLOP/s dense bf16, not 989): no peak is known
#: for them, rather than the SXM one (an MFU about a third too low)
OTHER_FORMS = ("PCIE", "NVL")


from ..graph.flops import QKV_INPUT, _size, op_flops  # noqa: F401 (re-exported)


def graph_flops(graph):
    """The counted FLOPs of one run of ``graph`` (a training graph: forward,
    backward; every micro-batch copy), the forward once: an activation
    recompute's copy of a forward op (``<op>@recompute``, graph/recompute.py;
    a ``graph:`` config written with recompute holds them) is hardware work,
    not model FLOPs."""
    from ..graph.recompute import SUFFIX

    def shape(b):
        return graph.blobs[b].shape
    return sum(op_flops(op, shape) for op in graph.ops.values() if SUFFIX not in op.name)


def gpt_closed_form(n_params, layers, width, seq):
    """PaLM's training FLOPs per token, 6·N + 12·L·(H·Q)·T, H·Q = the width."""
    return 6 * n_params + 12 * layers * width * seq


def gpt_figures(graph):
    """``(N, L, width, T)`` of a transformer training graph for the closed
    form (N: every parameter but the position embeddings' tables; L: its
    attention ops), or None without attention. Running statistics
    (``learnable: false``) are not counted."""
    attn = [op for op in graph.ops.values() if op.op_type in ("Attention", "AttentionScores")]
    if not attn:
        return None
    qkv = graph.blobs[attn[0].inputs[QKV_INPUT[attn[0].op_type]]].shape
    positional = {b for op in graph.ops.values() if op.op_type == "PositionEmbedding"
                  for b in op.inputs[1:]}
    # running statistics (a batch norm's mean and variance) are state, not
    # parameters: no matrix product reads them
    n = sum(_size(b.shape) for b in graph.params()
            if b.name not in positional and b.attrs.get("learnable", True))
    return n, len(attn), int(qkv[2]) // 3, int(qkv[1])


# --------------------------------------------------------------- the peak
def device_peak(device_name=None, precision="fp32", cpuinfo="/proc/cpuinfo", cores=None):
    """``(peak FLOP/s or None, words naming the figure and where it came
    from)``: a known GPU's datasheet figure for ``precision``, or, without a
    GPU (``device_name`` None), this host's cores' fp32 FMA peak."""
    if device_name is not None:
        form = next((f for f in OTHER_FORMS if f in device_name.upper()), None)
        if form is not None:
            return None, (f"{device_name}: no dense {precision} peak is known for this GPU "
                          f"(known: the SXM forms of {', '.join(GPU_PEAKS)}; a {form} card's "
                          "peak is lower); mfu is null")
        for key, peaks in GPU_PEAKS.items():
            if key in device_name and precision in peaks:
                return peaks[precision], (f"{device_name}: {peaks[precision] / 1e12:g} TFLOP/s "
                                          f"dense {precision} (NVIDIA's {key} datasheet)")
        return None, (f"{device_name}: no dense {precision} peak is known for this GPU "
                      f"(known: {', '.join(GPU_PEAKS)}); mfu is null")
    return cpu_peak(cpuinfo, cores)


def _cpuinfo(path):
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _max_clock_hz():
    """The cores' maximum clock from cpufreq, with its source; (None, why) where none."""
    p = "/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq"
    try:
        with open(p) as f:
            return int(f.read().strip()) * 1e3, p
    except (OSError, ValueError):
        return None, "no cpufreq maximum (/sys/devices/system/cpu/cpu0/cpufreq)"


def cpu_peak(cpuinfo="/proc/cpuinfo", cores=None):
    """fp32 FLOP/s of this process's cores: cores × vector lanes (16 with
    the avx512f flag, 8 with avx and fma, 4 otherwise) × 2 (a fused
    multiply-add) × FMA units per core (2 with AVX2 or AVX-512: Intel since
    Haswell, AMD since Zen 2; 1 otherwise; an assumption, /proc/cpuinfo does
    not say) × the clock (cpufreq's maximum, else /proc/cpuinfo's current
    ``cpu MHz``, said so; none: the peak is null and the words say why)."""
    text = _cpuinfo(cpuinfo)
    flags = set((re.search(r"^flags\s*:(.*)$", text, re.M) or [None, ""])[1].split())
    model = (re.search(r"^model name\s*:\s*(.*)$", text, re.M) or [None, "an unnamed CPU"])[1]
    if "avx512f" in flags:
        lanes, units, isa = 16, 2, "AVX-512"
    elif {"avx2", "fma"} <= flags or {"avx", "fma"} <= flags:
        lanes, units, isa = 8, 2, "AVX2/FMA"
    else:
        lanes, units, isa = 4, 1, "SSE (no FMA flag: a multiply-add counted as one unit)"
    if cores is None:
        cores = _physical_cores(text)
    clock, source = _max_clock_hz()
    if clock is None:
        mhz = re.search(r"^cpu MHz\s*:\s*([\d.]+)", text, re.M)
        if mhz:
            clock = float(mhz.group(1)) * 1e6
            source = f"/proc/cpuinfo's current 'cpu MHz' ({source}; turbo not counted)"
    what = (f"{model}: {cores} core(s) x {lanes} fp32 lanes ({isa}, /proc/cpuinfo flags) x 2 "
            f"(FMA) x {units} FMA unit(s) per core (assumed for the ISA)")
    if clock is None:
        return None, what + f" x clock: unknown ({source}); mfu is null"
    peak = cores * lanes * 2 * units * clock
    return peak, what + f" x {clock / 1e9:.2f} GHz ({source}) = {peak / 1e9:,.1f} GFLOP/s fp32"


def _physical_cores(text):
    """The physical cores among the CPUs this process may run on (hyper-threads
    share a core's FMA units)."""
    return len(physical_core_ids(text))


def _allowed_cpus():
    try:
        return os.sched_getaffinity(0)
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))


def physical_core_ids(text=None):
    """The (physical id, core id) pairs of the CPUs this process may run on
    (/proc/cpuinfo; ``text`` its contents), sorted; where it names none,
    one per CPU the process may run on."""
    text = _cpuinfo("/proc/cpuinfo") if text is None else text
    allowed = _allowed_cpus()
    cores = set()
    for block in text.split("\n\n"):
        proc = re.search(r"^processor\s*:\s*(\d+)", block, re.M)
        core = re.search(r"^core id\s*:\s*(\d+)", block, re.M)
        pkg = re.search(r"^physical id\s*:\s*(\d+)", block, re.M)
        if proc and int(proc.group(1)) in allowed:
            cores.add((pkg.group(1) if pkg else "0", core.group(1) if core else proc.group(1)))
    # no processor blocks (/proc/cpuinfo unread, or without them): a core per allowed CPU
    return sorted(cores or {("cpu", str(c)) for c in _allowed_cpus()})


def rank_place(device):
    """This rank's ``(host, device, cores)`` for ``occupied`` (device -1: the CPU)."""
    return socket.gethostname(), int(device), physical_core_ids()


def occupied(places):
    """What a job's ranks occupy, from each rank's ``(host, device, cores)``
    (device -1: the CPU; ``cores``: its ``physical_core_ids()``): ``("gpu",
    n)`` with the distinct (host, GPU) pairs the ranks run on where any runs
    on a GPU (ranks on the CPU beside them -- parameter servers -- hold no
    GPU and are not counted, as a GPU job's host cores are not), else
    ``("cpu", n)`` with the distinct (host, physical core) pairs of every
    rank's core set (ranks bound to cores hold theirs, unbound ones the
    host's: a core two ranks share counts once)."""
    gpus = {(h, d) for h, d, _ in places if d >= 0}
    if gpus:
        return "gpu", len(gpus)
    return "cpu", len({(h, c) for h, d, cores in places for c in map(tuple, cores)})


def mfu_fields(flops_per_sample, samples_per_s, peak, peak_source, precision, devices=1):
    """The FLOPs/MFU fields of ``bench --json``: achieved FLOP/s = flops per
    sample × samples/s; mfu = achieved / (peak × devices): ``peak`` one
    GPU's and ``devices`` the GPUs the job occupies, or ``peak`` the CPU
    cores' the job occupies (already every core's: ``devices`` 1)."""
    achieved = flops_per_sample * samples_per_s
    total_peak = None if peak is None else peak * devices
    return {"model_flops_per_iter_sample": flops_per_sample,
            "achieved_flops_per_s": round(achieved, 1),
            "peak_flops_per_s": total_peak,
            "peak_source": peak_source,
            "precision": precision,
            "mfu": None if not total_peak else round(achieved / total_peak, 6)}

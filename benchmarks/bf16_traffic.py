"""The memory traffic and GEMM FLOPs of one training iteration of a GPT job,
counted offline from its placed device graph: a PHYSICS bound on the step
time, not a measurement (docs/gpu.md, "Precision": *An offline bound*).

The graph is the one ``train`` runs on GPU 0 (``tools/plan._offline_graphs``
of the job with ``--set device=0``, on the emulated device of tests/emulated_gpu
as benchmarks/device_plan.py sets it up), built three times in one run:
``precision=fp32``; ``precision=bf16`` with ``PURINE_BF16_STORAGE=0``
(bf16 values in float32 storage); ``precision=bf16`` with bf16 storage
(the default: parallel/precision.store_bits, fold_casts, loss_from_logits).

For every op of the training graph (each runs once an iteration) the bytes
its input and output blobs occupy, each element read once and written once
(``io``: the least a memory-bound kernel can move; an in-place output counts
as written), and, for the low-precision products, the conversions their
kernels make on top of that (``conversions``; ops/fc.py, gpu/sdpa.py):

- a product's operand of bfloat16 values in float32 storage: its bits
  written to scratch and read by GemmEx / cuDNN's SDPA (2 + 2 bytes an
  element; the float32 read is in ``io``); the fully connected bias (input
  2) is read as float32 and not converted;
- a fully connected product's output of bfloat16 values in float32 storage:
  one rounding in place (``round_bf16``: 4 + 4 bytes); its output stored as
  bits with a bias: GemmEx's float32 result in scratch, read by
  ``bias_bits`` (4 + 4 bytes) -- or, with ``PURINE_FC_EPILOGUE=cublaslt``
  (``--fc-epilogue``), one cuBLASLt product writing the bits itself, its
  bias's bf16 bits written to scratch and read by the epilogue (2 + 2 bytes
  a bias element; the float32 bias's read is in ``io``);
- an attention op's output of 16-bit values in float32 storage: SDPA's
  16-bit result widened (2 + 2 bytes).

The ops in classes: ``products`` (GEMMs, convolutions, attention: bounded
by their FLOPs at the dense peak), ``elementwise`` (normalisation, GELU,
residual adds, bias and gradient sums, embeddings, the loss, clipping, the
optimizer: bounded by their bytes at the HBM bandwidth) and ``casts``
(``Cast`` ops and the products' conversions above: bytes too). The FLOPs
are graph/flops.py's (``tools/flops.graph_flops``: attention counted whole,
PaLM's model FLOPs), compared with PaLM's 6N + 12·L·H·Q·T per token.

Two bounds of the step time (``bounds``):

- ``serial``: the sum over the ops of each op's roofline, max(FLOPs / peak,
  bytes / bandwidth): every op its own kernel, none running beside
  another (our step: a CUDA graph of one kernel chain per op; the memory-
  bound kernels read the products' outputs and feed the next products);
- ``overlapped``: max(all FLOPs / peak, all bytes / bandwidth): the floor of
  any schedule of the same bytes and FLOPs, kernels overlapping perfectly.

    PYTHONPATH=. python benchmarks/bf16_traffic.py --job jobs/gpt2_124m.yaml \\
        --set data.train.batch_size=16 --set parallel.micro_batches=1 \\
        --set data.train.path=DATA.h5 --set data.test.path=DATA.h5

``--fc-epilogue both`` (the default where ``PURINE_FC_EPILOGUE=cublaslt``
is set) adds a fourth configuration, ``bf16_bits_storage_fc_cublaslt``:
the bf16-storage graph counted under that opt-in (docs/gpu.md,
"Precision"); ``--fc-epilogue kernel`` (else the default) the three.

(``DATA.h5``: any token file of the job's vocabulary, e.g. a byte-token one,
``python -m purine_mpi data text --from DIR --glob '*.py' --out DATA.h5``;
the script adds ``--set device=0`` and each configuration's ``precision``.)
Prints one JSON object. Not counted: the kernels' own reads beyond once
(layer norm's two passes, the loss's second read of the logits, cuBLAS's
tiles), the attention fallback's T×T matrices (a GPU runs cuDNN's SDPA),
host work, launch gaps: real kernels move at least these bytes.
"""
import argparse
import collections
import contextlib
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _p in (ROOT, HERE):
    if _p not in sys.path:
        sys.path.insert(0, _p)

#: H200 SXM: HBM3e bandwidth (NVIDIA's datasheet), bytes/s
HBM_DATASHEET = 4.8e12
#: the best streaming rate measured on our H200 (docs/gpu.md, "Measuring bf16
#: GPT speed": ``round_bf16`` in place on a (16384, 3072) float32 array, 402 MB
#: in 111 us; ``to_bf16_bits`` 3.3 TB/s, the tiled column sums 3.4 TB/s read)
HBM_MEASURED = 3.6e12
MEASURED_SOURCE = ("docs/gpu.md: round_bf16 in place on a (16384, 3072) float32 array on the "
                   "H200, 402 MB in 111 us (cupyx.profiler.benchmark)")
#: the configurations: (name, precision, PURINE_BF16_STORAGE)
CONFIGS = (("fp32", "fp32", None), ("bf16_float32_storage", "bf16", "0"),
           ("bf16_bits_storage", "bf16", "1"))
CLASSES = ("products", "elementwise", "casts")
BOUNDS_NOTE = ("serial_ms: the sum over the ops of max(FLOPs / peak, bytes / bandwidth), each op a "
               "kernel of its own, none beside another (the bound for our step, whose "
               "memory-bound kernels sit between the products that write and read their "
               "blobs); sum_ms: all FLOPs at the peak plus the non-product bytes at the "
               "bandwidth; overlapped_ms: max(all FLOPs / peak, all bytes / bandwidth), the "
               "floor of any schedule of these kernels. Offline bounds, not measurements.")


@contextlib.contextmanager
def storage_env(value):
    """``PURINE_BF16_STORAGE`` set to ``value`` (None: unset) for the block."""
    old = os.environ.get("PURINE_BF16_STORAGE")
    if value is None:
        os.environ.pop("PURINE_BF16_STORAGE", None)
    else:
        os.environ["PURINE_BF16_STORAGE"] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("PURINE_BF16_STORAGE", None)
        else:
            os.environ["PURINE_BF16_STORAGE"] = old


def job_graph(job_path, sets, precision, storage):
    """The training graph of rank 0 of ``job_path`` (with ``sets``) placed
    on GPU 0 in ``precision``, ``PURINE_BF16_STORAGE=storage`` (None: the
    default), as ``plan`` builds it (needs the emulated device set up, or a
    GPU)."""
    from purine_mpi.job.config import load_config
    from purine_mpi.tools.plan import _offline_graphs
    from tests.conftest import make_job
    overrides = list(sets) + ["device=0", f"precision={precision}"]
    with storage_env(storage):
        job = make_job(load_config(job_path, overrides=overrides, check_files=False))
        return _offline_graphs(job, 1, 0).graph


def op_class(op):
    from purine_mpi.parallel.precision import CAST, LOW_OP_TYPES
    if op.op_type in LOW_OP_TYPES:
        return "products"
    return "casts" if op.op_type == CAST else "elementwise"


def _low(blob):
    """Whether ``blob`` holds 16-bit values in float32 storage."""
    from purine_mpi.parallel.precision import blob_dtype
    return blob.dtype == "float32" and blob_dtype(blob) in ("bfloat16", "float16")


def op_bytes(graph, op, fc_epilogue="kernel"):
    """(io, conversions): the bytes of ``op``'s inputs and outputs, each
    element once, and those of the conversions its low-precision product
    kernel makes beyond them (module docstring), with ``fc_epilogue`` the
    value of ``PURINE_FC_EPILOGUE``."""
    from purine_mpi.base.precision import is_bits
    from purine_mpi.graph.core import op_precision
    blobs = graph.blobs
    io = sum(blobs[b].nbytes for b in op.inputs) + sum(blobs[b].nbytes for b in op.outputs)
    conv = 0
    if op_class(op) == "products" and op_precision(op) in ("bfloat16", "float16"):
        fc = op.op_type.startswith("InnerProduct")
        for i, b in enumerate(op.inputs):
            if _low(blobs[b]) and not (fc and i == 2):   # an operand narrowed to 16 bits
                conv += 4 * blobs[b].size
        for b in op.outputs:
            blob = blobs[b]
            if _low(blob) and not op.accumulate:
                conv += (8 if fc else 4) * blob.size   # rounded in place / widened
            elif fc and is_bits(blob.dtype) and len(op.inputs) > 2:
                if fc_epilogue == "cublaslt":          # the bias's bits, one product
                    conv += 4 * blobs[op.inputs[2]].size
                else:
                    conv += 8 * blob.size              # float32 product + bias_bits
    return io, conv


def traffic(graph, fc_epilogue="kernel"):
    """The iteration's figures of ``graph``: per op (name -> [type, class,
    io bytes, conversion bytes, FLOPs])."""
    from purine_mpi.tools.flops import op_flops

    def shape(b):
        return graph.blobs[b].shape
    rows = {}
    for op in graph.ops.values():
        io, conv = op_bytes(graph, op, fc_epilogue)
        rows[op.name] = [op.op_type, op_class(op), io, conv, op_flops(op, shape)]
    return rows


def summary(graph, peak, bandwidths, fc_epilogue="kernel"):
    """The JSON figures of one configuration: bytes per class and op type,
    their time at each bandwidth, the FLOPs and the bounds."""
    from purine_mpi.tools.flops import gpt_closed_form, gpt_figures, graph_flops
    rows = traffic(graph, fc_epilogue)
    by_class = collections.defaultdict(lambda: [0, 0])      # bytes, ops
    by_type = collections.defaultdict(lambda: [0, 0, None])  # bytes, ops, class
    flops = 0
    serial = {k: 0.0 for k in bandwidths}
    for typ, cls, io, conv, fl in rows.values():
        flops += fl
        by_class[cls][0] += io
        by_class[cls][1] += 1
        by_type[typ][0] += io
        by_type[typ][1] += 1
        by_type[typ][2] = cls
        if conv:
            by_class["casts"][0] += conv
            key = f"{typ} (conversions in the product)"
            by_type[key][0] += conv
            by_type[key][1] += 1
            by_type[key][2] = "casts"
        for k, bw in bandwidths.items():
            # a product: its roofline over its own io; its conversions are
            # separate element-wise passes
            serial[k] += max(fl / peak, io / bw) + conv / bw
    assert flops == graph_flops(graph)
    total = sum(v[0] for v in by_class.values())
    memory = total - by_class["products"][0]

    def ms(nbytes):
        return {k: round(nbytes / bw * 1e3, 3) for k, bw in bandwidths.items()}
    out = {"ops": len(rows), "bytes": total, "non_product_bytes": memory,
           "non_product_ms": ms(memory),
           "classes": {c: {"bytes": by_class[c][0], "ops": by_class[c][1],
                           "ms": ms(by_class[c][0])} for c in CLASSES},
           "op_types": {t: {"class": v[2], "ops": v[1], "bytes": v[0], "ms": ms(v[0])}
                        for t, v in sorted(by_type.items(), key=lambda kv: -kv[1][0])}}
    figures = gpt_figures(graph)
    closed = None
    if figures is not None:
        n, layers, width, seq = figures
        tokens = _tokens(graph, seq)
        closed = {"n_params": n, "layers": layers, "width": width, "seq": seq,
                  "tokens": tokens, "per_token": gpt_closed_form(n, layers, width, seq),
                  "flops": gpt_closed_form(n, layers, width, seq) * tokens}
    compute = flops / peak
    out["flops"] = {"graph": flops, "closed_form": closed, "peak": peak,
                    "compute_ms": round(compute * 1e3, 3)}
    out["bounds"] = {
        "serial_ms": {k: round(v * 1e3, 3) for k, v in serial.items()},
        "serial_tokens_per_s": {k: round(closed["tokens"] / v) for k, v in serial.items()}
        if closed and closed["tokens"] else None,
        "sum_ms": {k: round((compute + memory / bw) * 1e3, 3) for k, bw in bandwidths.items()},
        "overlapped_ms": {k: round(max(compute, total / bw) * 1e3, 3)
                          for k, bw in bandwidths.items()}}
    return out


def _tokens(graph, seq):
    """The tokens of one iteration: the token ids the embeddings read."""
    ids = [graph.blobs[op.inputs[0]] for op in graph.ops.values() if op.op_type == "Embedding"]
    return sum(b.size for b in ids) if ids else None


def peaks():
    from purine_mpi.tools.flops import GPU_PEAKS
    return GPU_PEAKS["H200"]


def estimate(job_path, sets, hbm=HBM_DATASHEET, measured=HBM_MEASURED, fc_epilogue="kernel"):
    """The JSON object of the three configurations of ``job_path`` (four with
    ``fc_epilogue`` "both")."""
    bandwidths = {"datasheet": hbm}
    if measured:
        bandwidths["measured"] = measured
    out = {"job": job_path, "set": list(sets), "device": "H200 (figures from datasheets; "
           "nothing here was timed)",
           "hbm_bytes_per_s": bandwidths,
           "hbm_sources": {"datasheet": "NVIDIA H200 SXM datasheet, 4.8 TB/s",
                           "measured": MEASURED_SOURCE if measured else None},
           "measured_fraction": round(measured / hbm, 3) if measured else None,
           "bounds_note": BOUNDS_NOTE,
           "configs": {}}
    for name, precision, storage in CONFIGS:
        graph = job_graph(job_path, sets, precision, storage)
        peak = peaks()["bf16" if precision == "bf16" else "fp32"]
        out["configs"][name] = dict({"precision": precision,
                                     "PURINE_BF16_STORAGE": storage or "default (1)"},
                                    **summary(graph, peak, bandwidths))
        if name == "bf16_bits_storage" and fc_epilogue == "both":   # the same graph
            out["configs"]["bf16_bits_storage_fc_cublaslt"] = dict(
                {"precision": precision, "PURINE_BF16_STORAGE": storage or "default (1)",
                 "PURINE_FC_EPILOGUE": "cublaslt"},
                **summary(graph, peak, bandwidths, "cublaslt"))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--job", default=os.path.join(ROOT, "jobs", "gpt2_124m.yaml"))
    ap.add_argument("--set", action="append", default=[], dest="sets")
    ap.add_argument("--hbm-tbps", type=float, default=HBM_DATASHEET / 1e12,
                    help="the datasheet HBM bandwidth, TB/s (H200: 4.8)")
    ap.add_argument("--measured-tbps", type=float, default=HBM_MEASURED / 1e12,
                    help="a measured streaming bandwidth, TB/s (0: datasheet only)")
    ap.add_argument("--fc-epilogue", choices=("kernel", "both"),
                    default="both" if os.environ.get("PURINE_FC_EPILOGUE") == "cublaslt"
                    else "kernel",
                    help="both: also count the bf16-storage graph under "
                    "PURINE_FC_EPILOGUE=cublaslt (default where that is set)")
    args = ap.parse_args(argv)
    from device_plan import emulated
    mp = emulated(tempfile.mkdtemp(prefix="bf16_traffic_kernels_"), "im2col")
    try:
        out = estimate(args.job, args.sets, args.hbm_tbps * 1e12, args.measured_tbps * 1e12,
                       args.fc_epilogue)
    finally:
        mp.undo()
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

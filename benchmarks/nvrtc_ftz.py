"""Does NVRTC flush float32 subnormals in our kernels? No GPU needed.

    python benchmarks/nvrtc_ftz.py --libnvrtc PATH/libnvrtc.so.13 [--arch 90]

Compiles every cuda/*.cu to PTX with NVRTC (the library given: e.g. from the
nvidia-cuda-nvrtc wheel, ``nvidia/cu13/lib/libnvrtc.so.13``) twice: with
the options ``purine_mpi.gpu.load_kernel`` uses (``gpu.compile_options``:
``-ftz=false`` last of ours), and with those CuPy's ``RawModule(code=...)``
would end in (``-ftz=true`` appended after the caller's), each followed by
what CuPy adds (``--std=c++17``, the architecture,
``--device-as-default-execution-space``). Counts the float32 instructions
that flush subnormals (``.ftz``; libdevice's ``ex2.approx``/``rcp.approx``
aside, present either way) and prints one JSON report: NVRTC's version, per
source the two counts and NVRTC's log, and what NVRTC does with
``-ftz=false`` followed by ``-ftz=true`` (the last wins, with a warning).
Exit status 1 when a source fails to compile or ours flushes anywhere.
"""
import argparse
import ctypes
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import purine_mpi.gpu as gpu  # noqa: E402

#: a float32 instruction flushing subnormals (add.ftz.f32, setp.lt.ftz.f32, ...)
FTZ = re.compile(r"^\s*(?![\w.]*approx)[\w.]*\.ftz\.[\w.]*f32\b", re.MULTILINE)


class Nvrtc:
    def __init__(self, path):
        self.lib = ctypes.CDLL(path)
        major, minor = ctypes.c_int(), ctypes.c_int()
        self.lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
        self.version = (major.value, minor.value)

    def ptx(self, source, name, options):
        """(status, log, PTX) of compiling ``source`` with ``options``."""
        lib, prog = self.lib, ctypes.c_void_p()
        status = lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(),
                                        0, None, None)
        if status:
            return status, "nvrtcCreateProgram failed", ""
        try:
            arr = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
            status = lib.nvrtcCompileProgram(prog, len(options), arr)
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(prog, log)
            text = ""
            if status == 0:
                lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
                buf = ctypes.create_string_buffer(size.value)
                lib.nvrtcGetPTX(prog, buf)
                text = buf.value.decode()
            return status, log.value.decode(errors="replace").strip(), text
        finally:
            lib.nvrtcDestroyProgram(ctypes.byref(prog))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--libnvrtc", required=True, help="path of libnvrtc.so")
    ap.add_argument("--arch", default="90", help="compute capability (default 90)")
    args = ap.parse_args(argv)
    try:
        nvrtc = Nvrtc(args.libnvrtc)
    except OSError as exc:
        print(f"nvrtc_ftz.py: --libnvrtc {args.libnvrtc}: cannot load it ({exc})",
              file=sys.stderr)
        return 2
    tail = ("--std=c++17", f"-arch=compute_{args.arch}", "--device-as-default-execution-space")
    sources, bad = {}, False
    for path in sorted(gpu.CUDA_DIR.glob("*.cu")):
        name = path.stem
        row = {}
        for side, options in (("ours", gpu.compile_options(name)),
                              ("cupy_rawmodule", gpu.SOURCE_OPTIONS.get(name, ()) + ("-ftz=true",))):
            status, log, ptx = nvrtc.ptx(gpu.kernel_source(name), f"{name}.cu", options + tail)
            row[side] = {"status": status, "log": log, "ftz_f32_instructions":
                         len(FTZ.findall(ptx)) if status == 0 else None}
            bad |= status != 0
        bad |= row["ours"]["ftz_f32_instructions"] != 0
        sources[name] = row
    status, log, ptx = nvrtc.ptx(gpu.kernel_source("activation"), "activation.cu",
                                 ("-ftz=false", "-ftz=true") + tail)
    report = {"benchmark": "nvrtc_ftz", "nvrtc": list(nvrtc.version), "arch": args.arch,
              "repeated_ftz": {"options": ["-ftz=false", "-ftz=true"], "status": status,
                               "log": log, "ftz_f32_instructions": len(FTZ.findall(ptx))},
              "sources": sources,
              "ours_total": sum(r["ours"]["ftz_f32_instructions"] or 0 for r in sources.values()),
              "cupy_rawmodule_total": sum(r["cupy_rawmodule"]["ftz_f32_instructions"] or 0
                                          for r in sources.values())}
    print(json.dumps(report, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

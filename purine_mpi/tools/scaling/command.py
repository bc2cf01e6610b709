"""The ``predict`` command's two forms, told apart here:

    predict CONFIG --weights W.h5 --out PREDS.h5 [--blob B] [--split S]
        per-sample outputs of a data split (``purine_mpi/tools/predict.py``)
    predict TRACE_DIR --np N[,N...] [--bandwidth 1gbit] [--latency 20us]
        [--algorithm ring|tree|auto] [--link LINK.json] [--ranks-per-node K]
        [--json] [--plot P.png]
        the scaling prediction from a run's traces (this package)
    mpiexec -n 2 python -m purine_mpi predict --calibrate LINK.json
        measure α, β and γ of the link the ranks run on, and how ranks
        sharing a host slow each other (``calibrate.py``, ``node.py``)

Mixing the options of two forms, or giving none of ``--weights``, ``--np``
and ``--calibrate``, is a usage error (exit 2) that names the forms.
"""
import json
import os
import sys

from ...base.errors import ConfigError, UserError

FORMS = ("predict has three forms: 'predict CONFIG --weights W.h5 --out PREDS.h5' "
         "(per-sample outputs), 'predict TRACE_DIR --np N[,N...] [--bandwidth R] "
         "[--latency T] [--algorithm A] [--link FILE] [--ranks-per-node K] [--json] "
         "[--plot P.png]' (the scaling "
         "prediction from a run's traces) and 'mpiexec -n 2 ... predict --calibrate "
         "LINK.json' (measure the link)")

#: (dest, flag) of each form's own options
INFERENCE = (("weights", "--weights"), ("out", "--out"), ("blobs", "--blob"),
             ("split", "--split"), ("overrides", "--set"), ("seed", "--seed"))
SCALING = (("bandwidth", "--bandwidth"), ("latency", "--latency"), ("algorithm", "--algorithm"),
           ("link", "--link"), ("json", "--json"), ("plot", "--plot"),
           ("ranks_per_node", "--ranks-per-node"))
DEFAULTS = {"blobs": [], "split": "test", "overrides": [], "json": False}


def add_arguments(p):
    """The scaling form's and the calibration's options (``cli.py``)."""
    g = p.add_argument_group("scaling prediction (predict TRACE_DIR --np N ...; docs in "
                             "docs/scaling.md)")
    g.add_argument("--np", dest="nps", metavar="N[,N...]",
                   help="rank counts to predict: 8, 2,4,8 or 2,4,8,...,1024 (the ratio "
                        "continues up to the last)")
    g.add_argument("--bandwidth", metavar="RATE",
                   help="link bandwidth β: 1gbit, 250mbit, 100gbit (bits/s, as tc writes "
                        "them; default 12 GB/s, 100 Gbit/s InfiniBand)")
    g.add_argument("--latency", metavar="TIME",
                   help="link latency α: 20us, 1.5ms (default 1 µs, InfiniBand)")
    g.add_argument("--algorithm", choices=["ring", "tree", "auto"],
                   help="allreduce algorithm of the model (default auto: MPICH's choice "
                        "by message size)")
    g.add_argument("--link", metavar="LINK.json",
                   help="α, β and γ from a predict --calibrate file (--bandwidth and "
                        "--latency still replace its figures)")
    g.add_argument("--ranks-per-node", dest="ranks_per_node", metavar="K",
                   help="ranks sharing a node (default: the --link calibration's ranks per "
                        "host, else 1): with a link file that measured ranks sharing a host "
                        "(predict --calibrate), each op slows and each collective waits as "
                        "measured for min(N, K) ranks on a node (docs/scaling.md)")
    g.add_argument("--json", action="store_true",
                   help="one JSON object instead of a table (docs/formats.md)")
    g.add_argument("--plot", metavar="SCALING.png",
                   help="also draw efficiency and images/s against N (needs matplotlib)")
    c = p.add_argument_group("link calibration (mpiexec -n 2 python -m purine_mpi predict "
                             "--calibrate LINK.json)")
    c.add_argument("--calibrate", metavar="LINK.json",
                   help="measure α, β (ping-pong) and γ (allreduce sweep) between the "
                        "ranks, and how ranks sharing a host slow each other's compute "
                        "and collectives, and write them to LINK.json for --link")


def _given(args, options):
    return [flag for dest, flag in options
            if getattr(args, dest, None) not in (None, DEFAULTS.get(dest))]


def form_of(args):
    """"inference", "scaling" or "calibrate"; a UserError naming the forms
    when the options do not make one."""
    inference, scaling = _given(args, INFERENCE), _given(args, SCALING)
    if args.calibrate:
        extra = inference + scaling + (["--np"] if args.nps else []) + \
            ([args.config] if args.config else [])
        if extra:
            raise UserError(f"predict --calibrate takes no {', '.join(extra)}; {FORMS}")
        return "calibrate"
    if args.nps:
        if inference:
            raise UserError(f"predict --np (the scaling prediction) takes no "
                            f"{', '.join(inference)}; {FORMS}")
        if not args.config:
            raise UserError(f"predict --np needs the trace folder TRACE_DIR; {FORMS}")
        return "scaling"
    if scaling:
        raise UserError(f"predict {', '.join(scaling)} belong(s) to the scaling prediction, "
                        f"which needs --np; {FORMS}")
    if not args.weights or not args.out or not args.config:
        missing = [f for f, ok in (("CONFIG", args.config), ("--weights", args.weights),
                                   ("--out", args.out)) if not ok]
        raise UserError(f"predict: missing {', '.join(missing)}; {FORMS}")
    return "inference"


def run_scaling(args):
    from .link import make_link
    from .model import predict_table
    from .report import format_table, parse_np, plot_scaling, to_json
    from .trace_reader import read_traces
    nps = parse_np(args.nps)
    from .node import notes, parse_ranks_per_node, ranks_per_node_of
    rpn = parse_ranks_per_node(args.ranks_per_node)
    link = make_link(args.bandwidth, args.latency, args.link)
    # once: what the correction for ranks sharing a node cannot apply
    for note in notes(link, ranks_per_node_of(link, rpn),
                      f"--link {args.link}" if args.link else None, rpn is not None):
        print(note, file=sys.stderr, flush=True)
    durations, job = read_traces(args.config)
    if job.graph is not None:  # one composition already: no N to compose it for
        raise ConfigError(os.path.join(args.config, "config.yaml"), "graph",
                          "predict --np composes a 'net:' config's schemes on N ranks; a "
                          "complete 'graph:' is one composition already (its own ops and data "
                          "readers): trace the config it was printed from")
    algorithm = args.algorithm or "auto"
    table = predict_table(job, durations, nps, link, algorithm, rpn)
    data = to_json(table, link, algorithm, args.config, durations)
    if args.plot:
        plot_scaling(data, args.plot)
    print(json.dumps(data) if args.json else format_table(data))
    if args.plot and not args.json:
        print(f"wrote {args.plot}")
    return 0


def run_calibrate(args):
    from .calibrate import calibrate
    result = calibrate(args.calibrate)
    if result is not None:
        note = result.pop("note")
        if note:  # every rank on one host: say what the figures then are
            print(note, file=sys.stderr, flush=True)
        print(json.dumps(result))
    return 0

"""Command line (``--help`` on every command; the job YAML in docs/config.md,
outputs and exit statuses in docs/formats.md). Every command runs the same
under ``mpiexec -n N`` / ``srun`` and without a launcher; the installed
console script ``purine-mpi`` is the same as ``python -m purine_mpi``.

    python -m purine_mpi train CONFIG.yaml [--out DIR] [--iters N] [--set K=V ...]
                                           [--resume CKPT.h5|auto] [--init W.h5]
                                           [--init-skip LAYER ...]
                                           [--seed S] [--profile] [--tensorboard]
    python -m purine_mpi test CONFIG.yaml --weights CKPT.h5 [--out DIR]
    python -m purine_mpi graph CONFIG.yaml [--np N] [--rank R] [--format text|yaml|dot]
    python -m purine_mpi inspect CKPT.h5 [--diff OTHER.h5] [--json]
    python -m purine_mpi data digits --out PATH.h5
    python -m purine_mpi data cifar10 --download|--from PATH --out PATH.h5
    python -m purine_mpi data lmdb-to-h5 --from TRAIN_LMDB [--test-from TEST_LMDB] --out PATH.h5
    python -m purine_mpi predict CONFIG.yaml --weights CKPT.h5 --out PREDS.h5
    python -m purine_mpi predict TRACE_DIR --np 2,4,...,1024 [--bandwidth 1gbit] [--json]
    python -m purine_mpi bench CONFIG.yaml [--iters N] [--json]
    python -m purine_mpi plot RUN [RUN ...] [--out curves.png]
    python -m purine_mpi convert caffe NET.prototxt [--solver S.prototxt] [--data DATA.h5]
                                                    --out JOB.yaml
    python -m purine_mpi export onnx CONFIG.yaml --weights CKPT.h5 --out MODEL.onnx
    python -m purine_mpi --version

Exit statuses (the same on every rank): the table in docs/formats.md, and
``--help``'s epilog.

Layer: cli (docs/DESIGN.md); may import the foundation, devices, data, ops,
graph, job, composition, dispatch and services layers below it, and its own.
"""
import argparse
import json
import math
import os
import sys
import warnings

from . import __version__, env, logfile
from .comm.launcher import launched_rank, launched_size
from .errors import OpError, UserError
from .io.outputs import check_out


def _common_config_args(p):
    p.add_argument("config", help="job YAML (docs/config.md)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key by dotted path, the value read as YAML, e.g. "
                        "solver.base_lr=0.05 or net.0.num_output=8 (repeatable)")
    p.add_argument("--seed", type=int, default=None, help="random seed (overrides the config's "
                                                          "seed)")


def build_parser():
    parser = argparse.ArgumentParser(
        prog="python -m purine_mpi",
        description="purine_mpi: bi-graph deep learning on MPI clusters. Run any command under "
                    "mpiexec -n N (or srun) for N ranks. The job YAML is described in "
                    "docs/config.md, the files a run writes and the exit statuses in "
                    "docs/formats.md.",
        epilog="exit status: 0 success (or stopped by SIGUSR1 with a checkpoint), 1 runtime "
               "failure, 2 user error, 3 diverged or non-finite weights, 70 MPI could not "
               "start, 143 stopped by SIGTERM with a checkpoint, 129 by SIGHUP, 131 by "
               "SIGQUIT, 140 by SIGUSR2, 130 by Ctrl-C (each with a checkpoint), 141 stdout "
               "closed (docs/formats.md)")
    parser.add_argument("--version", action="version", version=f"purine_mpi {__version__}",
                        help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND",
                                help="run 'COMMAND --help' for its options")
    sub.required = True

    p = sub.add_parser("train", help="train a network from a job YAML")
    _common_config_args(p)
    p.add_argument("--out", help="output folder (default: a new numbered folder "
                                 "runs/<name>/<N> for each run)")
    p.add_argument("--force", action="store_true",
                   help="start afresh in an --out that holds another run's files (they are "
                        "deleted)")
    p.add_argument("--iters", type=int, help="override solver.max_iter")
    p.add_argument("--resume", metavar="CKPT.h5|auto",
                   help="continue from a checkpoint (auto: latest.h5 of --out, or of the "
                        "newest runs/<name>/<N>; a fresh run if there is none)")
    p.add_argument("--init", metavar="WEIGHTS.h5|MODEL.caffemodel",
                   help="initialise parameters from a file; every parameter of the net must "
                        "be in it, except those of the --init-skip layers; a Caffe .caffemodel "
                        "loads by layer name and reports which blobs matched")
    p.add_argument("--init-skip", nargs="+", default=[], metavar="LAYER",
                   help="with --init: layers that keep their fresh initialisation (fine-tuning "
                        "a changed layer)")
    p.add_argument("--profile", action="store_true",
                   help="write a Chrome trace per rank (OUT/trace.rank<R>.json, streamed as "
                        "the run goes; open it in Perfetto)")
    p.add_argument("--profile-iters", metavar="A:B",
                   help="trace only iterations A to B-1 (implies --profile), e.g. 100:110")
    p.add_argument("--dispatcher", choices=["event", "serial"], default=None,
                   help="event-driven (default) or the serial reference dispatcher (runs every "
                        "op one at a time in a fixed order; bit-identical results)")
    p.add_argument("--tensorboard", action="store_true",
                   help="also write TensorBoard event files to OUT/tb (rank 0; needs pip "
                        "install 'purine_mpi[tensorboard]')")

    p = sub.add_parser("test", help="evaluate saved weights on the config's test data")
    _common_config_args(p)
    p.add_argument("--weights", required=True, metavar="CKPT.h5|MODEL.caffemodel|RUN",
                   help="checkpoint to evaluate, a Caffe .caffemodel (loaded by layer name), "
                        "or a run folder (its latest.h5)")
    p.add_argument("--out", help="the run folder (default runs/<name>); nothing is written "
                                 "there: the result is printed as one JSON object")

    p = sub.add_parser("graph", help="print a rank's slice of the composed graph")
    _common_config_args(p)
    p.add_argument("--np", type=int, default=None,
                   help="number of ranks to compose for (the text format then ends with "
                        "the data-parallel bucket plan and the deferred tail)")
    p.add_argument("--rank", type=int, default=0, help="which rank's slice to print (default 0)")
    p.add_argument("--format", choices=["text", "yaml", "dot"], default="text",
                   help="text: one line per op (default); yaml: the graph: list of "
                        "docs/config.md, loadable as a config; dot: Graphviz")
    p.add_argument("--phase", choices=["train", "test"], default="train",
                   help="the training graph with backward and solver ops (default), or the "
                        "test graph")
    p.add_argument("--memory", action="store_true",
                   help="text format: end with the host memory plan (memory_plan): each "
                        "planned blob's offset in the arena, size and lifetime, then the blobs "
                        "that keep their own memory and why")

    p = sub.add_parser("inspect", help="list a checkpoint's datasets with statistics")
    p.add_argument("checkpoint", metavar="CKPT.h5",
                   help="a checkpoint or any HDF5 file (layout: docs/formats.md)")
    p.add_argument("--diff", metavar="OTHER.h5",
                   help="compare with another file: max abs and relative L2 difference per "
                        "dataset")
    p.add_argument("--json", action="store_true",
                   help="one JSON object instead of a table (docs/formats.md)")

    p = sub.add_parser("data", help="prepare a data set as HDF5")
    p.add_argument("dataset", choices=["digits", "cifar10", "lmdb-to-h5"],
                   help="digits: scikit-learn's 8x8 digits (no download); cifar10: the "
                        "CIFAR-10 python batches given by --from, or fetched by --download; "
                        "lmdb-to-h5: a Caffe LMDB (--from, the train split; --test-from, the "
                        "test split) as our HDF5 layout")
    p.add_argument("--out", required=True, metavar="PATH.h5",
                   help="the HDF5 data file to write (groups train and test)")
    p.add_argument("--from", dest="source", metavar="PATH",
                   help="cifar10: cifar-10-python.tar.gz, its folder, or the folder of the "
                        "python-pickle batches (with --download: where the archive is fetched "
                        "and unpacked); lmdb-to-h5: the train split's LMDB folder")
    p.add_argument("--test-from", dest="test_source", metavar="DIR",
                   help="lmdb-to-h5: the test split's LMDB folder")
    p.add_argument("--download", action="store_true",
                   help="cifar10: fetch the official archive (cifar-10-python.tar.gz), verify "
                        "its MD5 and unpack it (into --from DIR, default beside --out) first; "
                        "an archive already there with the right MD5 is reused")

    p = sub.add_parser(
        "predict", help="per-sample outputs of a data split to HDF5 (predict CONFIG --weights W "
                        "--out P.h5), or the time per iteration on N ranks from a run's traces "
                        "(predict TRACE_DIR --np N)",
        description="Two forms. predict CONFIG --weights W.h5 --out PREDS.h5: write per-sample "
                    "outputs of a data split (as Caffe's extract_features). predict TRACE_DIR "
                    "--np N[,N...]: predict the iteration time, its compute and communication, "
                    "and the scaling efficiency on N ranks from the trace.rank<R>.json files "
                    "of a run (train --profile-iters A:B) and a link model; mpiexec -n 2 ... "
                    "predict --calibrate LINK.json measures the link for --link.")
    p.add_argument("config", nargs="?", metavar="CONFIG|TRACE_DIR",
                   help="job YAML (docs/config.md) for the outputs; a run folder with "
                        "trace.rank<R>.json and config.yaml for --np")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="outputs: override a config key by dotted path (repeatable)")
    p.add_argument("--seed", type=int, default=None, help="outputs: random seed")
    p.add_argument("--weights", metavar="W.h5",
                   help="outputs: checkpoint or weights file (HDF5 /params, or a .caffemodel), "
                        "or a run folder (its latest.h5)")
    p.add_argument("--out", metavar="PREDS.h5",
                   help="outputs: the HDF5 file to write: /outputs/<blob>, /label, /index "
                        "(docs/formats.md)")
    p.add_argument("--blob", dest="blobs", action="append", default=[], metavar="NAME",
                   help="outputs: a blob to write per sample (repeatable; default: the net's "
                        "last output, the scores its loss reads)")
    p.add_argument("--split", choices=["test", "train"], default="test",
                   help="outputs: which data of the config to run over, in file order "
                        "(default: test)")
    from .scaling.command import add_arguments
    add_arguments(p)

    p = sub.add_parser("bench", help="time training iterations (JSON with --json)")
    _common_config_args(p)
    p.add_argument("--iters", type=int, default=20,
                   help="timed iterations, after the warm-up (default 20)")
    p.add_argument("--warmup", type=int, default=3,
                   help="untimed iterations first (default 3)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (keys: docs/formats.md)")
    p.add_argument("--real-data", action="store_true",
                   help="use the config's data instead of synthetic data of the same shapes")
    p.add_argument("--dispatcher", choices=["event", "serial"], default=None,
                   help="event-driven (default) or the serial reference dispatcher")

    p = sub.add_parser("plot", help="draw loss, accuracy, lr and images/s of runs into an "
                                    "image (needs pip install 'purine_mpi[plot]')")
    p.add_argument("runs", nargs="+", metavar="RUN",
                   help="a run folder, its metrics.jsonl, or runs/<name> (its newest "
                        "numbered run); several are overlaid")
    p.add_argument("--out", default="curves.png", metavar="IMAGE",
                   help="the image to write; the format follows the extension (.png, .pdf, "
                        ".svg; default curves.png)")

    p = sub.add_parser("convert", help="convert another framework's model into a job YAML")
    p.add_argument("format", choices=["caffe"], help="the source format")
    p.add_argument("net", metavar="NET.prototxt", help="Caffe net definition (text format)")
    p.add_argument("--solver", metavar="SOLVER.prototxt",
                   help="Caffe solver (text format): becomes the solver and checkpoint sections")
    p.add_argument("--data", metavar="DATA.h5",
                   help="our HDF5 data file (groups train/test) that the net's data layers read")
    p.add_argument("--out", required=True, metavar="JOB.yaml", help="the job YAML to write")

    p = sub.add_parser("export", help="export a trained net's inference graph")
    p.add_argument("format", choices=["onnx"], help="the target format")
    p.add_argument("config", help="job YAML (docs/config.md); its test phase is exported")
    p.add_argument("--weights", required=True, metavar="CKPT.h5",
                   help="checkpoint or weights file (/params layout) with every parameter")
    p.add_argument("--out", required=True, metavar="MODEL.onnx", help="the ONNX file to write")
    p.add_argument("--batch", type=int, default=None,
                   help="fixed batch size of the model input (default: a symbolic batch dim)")
    p.add_argument("--raw-input", action=argparse.BooleanOptionalAction, default=True,
                   help="the model takes samples as the data file holds them and applies the "
                        "test spec's transform (centre crop, mean, scale) as ONNX ops "
                        "(default); --no-raw-input: it takes the transformed batch")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key by dotted path, e.g. net.0.num_output=8")
    p.set_defaults(seed=None)

    for p in sub.choices.values():
        p.add_argument("--debug", action="store_true",
                       help="print the full Python traceback of a runtime failure (by default "
                            "each failing rank prints one line)")
    return parser


def _load(args, check_files=True):
    """The command's job (io/job.py): the config validated and resolved once."""
    from .io.config import load_job
    job = load_job(args.config, args.overrides, getattr(args, "iters", None),
                   check_files=check_files)
    if args.seed is not None:  # checked as the config's seed is
        from .io.config import check_seed
        job = job.replace(seed=check_seed("--seed", args.seed, None))
    return job


def _runs_base(job):
    """The folder of a job's numbered runs: ``checkpoint.folder``, or runs/<name>."""
    return job.checkpoint.folder or os.path.join("runs", job.name)


def _out_dir(args, job):
    return args.out or _runs_base(job)


def _run_dir(args, job):
    """The train run's folder, chosen and locked by rank 0 (io/rundir.py)."""
    from .io.rundir import prepare_run_dir
    from .trainer import get_world
    base, world = _runs_base(job), get_world()
    world.stall_timeout = float(job.parallel.stall_timeout)  # the set-up waits no longer
    return prepare_run_dir(world, os.path.basename(os.path.normpath(base)), args.out,
                           args.resume, args.force,
                           runs_root=os.path.dirname(os.path.normpath(base)))


def _profile(args):
    """False, True (the whole run) or an iteration window (--profile-iters)."""
    if args.profile_iters is not None:
        from .runtime.trace import parse_window
        return parse_window(args.profile_iters)
    return bool(args.profile)


def cmd_train(args):
    from .runtime.stop import StopSignal
    StopSignal.install_early()  # before the slow imports and the graph build
    from .trainer import run_training
    job = _load(args)
    if args.init_skip and not args.init:
        raise UserError("--init-skip names layers to leave out of --init WEIGHTS.h5; "
                        "give --init too")
    if args.tensorboard:  # before the run folder and the graphs: exit 2 at once
        from .io.tensorboard import require_tensorboard
        require_tensorboard()
    return run_training(job, _run_dir(args, job), resume=args.resume, init=args.init,
                        profile=_profile(args), dispatcher=args.dispatcher,
                        init_skip=args.init_skip, tensorboard=args.tensorboard)


def cmd_test(args):
    from .trainer import Trainer
    from .io.checkpoint import load_params
    from .io.checkpoint_check import NonFiniteWeights
    job = _load(args)
    args.weights = _weights_file(args.weights)
    if not args.weights.endswith(".caffemodel"):
        load_params(args.weights)  # a bad file fails here, before any graph is built
    # stdout holds only the JSON result: notes and progress lines go to stderr
    t = Trainer(job, _out_dir(args, job), init=args.weights,
                log=lambda msg: print(msg, file=sys.stderr, flush=True))
    try:
        res = t.evaluate()
    finally:
        t.close()
    if not res:
        raise UserError(f"{args.config}: key 'data.test': nothing to evaluate (no test data or "
                        "no loss/accuracy layer in the test phase)")
    bad = sorted(k for k, v in res.items() if isinstance(v, float) and not math.isfinite(v))
    if t.world.rank == 0:  # strict JSON: a non-finite figure is null (and the exit status 3)
        # the figures rounded as train's final line prints them
        print(json.dumps({k: None if k in bad else round(v, 6) if isinstance(v, float) else v
                          for k, v in res.items()}, allow_nan=False), flush=True)
    if bad:
        raise NonFiniteWeights(f"evaluating {args.weights} gave a non-finite {', '.join(bad)} "
                               "(NaN or inf): the figure is not a result")
    return 0


def _weights_file(path):
    """--weights: a file, or a run folder (its latest.h5, as --resume auto
    finds a run's newest checkpoint)."""
    if os.path.isdir(path):
        latest = os.path.join(path, "latest.h5")
        if not os.path.isfile(latest):
            raise UserError(f"--weights {path}: a folder without latest.h5 (not a run folder "
                            "with a finished checkpoint); give the checkpoint file")
        return latest
    return path


def cmd_predict(args):
    from .scaling.command import form_of, run_calibrate, run_scaling
    form = form_of(args)
    if form == "scaling":
        return run_scaling(args)
    if form == "calibrate":
        return run_calibrate(args)
    from .io.checkpoint import load_params
    from .predict import predict_split
    job = _load(args)
    args.weights = _weights_file(args.weights)
    if not args.weights.endswith(".caffemodel"):
        load_params(args.weights)  # a bad file fails here, before any graph is built
    check_out(args.out, args.config, args.weights, job)
    res = predict_split(job, args.out, args.weights, args.blobs, args.split,
                        log=lambda msg: print(msg, file=sys.stderr, flush=True))
    if res is not None:
        print(json.dumps(res))
    return 0


def cmd_graph(args):
    from .graph.inspect import render_graph
    job = _load(args, check_files=False)
    print(render_graph(job, args.np, args.rank, args.format, args.phase, memory=args.memory))
    return 0


def cmd_inspect(args):
    from .io.checkpoint_report import inspect_checkpoint
    print(inspect_checkpoint(args.checkpoint, diff=args.diff, as_json=args.json))
    return 0


def cmd_data(args):
    from .io import datasets
    check_out(args.out)  # never one of our checkpoints
    if args.dataset == "digits":
        datasets.write_digits(args.out)
    elif args.dataset == "lmdb-to-h5":
        if not args.source:
            raise UserError("data lmdb-to-h5 needs --from TRAIN_LMDB (and optionally "
                            "--test-from TEST_LMDB)")
        splits = {"train": args.source}
        if args.test_source:
            splits["test"] = args.test_source
        log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
        datasets.write_lmdb(splits, args.out, log=log)
    else:
        log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
        from .io.download import cifar10_from, download_cifar10
        source = args.source
        if args.download:
            source = download_cifar10(source or os.path.join(
                os.path.dirname(os.path.abspath(args.out)), "cifar-10-download"), log)
        elif not source:
            raise UserError("data cifar10 needs --from PATH (cifar-10-python.tar.gz, its "
                            "folder, or the folder of data_batch_1..5 and test_batch), or "
                            "--download to fetch and verify the official archive")
        with cifar10_from(source, os.path.dirname(os.path.abspath(args.out)), log) as folder:
            datasets.write_cifar10(folder, args.out, log=log)
    print(f"wrote {args.out}")
    return 0


def cmd_bench(args):
    from .bench import format_bench, run_bench
    job = _load(args, check_files=args.real_data)
    res = run_bench(job, args.iters, args.warmup, real_data=args.real_data,
                    dispatcher=args.dispatcher)
    if res is not None:
        print(json.dumps(res) if args.json else format_bench(res, args.warmup))
    return 0


def cmd_plot(args):
    from .plot import plot_runs
    plot_runs(args.runs, args.out)
    print(f"wrote {args.out}")
    return 0


def cmd_convert(args):
    from .interop.caffe_convert import write_config
    check_out(args.out, args.net, more=[("--solver", args.solver), ("--data", args.data)])
    notes = write_config(args.net, args.out, args.solver, args.data)
    for note in notes:
        print(f"note: {note}")
    print(f"wrote {args.out}")
    return 0


def cmd_export(args):
    from .interop.onnx_export import export_onnx
    job = _load(args)
    check_out(args.out, args.config, args.weights, job)
    summary = export_onnx(job, args.weights, args.out, batch=args.batch,
                          raw_input=args.raw_input)
    print(f"wrote {args.out}: {summary}")
    return 0


COMMANDS = {"train": cmd_train, "test": cmd_test, "graph": cmd_graph, "inspect": cmd_inspect,
            "data": cmd_data, "predict": cmd_predict, "bench": cmd_bench, "plot": cmd_plot, "convert": cmd_convert,
            "export": cmd_export}


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.debug:
        os.environ["PURINE_DEBUG"] = "1"
    # a NaN or inf is reported once, as such (a diverged run, non-finite
    # weights or data), not as NumPy's RuntimeWarning lines before it
    warnings.filterwarnings("ignore", category=RuntimeWarning,
                            message=r"(overflow|invalid value|divide by zero|underflow) "
                                    r"encountered")
    try:
        env.check_all()  # every PURINE_* variable, before anything reads one (env.py)
        return COMMANDS[args.command](args) or 0
    except UserError as exc:
        _report_user_error(exc)
        return exc.exit_code  # 2; 3 for non-finite weights
    except OpError as exc:  # an op that found a user error while running (a data file)
        if not isinstance(exc.cause, UserError):
            raise
        _report_user_error(exc.cause)
        return exc.cause.exit_code
    except KeyboardInterrupt:  # Ctrl-C in another command than train
        from .runtime.stop import print_err
        if launched_rank() == 0:
            print_err("interrupted")
        return 130
    except BrokenPipeError:  # output piped into `head` and the like: not a success
        from .runtime.stop import print_err, stdout_to_devnull
        stdout_to_devnull()
        if launched_rank() == 0:  # stderr may be the closed pipe too (2>&1 | head)
            print_err("error: stdout was closed (broken pipe) before the output was written")
        return 141


def _report_user_error(exc):
    """One paragraph on stderr, no traceback, printed by exactly one rank.

    Without a launcher (or with one rank) the process prints it. Under a
    launcher with several ranks, the ranks agree (comm/world.py,
    ``report_user_error``): an error that every rank finds is printed once
    by rank 0 and every rank exits with its status; an error of some ranks
    only (a file missing on one node) is printed by that rank, which then
    aborts the job so the others never wait for it."""
    mpi = sys.modules.get("mpi4py.MPI")
    # an error that forbids MPI_Init (comm/launcher.py: a launcher the MPI
    # library cannot join) is printed by rank 0 alone, without MPI
    if not getattr(exc, "before_mpi", False) and (
            launched_size() > 1 or (mpi is not None and mpi.Is_initialized())):
        from .comm.world import report_user_error
        report_user_error(exc)  # returns only on a single rank
    if launched_rank() == 0:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        logfile.note_error(f"error: {exc}")



"""Command line (``--help`` on every command; the job YAML in docs/config.md,
outputs and exit statuses in docs/formats.md). Every command gives one answer
under ``mpiexec -n N`` / ``srun`` and without a launcher: the commands without
a distributed meaning (``RANK0_COMMANDS``, ``predict TRACE_DIR``) run on rank
0 alone, the other ranks waiting for its exit status; the installed console
script ``purine-mpi`` is the same as ``python -m purine_mpi``. The argument
parser is purine_mpi/cli_args.py.

    python -m purine_mpi train CONFIG.yaml [--out DIR] [--iters N] [--set K=V ...]
                                           [--resume CKPT.h5|auto]
                                           [--init W.h5|MODEL.caffemodel|MODEL.safetensors]
                                           [--init-skip LAYER[,LAYER] ...]
                                           [--seed S] [--profile] [--tensorboard]
    python -m purine_mpi test CONFIG.yaml --weights CKPT.h5 [--out DIR]
    python -m purine_mpi graph CONFIG.yaml [--np N] [--rank R] [--format text|yaml|dot]
    python -m purine_mpi plan CONFIG.yaml [--np N] [--host-memory SIZE] [--device-memory SIZE]
                                          [--ranks-per-node K] [--resume] [--init W.h5] [--json]
    python -m purine_mpi inspect CKPT.h5 [--diff OTHER.h5] [--json]
    python -m purine_mpi data digits --out PATH.h5
    python -m purine_mpi data cifar10 --download|--from PATH --out PATH.h5
    python -m purine_mpi data lmdb-to-h5 --from TRAIN_LMDB [--test-from TEST_LMDB] --out PATH.h5
    python -m purine_mpi data text --from PATH [--glob PATTERN] --out PATH.h5 [--val-fraction F]
                                   [--tokenizer TOKENIZER.json | --bpe-vocab N]
    python -m purine_mpi generate [CONFIG.yaml] --weights CKPT.h5|RUN --prompt TEXT --tokens N
                                  [--temperature T] [--top-k K] [--top-p P] [--seed S]
                                  [--no-prompt]
    python -m purine_mpi predict CONFIG.yaml --weights CKPT.h5 --out PREDS.h5
    python -m purine_mpi predict TRACE_DIR --np 2,4,...,1024 [--bandwidth 1gbit] [--json]
    python -m purine_mpi bench CONFIG.yaml [--iters N] [--json]
    python -m purine_mpi plot RUN [RUN ...] [--out curves.png]
    python -m purine_mpi convert caffe NET.prototxt [--solver S.prototxt] [--data DATA.h5]
                                                    --out JOB.yaml
    python -m purine_mpi export onnx CONFIG.yaml --weights CKPT.h5 --out MODEL.onnx
    python -m purine_mpi export hf CONFIG.yaml --weights CKPT.h5|RUN --out DIR
    python -m purine_mpi --version

Exit statuses (the same on every rank): the table in docs/formats.md, and
``--help``'s epilog.
"""
# first: a rank that dies before MPI is up must still end the job (comm/early_abort.py)
from .comm import early_abort as _early_abort
_early_abort.install()

import difflib  # noqa: E402
import json
import os
import sys
import warnings

from .base import env, logfile
from .cli_args import build_parser
from .comm.launcher import launched_rank, launched_size, size_untold
from .base.errors import InitMismatch, OpError, UserError
from .job.outputs import check_out, refuse_other_kind, refuse_replacing, refuse_under_a_file


def _load(args, check_files=True):
    """The command's job (job/job.py): the config validated and resolved once
    (``generate`` without CONFIG: the config its ``--weights`` checkpoint holds)."""
    from .job.config import load_job, load_job_of_checkpoint
    if args.config is None:
        job = load_job_of_checkpoint(args.weights, args.overrides, check_files=check_files)
    else:
        job = load_job(args.config, args.overrides, getattr(args, "iters", None),
                       check_files=check_files)
    if args.seed is not None:  # checked as the config's seed is
        from .job.checks import check_seed
        job = job.replace(seed=check_seed("--seed", args.seed, None))
    return job


def _runs_base(job):
    """The folder of a job's numbered runs: ``checkpoint.folder``, or runs/<name>."""
    return job.checkpoint.folder or os.path.join("runs", job.name)


def _out_dir(args, job):
    return args.out or _runs_base(job)


def _run_dir(args, job):
    """The train run's folder, chosen and locked by rank 0 (job/rundir.py)."""
    from .job.rundir import prepare_run_dir
    from .train.collectives import get_world
    base, world = _runs_base(job), get_world()
    world.stall_timeout = float(job.parallel.stall_timeout)  # the set-up waits no longer
    return prepare_run_dir(world, os.path.basename(os.path.normpath(base)), args.out,
                           args.resume, args.force,
                           runs_root=os.path.dirname(os.path.normpath(base)), init=args.init,
                           job=job)


def _profile(args):
    """False, True (the whole run) or an iteration window (--profile-iters)."""
    if args.profile_iters is not None:
        from .runtime.trace import parse_window
        return parse_window(args.profile_iters)
    return bool(args.profile)


def cmd_train(args):
    from .runtime.stop import StopSignal
    StopSignal.install_early()  # before the slow imports and the graph build
    from .train.trainer import run_training
    job = _load(args)
    if args.init_skip and not args.init:
        raise UserError("--init-skip names layers to leave out of --init WEIGHTS.h5; "
                        "give --init too")
    if args.tensorboard:  # before the run folder and the graphs: exit 2 at once
        from .job.tensorboard import require_tensorboard
        require_tensorboard()
    from .tools.plan import check_memory
    from .job.schema import AUTO_SCHEME
    limits = _memory_limits(args)  # a bad size: exit 2 before the run folder
    profile = _profile(args)
    if isinstance(profile, tuple) and not args.resume:
        # a fresh run trains 0..max_iter-1: a window past them, exit 2 before
        # the run folder is made (a resume's start is its checkpoint's:
        # train/profiling.Traces.check_start, before any file is written)
        from .train.profiling import check_window
        check_window(profile, 0, job.solver.max_iter)
    out_dir, notes = _run_dir(args, job), ()
    if job.parallel.scheme == AUTO_SCHEME:
        job, notes = _resolve_auto(args, out_dir, limits)
    notes = tuple(notes) + _cpu_device_memory_note(args, job)
    return run_training(job, out_dir, resume=args.resume, init=args.init,
                        profile=profile, dispatcher=args.dispatcher,
                        init_skip=args.init_skip, tensorboard=args.tensorboard,
                        memory=lambda *built, **restore: check_memory(*built, limits,
                                                                      args.dispatcher, **restore),
                        notes=notes)


#: seconds the other ranks wait for rank 0's choice of parallel.scheme auto
#: (its calibration runs the job for a few iterations)
AUTO_WAIT_S = 3600.0


def _resolve_auto(args, out_dir, limits):
    """``parallel.scheme: auto``: rank 0 chooses as ``plan --choose`` does
    (its calibration cached in OUT/calibration.json) and sends the chosen
    ``--set`` overrides to every rank, which loads the job with them:
    (job, the start-up block's lines: one, and the table with --debug)."""
    from .comm.world import rank0_decides
    from .tools.choose import choose, format_choice
    from .train.collectives import get_world
    world = get_world()

    def decide():
        try:
            choice = choose(args.config, _seeded(args), world.size, limits, None,
                            os.path.join(out_dir, "calibration.json"),
                            log=lambda line: print(line, flush=True))
            best = choice.best
            lines = [f"parallel.scheme auto: {choice.why()}"]
            if args.debug:
                lines += format_choice(choice).splitlines()
        except UserError as exc:  # its status too (a stopped calibration: 128 + the signal)
            said = UserError(f"parallel.scheme auto: {exc}")
            said.exit_code = exc.exit_code
            raise said from None
        if best is None:
            raise UserError("parallel.scheme auto: no setting fits the ranks' memory; "
                            "python -m purine_mpi plan CONFIG --np N --choose shows the table")
        return list(best.sets), lines
    try:
        sets, lines = rank0_decides(world, decide, "parallel.scheme auto's choice",
                                    AUTO_WAIT_S)
    except KeyboardInterrupt:
        if world.rank != 0:
            _let_rank0_end_its_calibration()
        raise
    import argparse
    chosen = argparse.Namespace(**{**vars(args), "overrides": list(args.overrides) + sets})
    return _load(chosen), tuple(lines)


def _let_rank0_end_its_calibration():
    """A Ctrl-C on a rank other than 0 while rank 0 chooses for ``parallel.
    scheme: auto``: that rank's ``interrupted`` (MPI_Abort, every rank
    killed) only after rank 0 has had the time to end its calibration child
    and remove the child's run folder (``tools/choose._run_child``: the
    child's grace, ``CHILD_GRACE_S``, and a margin), a second Ctrl-C
    meanwhile ignored. mpiexec passes a Ctrl-C to every rank: rank 0 then
    ends the job itself (its own ``interrupted``) once it has cleaned up,
    this rank killed as it waits. Before, this rank aborted the job at once
    and rank 0 was killed in the child's grace: its ``.calibration-*``
    folder stayed in the run folder, the child ran on past mpiexec's end."""
    import signal
    import time
    from .tools.choose import CHILD_GRACE_S
    try:
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    except (ValueError, OSError):  # not the main thread: no wait
        return
    try:
        time.sleep(CHILD_GRACE_S + 2.0)
    finally:
        signal.signal(signal.SIGINT, previous)


def _memory_limits(args):
    """--host-memory, --device-memory, --node-memory, --no-memory-check (tools/plan.py)."""
    from .tools.plan import MemoryLimits, parse_bytes
    return MemoryLimits(
        host=None if args.host_memory is None else parse_bytes(args.host_memory,
                                                               "--host-memory"),
        device=None if args.device_memory is None else parse_bytes(args.device_memory,
                                                                   "--device-memory"),
        check=getattr(args, "memory_check", True),
        ranks_per_node=_ranks_per_node(args),
        node=None if args.node_memory is None else parse_bytes(args.node_memory,
                                                               "--node-memory"))


def _cpu_device_memory_note(args, job):
    """(the note that --device-memory checks nothing for a job on the CPU,)
    or () (a GPU job, or no --device-memory)."""
    if getattr(args, "device_memory", None) is None or int(job.device) >= 0:
        return ()
    return (f"note: --device-memory {args.device_memory} checks nothing: the job runs on the CPU "
            "(device: -1; --host-memory is the limit that applies)",)


def _ranks_per_node(args):
    """plan's --ranks-per-node (None: not given; train has none: its launcher says)."""
    from .tools.scaling.node import parse_ranks_per_node
    return parse_ranks_per_node(getattr(args, "ranks_per_node", None))


def cmd_test(args):
    from .train.trainer import Trainer
    from .job.checkpoint_file import load_params
    from .job.checkpoint_check import NonFiniteWeights
    from .base.logfile import non_finite_figures
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
    # a pass with a non-finite figure measured nothing: none of its figures
    # is a result (an accuracy beside a NaN loss comes of the same
    # overflowed scores), all null, as train's row and final line of such a
    # pass (train/evaluation.py); strict JSON, and the exit status 3
    bad = non_finite_figures(res)
    if t.world.rank == 0:
        # the figures rounded as train's final line prints them
        print(json.dumps({k: v if k == "samples" else None if bad else
                          round(v, 6) if isinstance(v, float) else v
                          for k, v in res.items()}, allow_nan=False), flush=True)
    if bad:
        raise NonFiniteWeights(f"evaluating {args.weights} gave a non-finite {', '.join(bad)} "
                               "(NaN or inf): no figure of the pass is a result")
    return 0


def _weights_file(path):
    """--weights: a file, or a run folder (its latest.h5, as --resume auto
    finds a run's newest checkpoint), or runs/<name>, where train without
    --out numbers its runs: the newest numbered run that has a latest.h5
    (as ``plot runs/<name>`` takes the newest with metrics)."""
    if os.path.isdir(path):
        from .job.rundir import numbered_runs
        latest = os.path.join(path, "latest.h5")
        if os.path.isfile(latest):
            return latest
        for _, run in reversed(numbered_runs(path)):
            if os.path.isfile(os.path.join(run, "latest.h5")):
                return os.path.join(run, "latest.h5")
        raise UserError(f"--weights {path}: a folder without latest.h5, nor numbered run "
                        "folders with one (not a run folder with a finished checkpoint, nor "
                        "runs/<name>); give the checkpoint file")
    if not os.path.exists(path):
        parent = os.path.dirname(os.path.normpath(path)) or "."
        try:
            siblings = sorted(os.listdir(parent))
        except OSError:
            siblings = []
        close = difflib.get_close_matches(os.path.basename(os.path.normpath(path)), siblings,
                                          n=1, cutoff=0.6)
        hint = f" (did you mean '{os.path.join(os.path.dirname(path), close[0])}'?)" \
            if close else ""
        raise UserError(f"--weights {path}: no such run folder or checkpoint{hint}")
    return path


def cmd_predict(args):
    from .tools.scaling.command import form_of, run_calibrate, run_scaling
    form = form_of(args)
    if form == "scaling":
        return run_scaling(args)
    if form == "calibrate":  # LINK.json writable: exit 2 before the measurements, not after
        from .tools.scaling.link import FORMAT as LINK_FORMAT
        _check_written_by_rank0(args.calibrate, "--calibrate", lambda d: isinstance(d, dict)
                                and d.get("format") == LINK_FORMAT)
        return run_calibrate(args)
    from .job.checkpoint_file import load_params
    from .tools.predict import predict_split
    job = _load(args)
    args.weights = _weights_file(args.weights)
    if not args.weights.endswith(".caffemodel"):
        load_params(args.weights)  # a bad file fails here, before any graph is built
    check_out(args.out, args.config, args.weights, job)
    refuse_other_kind(args.out, "predictions", "the predictions", args.force)  # as data's
    _check_written_by_rank0(args.out)
    res = predict_split(job, args.out, args.weights, args.blobs, args.split,
                        log=lambda msg: print(msg, file=sys.stderr, flush=True))
    if res is not None:
        print(json.dumps(res))
    return 0


def _check_written_by_rank0(out, option="--out", link=None):
    """predict's --out (or --calibrate's LINK.json: ``link``, the test of
    a link file's JSON, and an existing file of another kind refused,
    ``refuse_other_json``), which rank 0 alone writes: checked up front, before
    any evaluation, on rank 0, whose verdict every rank takes (one line by
    rank 0 and exit 2 on every rank, not rank 0's own ``error: rank 0: ...``
    and an abort after the whole pass)."""
    from .base.runfiles import check_writable
    from .comm.world import rank0_decides
    from .train.collectives import get_world
    from .job.outputs import refuse_other_json

    def check():
        if link is not None:
            refuse_other_json(out, option, "the link model", link)
        check_writable(out, option)
    rank0_decides(get_world(), check, f"predict's check of {option}")


def cmd_generate(args):
    from .tools.generate import generate_text
    args.weights = _weights_file(args.weights)
    job = _load(args, check_files=False)  # the data file is not read
    try:
        generate_text(job, args.weights, args.prompt, args.tokens, args.temperature,
                      args.top_k, show_prompt=not args.no_prompt,
                      log=lambda msg: print(msg, file=sys.stderr, flush=True), top_p=args.top_p)
    except KeyboardInterrupt:  # Ctrl-C: the text drawn is shown, ended by a newline
        return 130
    return 0


def cmd_graph(args):
    from .tools.graph import render_graph
    if args.np is not None and args.np < 1:  # not composed for one rank in its place
        raise UserError(f"--np {args.np}: give a number of ranks >= 1")
    job = _load(args, check_files=False)
    print(render_graph(job, args.np, args.rank, args.format, args.phase, memory=args.memory))
    if args.format == "yaml" and (args.np or 1) > 1:
        # one rank's slice loads as a config of its own, which is not the N-rank
        # run (data parallel: its reader's shard of N, its gradients scaled by
        # 1/N, trained alone on one rank): said, once
        from .runtime.stop import print_err
        print_err(f"note: this is rank {args.rank}'s slice of the graph composed for "
                  f"{args.np} ranks (its share of the data, layers and gradients), not a "
                  f"config of the {args.np}-rank run: train the job's own config on "
                  f"{args.np} ranks (graph --format yaml without --np prints a graph to load)")
    return 0


def cmd_plan(args):
    from .tools.plan import MAX_PLAN_RANKS, run_plan
    if args.np < 1:
        raise UserError(f"--np {args.np}: give a number of ranks >= 1")
    if args.np > MAX_PLAN_RANKS:  # its answer lists every rank: time and memory grow with N
        raise UserError(f"--np {args.np}: plan takes at most {MAX_PLAN_RANKS:,} ranks (it "
                        "names every rank and node, so its time and memory grow with --np)")
    choosing = [f for f, v in (("--calibration", args.calibration), ("--network", args.network),
                                 ("--bandwidth", args.bandwidth), ("--latency", args.latency),
                                 ("--out", args.out)) if v]
    choose = args.choose or args.choose_all
    if choosing and not choose:
        raise UserError(f"plan {', '.join(choosing)}: these options belong to --choose "
                        "(or --choose-all)")
    if choose and (args.resume or args.init):
        raise UserError("plan --choose ranks settings for a fresh start: without "
                        "--resume and --init (plan JOB --np N --resume shows a setting's "
                        "start-up load)")
    job = _load(args, check_files=False)
    _memory_limits(args)  # a size that does not parse: its one line, before a note about it
    for note in _cpu_device_memory_note(args, job):
        print(note, file=sys.stderr)
    if choose:
        return _plan_choose(args, job)
    from .base.gc_pause import collections_paused
    from .graph.core import shared_dependencies
    from .runtime.memory_plan import shared_colourings
    # the ranks' compositions of one net (--np N: data parallelism's N
    # replicas) share their dependencies and memory plans' colourings by
    # content, as plan --choose's settings do: equal content, equal answer;
    # without the collector's full passes over the graphs (base/gc_pause.py)
    with shared_dependencies(), shared_colourings(), collections_paused():
        text, status = run_plan(job, args.np, _memory_limits(args), as_json=args.json,
                                restore={"init": args.init,
                                         "resume": True if args.resume else None})
    print(text)
    return status


def _plan_choose(args, job):
    from .tools.choose import best_yaml, choose, choice_json, default_calibration, format_choice
    from .tools.scaling.link import make_link
    from .tools.scaling.node import notes, ranks_per_node_of
    link = make_link(args.bandwidth, args.latency, args.network)
    limits = _memory_limits(args)  # a bad --ranks-per-node: exit 2 before the notes
    # once, as predict says it: what the correction for ranks sharing a node
    # cannot apply (--network's file measured none)
    k = ranks_per_node_of(link, limits.ranks_per_node)
    for note in notes(link, k, f"--network {args.network}" if args.network else None):
        print(note, file=sys.stderr, flush=True)
    if link.node is not None and (k > 1 or link.node.across_hosts):
        print(f"ranks sharing a node: {k} a node, each setting corrected by --network's "
              f"measurements as predict --ranks-per-node {k} corrects it", file=sys.stderr,
              flush=True)
    calibration = args.calibration or default_calibration(job)
    from .job.outputs import refuse_other_json  # a cache: never over a file of another kind
    refuse_other_json(calibration, "--calibration", "the calibration",
                      lambda d: isinstance(d, dict) and "key" in d and "per_rank" in d)
    choice = choose(args.config, _seeded(args), args.np, limits, link, calibration,
                    log=lambda line: print(line, file=sys.stderr, flush=True),
                    every_count=args.choose_all)
    print(json.dumps(choice_json(choice)) if args.json else format_choice(choice))
    if choice.best is None:
        return 2
    if args.out:
        from .base.runfiles import write_text_replacing
        write_text_replacing(args.out, best_yaml(choice))
        if not args.json:
            print(f"wrote {args.out}")
    return 0


def _seeded(args):
    """The --set overrides, with --seed as one."""
    return list(args.overrides) + ([f"seed={args.seed}"] if args.seed is not None else [])


def cmd_inspect(args):
    from .tools.inspect import inspect_checkpoint
    print(inspect_checkpoint(args.checkpoint, diff=args.diff, as_json=args.json))
    return 0


def cmd_data(args):
    from .data import datasets
    check_out(args.out, more=[("--from", args.source), ("--tokenizer", args.tokenizer)])
    src = os.path.realpath(args.source) + os.sep if args.source else None
    if not (args.out and src and os.path.realpath(args.out).startswith(src)):
        refuse_other_kind(args.out, "data", "the data", args.force)  # (an input: below)
    if args.dataset != "text" and (args.glob is not None or args.val_fraction != 0.1 or
                                   args.tokenizer is not None or args.bpe_vocab is not None):
        raise UserError(f"data {args.dataset}: --glob, --val-fraction, --tokenizer and "
                        "--bpe-vocab apply to data text")
    if args.dataset == "digits":
        datasets.write_digits(args.out)
    elif args.dataset == "text":
        from .data.text import write_text
        if not args.source:
            raise UserError("data text needs --from PATH (a UTF-8 text file or a folder of "
                            "them; --glob '*.py' picks files)")
        log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
        write_text(args.source, args.out, args.glob, args.val_fraction, log=log,
                   tokenizer=args.tokenizer, bpe_vocab=args.bpe_vocab)
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
        from .data.download import cifar10_from, download_cifar10
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
    from .tools.bench import format_bench, run_bench
    if args.iters < 1:  # no timed iteration: no figure to report
        raise UserError(f"--iters {args.iters}: give a number of timed iterations >= 1")
    if args.warmup < 0:
        raise UserError(f"--warmup {args.warmup}: give a number of untimed iterations >= 0")
    job = _load(args, check_files=args.real_data)
    res = run_bench(job, args.iters, args.warmup, real_data=args.real_data,
                    dispatcher=args.dispatcher)
    if res is not None:
        print(json.dumps(res) if args.json else format_bench(res, args.warmup))
    return 0


def cmd_plot(args):
    from .tools.plot import plot_runs
    plot_runs(args.runs, args.out, args.loss_scale)
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
    from .interop.onnx_export import export_onnx, precision_note
    if args.format == "hf":  # the weights and the net only: no data file is read
        from .interop.hf_gpt2 import export_hf
        if args.batch is not None:
            raise UserError("export hf: --batch is an option of export onnx (a Hugging Face "
                            "model takes any batch)")
        job = _load(args, check_files=False)
        args.weights = _weights_file(args.weights)
        # a folder (made if missing, docs/formats.md): an existing one is written into
        refuse_under_a_file(args.out)
        refuse_replacing(args.out, "--out", [("the config", args.config),
                                             ("the --weights file", args.weights)])
        summary = export_hf(job, args.weights, args.out)
    else:
        if args.batch is not None and args.batch < 1:  # -1 was written as the input's dimension
            raise UserError(f"--batch {args.batch}: give a batch size >= 1, or no --batch (the "
                            "model's batch axis is then free)")
        job = _load(args)
        args.weights = _weights_file(args.weights)  # a run folder too, as export hf
        check_out(args.out, args.config, args.weights, job)
        summary = export_onnx(job, args.weights, args.out, batch=args.batch,
                              raw_input=args.raw_input)
    note = precision_note(job)
    if note is not None:  # float32 master weights: a bf16/fp16/tf32 run's forward is not theirs
        print(note, file=sys.stderr)
    print(f"wrote {args.out}: {summary}")
    return 0


COMMANDS = {"train": cmd_train, "test": cmd_test, "graph": cmd_graph, "plan": cmd_plan,
            "inspect": cmd_inspect,
            "data": cmd_data, "predict": cmd_predict, "bench": cmd_bench, "plot": cmd_plot,
            "convert": cmd_convert, "export": cmd_export, "generate": cmd_generate}


#: commands without a distributed meaning: under a launcher with several
#: ranks rank 0 runs them, the others wait and exit with its status (and
#: predict's scaling form, TRACE_DIR --np N, below)
RANK0_COMMANDS = ("data", "inspect", "graph", "plan", "plot", "export", "convert", "generate")
#: the tag of rank 0's exit status message
STATUS_TAG = 36
#: whether this process runs a rank-0 command for the whole job
_ALONE = False


def rank0_only(args):
    """Whether ``args`` is a command that rank 0 alone runs under a launcher
    (``predict --calibrate`` measures links and ``bench`` times the composed
    graph on every rank: they stay distributed)."""
    if args.command == "predict":
        return bool(args.nps) and not args.calibrate
    return args.command in RANK0_COMMANDS


def several_ranks():
    """Whether a launcher started several ranks: its count, or -- where it
    gives none (``mpiexec -pmi-port``: PMI_PORT and PMI_ID only) -- MPI's
    world, initialised for this. Before, such a job counted as one rank, and
    each rank ran a rank-0 command alone: ``mpiexec -pmi-port -n 2 ... data
    digits --out F`` wrote F twice at once."""
    if launched_size() > 1:
        return True
    if not size_untold():
        return False
    from .comm.mpi_init import import_mpi
    return import_mpi().COMM_WORLD.Get_size() > 1


def main(argv=None):
    global _ALONE
    args = build_parser().parse_args(argv)
    if args.debug:
        os.environ["PURINE_DEBUG"] = "1"
    # a NaN or inf is reported once, as such (a diverged run, non-finite
    # weights or data), not as NumPy's RuntimeWarning lines before it
    warnings.filterwarnings("ignore", category=RuntimeWarning,
                            message=r"(overflow|invalid value|divide by zero|underflow) "
                                    r"encountered")
    _ALONE = rank0_only(args) and several_ranks()
    if not _ALONE:
        status = _run(args)
        if args.command == "train":  # the run is over: a late notice must not kill the exit
            from .runtime.stop import StopSignal
            StopSignal.ignore_late_notices()
        logfile.end_run(status)  # train.log's last line, where a run folder has one
        if args.command == "train":
            # MPI_Finalize now, where a stop notice still ends a rank whose
            # peer never finalizes (with this status; every file is written)
            from .comm.world import finalize_mpi
            finalize_mpi(status)
        return status
    # what every rank finds alike (a PURINE_* variable) ends every rank at
    # once, rank 0 saying why
    status = _run(args, lambda _: 0)
    if status != 0:
        return status
    from .comm.launcher import mismatch
    # a launcher the MPI library cannot join leaves each rank alone in its
    # world: rank 0's own status is then the launcher's answer
    shared = mismatch() is None
    if launched_rank() != 0:
        import signal
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to answer (130)
        return _share_status(None) if shared else 0
    try:  # rank 0 reaches the status exchange whatever its command does
        status = _run(args)
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # a bug: its traceback, as Python prints it, and 1
        import traceback
        traceback.print_exc()
        status = 1
    return _share_status(status) if shared else status


def _run(args, action=None):
    try:
        env.check_all()  # every PURINE_* variable, before anything reads one (base/env.py)
        return (action or COMMANDS[args.command])(args) or 0
    except UserError as exc:
        if isinstance(exc, InitMismatch) and args.command != "train":
            exc = exc.for_weights()  # --init-skip is train's: no way out here
        from .job.config import blame_override  # a key --set wrote: name the --set
        exc = blame_override(exc, getattr(args, "config", None), getattr(args, "overrides", None))
        _report_user_error(exc)
        return exc.exit_code  # 2; 3 for non-finite weights
    except OpError as exc:  # an op that found a user error while running (a data file)
        if not isinstance(exc.cause, UserError):
            raise
        _report_user_error(exc.cause)
        return exc.cause.exit_code
    except KeyboardInterrupt:  # Ctrl-C in another command than train, or before its run
        if not _ALONE and _early_abort.several_launched():  # one rank's end is the job's
            _early_abort.interrupted()  # (a peer in MPI_Init or a start-up collective waits)
        from .runtime.stop import print_err
        if launched_rank() == 0:
            print_err("interrupted")
        return 130
    except BrokenPipeError:  # output piped into `head` and the like: not a success
        from .runtime.stop import print_err, stdout_to_devnull
        stdout_to_devnull()
        if launched_rank() == 0:  # stderr may be the closed pipe too (2>&1 | head)
            print_err("error: stdout was closed (broken pipe) before all the output was written")
        return 141


def _share_status(status):
    """Rank 0 sends its exit status to every other rank, which waits for it
    (``status`` None) and returns it; MPI is initialised only for this, after
    rank 0's command. A waiting rank has no timeout: rank 0 works alone, and
    should it die, the launcher ends the job."""
    import time
    from .comm.mpi_init import import_mpi
    comm = import_mpi().COMM_WORLD
    if comm.Get_rank() == 0:
        requests = [comm.isend(status, dest=r, tag=STATUS_TAG) for r in range(1, comm.size)]
        deadline = time.monotonic() + 60.0  # a rank that died since needs no answer
        while not all(r.Test() for r in requests) and time.monotonic() < deadline:
            time.sleep(1e-3)
        return status
    pause = 1e-3
    while not comm.Iprobe(source=0, tag=STATUS_TAG):
        time.sleep(pause)  # an idle wait: the cores are rank 0's
        pause = min(pause * 2, 0.05)
    return comm.recv(source=0, tag=STATUS_TAG)


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
    # (a launcher that gives no size, mpiexec -pmi-port, may have started
    # several: before, rank 1's own error there was said by nobody, and
    # rank 0 waited for it until killed)
    if not _ALONE and not getattr(exc, "before_mpi", False) and (
            launched_size() > 1 or size_untold()
            or (mpi is not None and mpi.Is_initialized())):
        from .comm.world import report_user_error
        report_user_error(exc)  # returns only on a single rank
    if launched_rank() == 0:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        logfile.note_error(f"error: {exc}")



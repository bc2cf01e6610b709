"""The trainer: this rank's loop assembled from a job.

``Trainer(job, out_dir, world, ...)`` builds this rank's composed and
placed graphs (``parallel.rank_graphs.build_rank_graphs``) before the loop
exists, their dispatchers and workspaces (memory plans), the list of
services, and restores the weights; ``train/loop.py`` runs the iterations
and asks the services. ``run_training`` is the ``train`` command's entry.

Every rank runs the same loop over its own slice of the composed graph. The
only collectives outside the graph are the scalar reductions for logging and
evaluation, the stop agreement after each iteration and the checkpoint
gathers, made by every rank at the same iterations, so their order is the
same everywhere; each is a non-blocking request polled under the stall
timeout (``World.wait``). Only rank 0 writes files.
"""
import json
import math
import os
import sys
import time

from ..base import logfile
from ..base.runfiles import write_text_replacing
from ..base.rss import peak_rss_bytes, preload_deferred_imports, rss_bytes, warm_up_libraries
from ..job.checkpoint_file import LATEST, Checkpoint
from ..job.inputs import run_inputs
from ..job.run_checkpoints import (remove_stale_calibration_folders, remove_stale_temp_files,
                                   resolve_resume)
from ..job.config import dump_config
from ..job.data_spec import data_notes
from ..job.job import job_of, precision_notes
from ..job.config import solver_notes
from ..parallel.compose import scheme_of, settings_without_effect
from ..parallel.rank_graphs import build_rank_graphs
from ..runtime.factory import make_dispatcher, planned_workspace
from ..runtime.footprint import planned_figures, shared_params, test_room, workspace_plans
from ..runtime.stop import StopSignal, print_err, print_or_stop
from .checkpoints import Checkpoints
from .collectives import get_world, world_gather
from .divergence import DivergenceWatch
from .evaluation import Evaluation
from .loop import Loop
from .loss_scale import LossScaleLog
from .progress import Progress
from .signals import StopAgreement
from .startup import StartupReport
from .profiling import Traces
from .watch import BestCheckpoints, EarlyStopping


class Trainer(Loop):
    """A ``Loop`` assembled from a job for this rank of ``world``."""

    def __init__(self, job, out_dir, world=None, resume=None, init=None, profile=False,
                 log=None, dispatcher=None, init_skip=(), scheme=None, tensorboard=False,
                 agreement=None, memory=None, test_reads=None, trace_epoch=None):
        created = time.perf_counter()  # the start-up block reports the set-up time
        world = world or get_world()
        # collectives outside the graph wait no longer than graph ops do
        world.stall_timeout = float(job.parallel.stall_timeout)
        # the job's registered scheme: its capabilities are its own (a bare
        # stand-in has none: reading one raises, schemes/base.Capability;
        # its class defaults once made scheme none's ranks count their
        # labels together)
        scheme = scheme or scheme_of(job)
        log = log or print_or_stop  # a closed stdout stops the run like SIGTERM
        try:
            graphs = build_rank_graphs(job, world, scheme)
            # the memory plans, made once: counted by the start-up check
            # (``memory(job, graphs, plans, world)``: the CLI's, tools/plan.py
            # check_memory with train's limits), then laid out
            # test_reads: what predict reads of the test graph (runtime/footprint.py)
            plans = workspace_plans(graphs, job.memory_plan, test_reads)
            self.memory_plans = plans  # model_state's working set
            # the footprint the check counted (tools/plan.check_memory: plan's
            # figures for this rank), for the start-up block and memory.json
            self.planned = None
            if memory is not None:  # resume: the Checkpoint read, held until restored
                self.planned = memory(job, graphs, plans, world, init=init, resume=resume)
            # a parameter-server run's workers: the time origin of every rank
            traces = Traces(profile, out_dir, world, epoch=trace_epoch)
            runners = _dispatchers(graphs, job, world, dispatcher, traces.profiler,
                                   lambda m: log(m) if world.rank == 0 else None, plans)
            self.checkpoints, self.evaluation = Checkpoints(), Evaluation()
            services = self._services(job, out_dir, created, tensorboard, traces,
                                      agreement or StopAgreement())
            super().__init__(graphs, *runners, job=job, out_dir=out_dir, world=world,
                             scheme=scheme, log=log, services=services)
            if world.rank == 0:
                for path in remove_stale_temp_files(out_dir):
                    self.log(f"removed {path}, left by a writer that was killed mid-write")
                for path in remove_stale_calibration_folders(out_dir):
                    self.log(f"removed {path}, left by a calibration run that was killed")
            self.checkpoints.restore(self, init, init_skip, resume)
            if init is not None or resume is not None:  # the divergence message names it
                self.state.weights_from = (f"--init {init}" if init is not None else
                                           f"the checkpoint {getattr(resume, 'path', resume)}")
        except BaseException:  # a refused checkpoint, bad test data, ...
            self._settle_readers()
            raise

    def _services(self, job, out_dir, created, tensorboard, traces, agreement):
        """The loop's services, in the order the loop asks them (train/loop.py).
        ``agreement``: the stop agreement (a parameter-server worker's:
        train/ps_worker.py)."""
        best, early = job.checkpoint.best, job.solver.early_stop
        return [StartupReport(created),
                agreement,
                DivergenceWatch(),
                LossScaleLog(),
                Progress(tensorboard),
                self.evaluation,
                # early stopping first: a best checkpoint holds its decision on the pass
                *([EarlyStopping(early, self.say)] if early else []),
                *([BestCheckpoints(best, out_dir, lambda path, it: self.save(it, path),
                                   self.say)] if best else []),
                self.checkpoints,
                traces]

    def _settle_readers(self, timeout=30.0):
        """Wait for the data readers' in-flight prefetch: their daemon threads
        read HDF5 files, and one left mid-read (holding h5py's lock) when an
        error ends the process would hang the interpreter's exit."""
        for d in (getattr(self, "train", None), getattr(self, "test", None)):
            for k in getattr(d, "kernels", {}).values():
                pending = getattr(k, "_pending", None)
                if pending is not None:
                    pending[1]["done"].wait(timeout)

    # the services' operations that tools and tests call on a trainer
    def model_state(self):
        """{weights, gradients, optimizer_state, held, working, peak: bytes}
        of this rank's model state (runtime/footprint.model_state_bytes, the
        working set's peak from the memory plans the workspace is laid out
        by, the host's and each GPU's, as ``plan`` counts it; the schemes'
        start-up lines read it here, below the runtime layer)."""
        from ..runtime.footprint import model_state_bytes
        plans = getattr(self, "memory_plans", None)
        return model_state_bytes(self.graphs.graph, plans and
                                 [plans.host, *plans.devices.values()])

    def save(self, iteration, path=None):
        self.checkpoints.save(self, iteration, path)

    def state_dict(self):
        return self.checkpoints.state_dict(self)

    def load_state_dict(self, state):
        self.checkpoints.load_state_dict(self, state)

    def evaluate(self, test_iter=None):
        return self.evaluation.evaluate(self, test_iter)


def _dispatchers(graphs, job, world, dispatcher, profiler, say, plans):
    """The training graph's dispatcher and the test graph's (or None). With
    ``memory_plan`` (the default) the transient blobs of each share one
    arena per device (the host, each GPU), laid out from the static graph
    (runtime/memory_plan.py); what the host reads between iterations keeps
    its own memory, and the test graph reuses the training graph's host
    arena when it fits (the two never run at once). On a GPU each iteration is replayed as captured CUDA graphs
    unless ``cuda_graph: false``."""
    planned, cuda_graph = job.memory_plan, job.cuda_graph
    # the ranks of a tensor-parallel group draw the same random streams (the
    # dropout of their replicated activations must agree)
    seed = job.seed * 1000003 + world.rank // graphs.layout.tensor
    stall = float(job.parallel.stall_timeout)

    def workspace(graph, keep=(), shared=None, arena=None, made=None, room=None):
        return planned_workspace(graph, planned, keep=keep, shared=shared, arena=arena,
                                 plans=made if planned else None, room=room)

    g = graphs.graph
    train = make_dispatcher(g, dispatcher, rank=world.rank, cuda_graph=cuda_graph, log=say,
                            defer_tail=graphs.defer_update,
                            workspace=workspace(g, plans.keep, made=(plans.host, plans.devices),
                                                room=test_room(plans) if planned else None),
                            profiler=profiler, stall_timeout=stall, seed=seed)
    test = None
    if graphs.test_graph is not None:
        tg, ws = graphs.test_graph, train.workspace
        shared = {p: ws[p] for p in shared_params(graphs)}
        # the test pass's transfers (stages, tensor shards, stage-3 gathers)
        # wait no longer than the training's: it had the dispatcher's default,
        # 300 s, whatever parallel.stall_timeout said
        test = make_dispatcher(tg, dispatcher, rank=world.rank, cuda_graph=cuda_graph, log=say,
                               workspace=workspace(tg, plans.test_keep, shared, arena=ws,
                                                   made=(plans.test_host, plans.test_devices)),
                               stall_timeout=stall, seed=seed)
    return train, test


def run_training(config, out_dir, resume=None, init=None, profile=False, dispatcher=None,
                 init_skip=(), tensorboard=False, memory=None, notes=()):
    """Entry point of ``train``: set up the world, check that every rank has
    the same config, and run the scheme the config asks for. ``config``: a
    job (job/job.py) or a validated config dict: the public Python API, an
    edge where a config becomes a job (docs/config.md, "Custom layers").
    ``notes``: rank 0's lines for the start-up block (the choice of
    ``parallel.scheme: auto``)."""
    from ..comm.world import install_abort_handler
    StopSignal.new_run()  # nothing of an earlier run of this process (a cancel, its waits)
    job = job_of(config)  # once: everything below reads the job
    world = get_world()
    install_abort_handler(world)
    world.stall_timeout = float(job.parallel.stall_timeout)
    # the baseline of memory.json: after MPI's initialisation, the imports
    # the run would otherwise make later (base/rss.DEFERRED_IMPORTS) and a
    # first run of the libraries' code (base/rss.warm_up_libraries), before any graph
    preload_deferred_imports()
    warm_up_libraries()
    baseline = rss_bytes()
    # rank 0's lines, and any rank's errors, go to OUT/train.log too (base/logfile.py)
    logfile.open_run_log(out_dir, world.rank)
    say = logfile.tee(print_or_stop)
    # the start-up agreement: every input that shapes the run, in one
    # allgather (job/inputs.py); --resume is read once, here
    read_here = not isinstance(resume, Checkpoint)
    resume = resolve_resume(out_dir, resume, say if world.rank == 0 else None, init)
    if resume is not None and read_here:  # its arrays go once the weights are set
        resume.transient = True
    world.check_agreed(run_inputs(dump_config(job), job, init, init_skip, resume))
    if world.rank == 0:  # parallel settings that do nothing at this world size
        for note in tuple(notes) + tuple(settings_without_effect(job, world.size)) + \
                tuple(data_notes(job)) + tuple(precision_notes(job)) + \
                tuple(solver_notes(job)):
            say(note)
    if world.size > 1 and job.parallel.servers:
        return run_param_server(job, out_dir, world, resume=resume, init=init,
                                profile=profile, dispatcher=dispatcher, init_skip=init_skip,
                                tensorboard=tensorboard, memory=memory, baseline=baseline)
    return run_and_report(Trainer(job, out_dir, world, resume=resume, init=init,
                                  profile=profile, dispatcher=dispatcher, init_skip=init_skip,
                                  tensorboard=tensorboard, log=say, memory=memory),
                          world, baseline)


def run_param_server(job, out_dir, world, resume=None, init=None, profile=False,
                     dispatcher=None, log=None, init_skip=(), tensorboard=False, memory=None,
                     baseline=None):
    """``train`` on every rank of a parameter-server run: servers serve
    (train/ps_server.run_server_rank), workers train a Trainer over the
    workers' World (metrics and checkpoints from rank 0, a worker).
    ``dispatcher`` runs the workers' graphs and a sync_ps server's (an
    async server runs no graph). Returns the exit status."""
    from ..parallel.param_server import WorkerScheme, split_workers
    from .ps_server import run_server_rank
    from .ps_worker import WorkerStopAgreement
    from .profiling import trace_epoch
    job, sub = split_workers(job, world)
    # traced runs: one time origin for workers and servers (one allreduce of
    # the whole world, on every rank: ``profile`` is every rank's)
    epoch = trace_epoch(world) if profile else None
    if sub is None:
        status = run_server_rank(job, out_dir, world, resume=resume, init=init,
                                 init_skip=init_skip, dispatcher=dispatcher, memory=memory,
                                 baseline=baseline, profile=profile, trace_epoch=epoch)
    else:
        status = run_and_report(Trainer(job, out_dir, world=sub, resume=resume, init=init,
                                        profile=profile, log=log, dispatcher=dispatcher,
                                        init_skip=init_skip, scheme=WorkerScheme(job, world),
                                        agreement=WorkerStopAgreement(job, world),
                                        tensorboard=tensorboard, memory=memory,
                                        trace_epoch=epoch),
                                world, baseline)
    return agreed_status(world, status)


def agreed_status(world, status):
    """The exit status every rank of ``world`` ends with: the highest of
    theirs (one allreduce, the last collective of every rank's run, under
    the stall timeout). A parameter-server run's servers know only the stop
    agreement's outcome; what the workers found at the end (a non-finite
    last test pass: 3) is theirs alone, so without this a server ended 0
    where the workers ended 3."""
    import numpy as np
    return int(world.allreduce(np.array([status], np.int64), "max",
                               what="the ranks' exit status (allreduce)")[0])


def write_memory(trainer, baseline):
    """OUT/memory.json on rank 0: each rank's resident bytes before its
    graphs were built (``baseline_rss_bytes``), at their high-water mark
    (``peak_rss_bytes``) and the difference (``above_baseline_bytes``: what
    ``plan``'s host total predicts), the high-water mark after the last
    iteration, before the end's test pass and checkpoint
    (``loop_peak_rss_bytes``: None when the run stopped early; a sharded
    checkpoint streams every rank's shards to rank 0, a bucket at a time),
    then the pages of other ranks' shared-window regions resident in this
    rank (``peer_window_bytes``, comm/windows.peer_window_resident_bytes:
    in its resident bytes and in their owner's, counted by ``plan`` on the
    owner only; None when the run stopped early) and the rank's model state from its
    memory plan (``model_state``: ``Trainer.model_state``'s weights,
    gradients, optimizer state, held, working and peak bytes, the start-up
    line's figures) and the host rows train's start-up check counted
    (``planned``: ``planned_figures``, ``plan``'s for this rank, its
    ``total`` the need ``above_baseline_bytes`` is set against), to set the
    measured bytes against the planned ones (benchmarks/sharded.py
    ``--rss``). A gather over the trainer's world; in
    a parameter-server run the servers' figures follow the workers' (without
    ``model_state``: ``"server": true``)."""
    peak = peak_rss_bytes()
    mine = {"rank": trainer.world.rank, "baseline_rss_bytes": baseline,
            "peak_rss_bytes": peak,
            "above_baseline_bytes": None if baseline is None else peak - baseline,
            "loop_peak_rss_bytes": trainer.state.loop_peak_rss,
            "peer_window_bytes": trainer.state.loop_peer_window,
            "model_state": {k: int(v) for k, v in trainer.model_state().items()},
            "planned": planned_figures(getattr(trainer, "planned", None))}
    every = world_gather(trainer.world, mine, "the ranks' memory figures")
    if trainer.world.rank == 0:
        # a parameter-server run's servers send theirs (ps_server.run_server_rank)
        servers = (getattr(trainer.scheme, "ranks", None) or {}).get("servers", ())
        if servers:
            from .async_server import MEMORY_TAG
            every += [trainer.scheme.world.recv_object(s, MEMORY_TAG, "a server's memory "
                                                       "figures") for s in servers]
        # by a rename over the name: never through a link there
        write_text_replacing(os.path.join(trainer.out_dir, "memory.json"),
                             json.dumps({"ranks": every}, indent=1))


def _last_finite(last, out_dir):
    """What a diverged run says of its checkpoints: the newest one known
    finite (weights and solver state, RunState.last_finite), by name."""
    if last is None:
        return "no checkpoint was written"
    path, iteration = last
    same = os.path.abspath(path) == os.path.abspath(os.path.join(out_dir, LATEST))
    name = LATEST if same else f"'{path}'"
    return f"{name} stays the last finite checkpoint (iteration {iteration})"


def run_and_report(trainer, world, baseline=None):
    """Run ``trainer`` to the end, print the final figures on global rank 0,
    and return the exit status. ``baseline``: this rank's resident bytes
    before the graphs were built (``write_memory``)."""
    try:
        result = trainer.run()
    finally:
        trainer.close()
    write_memory(trainer, baseline)
    # train.log's last line (logfile.end_run)
    logfile.set_outcome(result, trainer.job.solver.max_iter, trainer.state.start_iter)
    if "diverged_at" in result:
        if world.rank == 0:
            kept = _last_finite(result.get("last_checkpoint"), trainer.out_dir)
            start = result.get("start_iter") or 0
            if result.get("initial_loss") and start:  # a resumed run's weights came from
                # updates at the rate: the advice on the rate stands
                text = (f"error: the training diverged: a non-finite loss (NaN or inf) at "
                        f"iteration {result['diverged_at']}, the first of this run, resumed "
                        f"from {trainer.state.weights_from} (iteration "
                        f"{start}, its weights made by {start} updates); {kept}. Lower "
                        f"solver.base_lr (resuming from an earlier checkpoint) or check the "
                        f"data.")
            elif result.get("initial_loss"):  # before any update: not the rate's doing
                text = (f"error: the loss is non-finite (NaN or inf) at the first iteration "
                        f"of the run (iteration {result['diverged_at']}), before any update: "
                        f"the initial weights (from "
                        f"{trainer.state.weights_from}) give a "
                        f"non-finite loss on the data, which no lower solver.base_lr changes; "
                        f"{kept}. Check those weights (their scale) and the data.")
            else:
                text = (f"error: the training diverged: a non-finite loss or weight (NaN or "
                        f"inf) at iteration {result['diverged_at']}; {kept}. Lower "
                        "solver.base_lr or check the data.")
            print(text, file=sys.stderr, flush=True)
            logfile.note_error(text)
        return 3
    if world.rank == 0 and result:
        logfile.tee(print_or_stop)("final " + json.dumps({k: (round(v, 6) if math.isfinite(v) else None)
                                             if isinstance(v, float) else v
                                             for k, v in result.items()}))
    # the last test pass overflowed (train/evaluation.py): its figures are
    # not a result, and the run does not end as a good one (``test``'s exit 3)
    if logfile.non_finite_figures(result) and not result.get("stopped_by"):
        if world.rank == 0:
            kept = _last_finite(trainer.state.last_finite, trainer.out_dir)
            at = result.get("early_stop") or trainer.job.solver.max_iter
            text = (f"error: the test pass at iteration {at} gave non-finite figures (NaN "
                    "or inf) on finite weights: the forward pass overflowed on the test "
                    f"data, so no figure is a result; {kept}. Check the test data, or lower "
                    "solver.base_lr.")
            print(text, file=sys.stderr, flush=True)
            logfile.note_error(text)
        return 3
    # a stop on SIGTERM, Ctrl-C or a closed stdout still ends non-zero (143,
    # 130, 141); SIGUSR1 is a request to checkpoint and finish: 0
    stopped = result.get("stopped_by")
    if stopped in ("SIGPIPE", "SIGINT") and world.rank == 0:
        why = "error: stdout was closed (broken pipe)" if stopped == "SIGPIPE" else \
            "interrupted (Ctrl-C)"
        text = (f"{why}: stopped at iteration {result.get('iter')} with a checkpoint; "
                "continue with --resume auto")
        print_err(text)
        logfile.note(text)
    return StopSignal.exit_status(stopped)

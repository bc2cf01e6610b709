"""Checkpoints (a loop service) and the weights they hold: initialisation
(fillers, ``--init`` HDF5, .caffemodel or GPT-2's .safetensors), the run's checkpoints (at the
interval, on a stop, at the end; rotation), checkpoints of their own (the
best ones, watch.py), resume (validated as a whole first) and the per-rank
state a resume needs. It reads the loop's graphs, workspace and world.
"""

import os

import numpy as np

from ..base.backend import to_numpy
from ..base.errors import GraphError, InitMismatch, UserError
from ..comm.world import remove_mpi_shm
from ..graph.grad import trained
from ..graph.solver_graph import solver_states, state_name
from ..job.checkpoint_file import LATEST, load_params, remove_temp_files, save_checkpoint
from ..job.run_checkpoints import remove_replaced_best, resolve_resume, save_run_checkpoint
from ..job.checkpoint_check import (saved_config, changed_data_note, changed_net_note,
                                    check_finite, check_for_net, check_same_meaning,
                                    check_same_vocabulary,
                                    unused_note)
from ..job.config import dump_config
from ..job.replica import init_params, kept_constant, param_layer
from ..parallel.compose import Layout
from ..parallel.schemes import scheme_of
from ..parallel.tensor_parallel import initial_value, whole_shape
from ..base.cancel import Cancel
from ..runtime.stop import StopSignal
from .collectives import _plain, share_running_stats, world_gather
from .loop import Service
from .progress import write_config

# a second Ctrl-C ends the process in the middle of a checkpoint: its temp
# file goes, the checkpoint under its final name is the last complete one
if remove_temp_files not in StopSignal.cleanups:
    StopSignal.cleanups.append(remove_temp_files)
# ... and MPICH's /dev/shm segment goes too: os._exit skips MPI_Finalize
if remove_mpi_shm not in StopSignal.cleanups:
    StopSignal.cleanups.append(remove_mpi_shm)


class Checkpoints(Service):
    """Writes the run's checkpoints; ``restore`` sets the weights before
    the loop runs (fillers, ``--init``, ``--resume``)."""

    # ------------------------------------------------------------- hooks
    def after_iteration(self, loop, done):
        # one checkpoint, also when a stop meets the interval
        st = loop.state
        if done != loop.job.solver.max_iter and (st.stop_code or st.early_stopped is not None
                                                 or loop.due(loop.job.checkpoint.interval, done)):
            self.save(loop, done)

    def on_end(self, loop):
        self.save(loop, loop.job.solver.max_iter)

    # ------------------------------------------------------------- state
    def restore(self, loop, init=None, init_skip=(), resume=None):
        """The weights before the first iteration: fillers, then ``init``
        (weights), then ``resume`` (a checkpoint, or ``"auto"``)."""
        self._init_params(loop, init, init_skip)
        if resume:
            path = self._resume(loop, resume)
            if init and path is not None:  # not silently: the checkpoint's weights won
                loop.say(f"note: --init {init} is not used: the run resumed from {path}, "
                         "whose weights replace it (--init starts a run; beside --resume "
                         "auto it counts only when there is no checkpoint to resume)")

    def _init_params(self, loop, init, init_skip=()):
        scheme = scheme_of(loop.job)
        for p in loop.graphs.params:
            # a tensor-parallel shard: its slice of the whole blob's value; a
            # ZeRO-3 rank: its range of it, into its bucket's shard
            scheme.set_weight(loop.graphs, loop.ws, p,
                              initial_value(loop.graphs.graph.blobs[p], loop.job.seed))
        if init and str(init).endswith(".caffemodel"):
            self._init_from_caffemodel(loop, init, init_skip)
        elif init:
            if str(init).endswith(".safetensors"):  # GPT-2 in Hugging Face's layout
                from ..interop.hf_gpt2 import hf_params
                params, note = hf_params(init, loop.job, init_skip)
            else:
                params = load_params(init)
                note = unused_note(params, loop.graphs.net_params, init)
            wanted = init_params(params, loop.graphs.params, loop.job, init, init_skip)
            # the whole net's (every rank the same verdict), not this rank's; a
            # file holding no vocabulary (.safetensors, another tool's) is not compared
            check_same_vocabulary(init, getattr(loop.graphs, "vocabulary", None), loop.job,
                                  [p for p in loop.graphs.net_params
                                   if param_layer(p) not in set(init_skip)])
            check_finite({p: params[p] for p in wanted}, init)
            if note:
                loop.say(note)
            for p in wanted:
                self._load_blob(loop, p, params[p], init, skip_hint=True)
            skipped = f" ({', '.join(init_skip)} kept fresh: --init-skip)" if init_skip else ""
            loop.say(f"loaded {len(wanted)} blob{'s' if len(wanted) != 1 else ''} from "
                     f"{init}{skipped}")

    def _init_from_caffemodel(self, loop, path, init_skip=()):
        """Caffe weights by layer name. As with our own files every parameter
        must be found, except those of the --init-skip layers and the
        learnable ones the net keeps at a constant (lr_mult 0 and a constant
        filler: the gamma and beta of a BatchNorm without a Scale, which
        Caffe files do not hold)."""
        from ..interop.caffemodel import caffe_params
        skip = set(init_skip)
        shapes = {p: loop.graphs.graph.blobs[p].shape for p in loop.graphs.params
                  if param_layer(p) not in skip}
        values, report, factors = caffe_params(path, shapes)
        check_finite(values, path)
        if loop.world.rank == 0:
            for line in report:
                loop.log(f"{path}: {line}")
        g = loop.graphs
        fixed = {p for p in g.params if kept_constant(g.graph.blobs[p])}
        for p in init_params(dict.fromkeys(set(values) | fixed), g.params, loop.job, path,
                             init_skip):
            if p in values:
                self._load_blob(loop, p, values[p], path)
        for k in loop.train.kernels.values():  # Caffe's running averages go on
            layer = param_layer(k.op.inputs[3]) if k.op.op_type == "BatchNorm" else None
            if layer in factors and getattr(k, "caffe_average", False):
                k.factor = factors[layer]

    def _load_blob(self, loop, name, value, path, skip_hint=False):
        scheme = scheme_of(loop.job)
        value = scheme.split_checkpoint(loop.graphs, name, value)  # this rank's part
        try:
            scheme.set_weight(loop.graphs, loop.ws, name, value)
        except GraphError as e:  # a file from another net: name the file too
            layer = param_layer(name)
            hint = (f"; to start layer '{layer}' afresh instead (fine-tuning a "
                    f"changed layer), give --init-skip {layer}") if skip_hint else ""
            raise InitMismatch(f"{path}: {e}", hint) from None

    def state_dict(self, loop):
        """Everything beyond params and momenta that a resume needs: each
        stateful kernel's state and each random stream, per rank; each
        rank's display window between two rows (its loss sum and
        iterations); the watch services' decisions (train/watch.py: the same
        on every rank)."""
        local = {}
        for name, k in loop.train.kernels.items():
            s = {}
            if k.stateful:
                s["state"] = k.state_dict()
            if k.rng is not None:
                s["rng"] = k.rng.bit_generator.state
            if s:
                local[name] = s
        w = loop.state.window
        window = [w.total(), w.n] if w is not None and w.n else None
        gathered = world_gather(loop.world, (local, window))
        if not gathered:
            return None
        states = [s for s, _ in gathered]
        out = {"ranks": {str(r): s for r, s in enumerate(states)},
               "layout": loop.graphs.layout.as_dict()}
        if any(win is not None for _, win in gathered):
            out["window"] = {str(r): win for r, (_, win) in enumerate(gathered)}
        if loop.state.watch:
            out["watch"] = loop.state.watch
        step0 = {int(k.attrs.get("step0", 0)) for k in _adam_kernels(loop)}
        if step0 - {0}:  # the iteration Adam's moments started at (_resume)
            out["adam_step0"] = max(step0)
        return out

    def load_state_dict(self, loop, state, notes=True, saved_world=None):
        """Per-rank state of a checkpoint. On the layout it was written on
        (ranks, scheme, replicas x stages, micro-batches) each rank takes its
        own, random streams included: the resume is bit-exact. On another
        layout (a job requeued on other nodes, a hybrid run continued on one
        rank) each kernel takes the state of the first kernel of the same
        name, micro-batch copies ``<op>@mb<k>`` counting as ``<op>``: the
        data position carries over (readers convert it to the new global
        batch), but per-rank random streams cannot: they restart from the seed.
        ``saved_world``: the ranks of the run that wrote it (its
        ``world_size``; default: the ranks whose state it holds), said in the
        note on another layout beside this run's ranks (``launched_ranks``)."""
        ranks = state.get("ranks", {})
        saved = state.get("layout")
        same_world = len(ranks) == loop.world.size and (saved is None or
                                                        loop.graphs.layout.same_shape(saved))
        if not ranks or (same_world and str(loop.world.rank) not in ranks):
            raise UserError("the checkpoint holds no per-rank state (ranks: "
                            f"{sorted(ranks) or 'none'})")
        if same_world:
            mine = ranks[str(loop.world.rank)]
            # the display window between two rows (another layout starts a new one)
            loop.state.window_carry = (state.get("window") or {}).get(str(loop.world.rank))
        else:
            mine = {}
            for r in sorted(ranks, key=int):
                for name, s in ranks[r].items():
                    mine.setdefault(name.split("@mb")[0], s)
            if loop.world.rank == 0 and notes:
                was = Layout(**saved).describe() if saved else f"[{len(ranks)} rank(s)]"
                size, servers = launched_ranks(loop)
                workers = f" ({_workers(loop.world.size)}, {servers} parameter server(s))" \
                    if servers else ""
                # a parameter-server run's file holds its workers' states alone
                saved_world = int(saved_world or len(ranks))
                held = f" ({_workers(len(ranks))})" if saved_world > len(ranks) else ""
                loop.log(f"note: resuming a {saved_world}-rank checkpoint{held} on "
                         f"{size} rank(s){workers}, layout {was} -> "
                         f"{loop.graphs.layout.describe()}: the weights and solver state "
                         "load by name, each stage taking its layers'; the data "
                         "order continues at the same sample count; random streams (dropout) "
                         "restart from the seed, so the run is not bit-identical to an "
                         "uninterrupted one")
        for name, k in loop.train.kernels.items():
            s = mine.get(name if same_world else name.split("@mb")[0])
            if s is None:
                continue
            if "state" in s and k.stateful:
                k.load_state_dict(s["state"])
            if same_world and "rng" in s and k.rng is not None:
                k.rng.bit_generator.state = _plain(s["rng"])

    def _resume(self, loop, resume):
        """Load the checkpoint ``resume`` names; returns its path, or None
        where ``"auto"`` found none (a fresh run)."""
        # "auto": latest.h5, else the newest ckpt_<iter>.h5 that loads; or a
        # path; or the Checkpoint the ranks agreed on (trainer.run_training)
        ck = resolve_resume(loop.out_dir, resume, loop.say)
        if ck is None:
            return
        path = ck.path
        # the whole checkpoint is checked against the net before any of it is loaded
        params = loop.graphs.params
        scheme = scheme_of(loop.job)
        held = {key: np.broadcast_to(np.zeros((), dtype=dtype), shape)
                for key, (shape, dtype) in scheme.whole_solver_shapes(loop.graphs).items()}
        check_for_net(ck, path, loop.graphs.net_params, {p: _whole(loop, p, p) for p in params},
                      {**{(p, s): _whole(loop, p, state_name(p, s)) for p in params
                          for s in solver_states(loop.job.solver.type)
                          if state_name(p, s) in loop.ws.arrays}, **held})
        check_same_meaning(ck.attrs.get("config"), loop.job.net, path, what="checkpoint")
        check_same_vocabulary(path, getattr(loop.graphs, "vocabulary", None), loop.job,
                              loop.graphs.net_params, resume=True)
        changed = changed_net_note(ck.attrs.get("config"), loop.job.net, path)
        if changed:
            loop.say(changed)
        moved = changed_data_note(ck.attrs.get("config"), loop.job.data, path)
        if moved:
            loop.say(moved)
        fresh = set()  # (param, state) the file lacks: started from zero
        states = solver_states(loop.job.solver.type)
        for p in loop.graphs.params:
            self._load_blob(loop, p, ck.params[p], path)
            for s in states:
                m = state_name(p, s)
                if m not in loop.ws.arrays:
                    continue
                if s in ck.solver.get(p, {}):
                    self._load_blob(loop, m, ck.solver[p][s], path)
                else:
                    fresh.add((p, s))
        fresh |= scheme.load_held_solver_state(loop.graphs, loop.ws, ck.solver)
        # a state no parameter of the file holds: another solver type wrote it
        # (else a parameter frozen there, lr_mult 0, has none: ``trained``)
        other_type = {s for s in states if not any(s in ck.solver.get(p, {})
                                                   for p in loop.graphs.params)}
        blobs = loop.graphs.graph.blobs
        unread = sorted(p for p in loop.graphs.params
                        if ck.solver.get(p) and p in blobs and not trained(blobs[p]))
        # no update made yet (a parameter-server run's --iters 0: the servers'
        # momenta never reached rank 0): read before ck.loaded() empties solver
        before_update = int(ck.attrs["iteration"]) == 0 and not any(
            ck.solver.get(p) for p in loop.graphs.params)
        missing = {s for _, s in fresh} & other_type
        ck.loaded()  # a checkpoint the run read itself lets its arrays go
        if unread:
            loop.say(f"note: {path}'s solver state of {len(unread)} parameter(s) "
                     f"({', '.join(unread[:4])}{' ...' if len(unread) > 4 else ''}) is not "
                     "used: frozen (lr_mult 0) in this run, they have none (nor will its "
                     "checkpoints)")
        if missing and before_update:   # not another solver's
            loop.say(f"note: {path} was written at iteration 0, before any update, and holds "
                     f"no '{', '.join(sorted(other_type))}' solver state; that state starts "
                     "from zero, as it would have in the run that wrote it")
        elif missing:
            loop.say(f"note: {path} holds no '{', '.join(sorted(other_type))}' solver state "
                     f"for solver type {loop.job.solver.type!r}; that state starts from zero")
        frozen_there = sorted({p for p, s in fresh if s not in other_type})
        if frozen_there:
            loop.say(f"note: {path} holds no solver state for {len(frozen_there)} "
                     f"parameter(s) ({', '.join(frozen_there[:4])}"
                     f"{' ...' if len(frozen_there) > 4 else ''}): frozen (lr_mult 0) in the "
                     "run that wrote it; their state starts from zero")
        # a finished run resumed: "already finished" (train/loop.py) is all there
        # is to say, so the notes on a changed world are left out
        notes = not finished_run(loop, int(ck.attrs["iteration"]))
        if ck.state:
            self.load_state_dict(loop, ck.state, notes, ck.attrs.get("world_size"))
        self._adam_step0(loop, ck, missing)
        st = loop.state
        # what the test passes decided (train/watch.py); the best files are
        # the checkpoint's folder's: another folder starts its own best list
        st.watch = dict((ck.state or {}).get("watch") or {})
        if os.path.realpath(os.path.dirname(os.path.abspath(path))) != \
                os.path.realpath(os.path.abspath(loop.out_dir)):
            st.watch.pop("best", None)
        st.start_iter = int(ck.attrs["iteration"])
        st.elapsed0 = float(ck.attrs.get("elapsed", 0.0))
        st.run_id = str(ck.attrs.get("run_id") or "") or st.run_id
        st.last_saved = st.start_iter
        Cancel.last_checkpoint = st.start_iter
        st.last_finite = (path, st.start_iter)  # check_for_net: weights, solver state
        loop.say(f"resumed from {path} at iteration {st.start_iter}")
        # scheme none: a save writes rank 0's replica alone, so every replica
        # goes on from it (not silently: the train rows, the ranks' mean, are
        # then not the uninterrupted run's; the test rows, rank 0's, are)
        # (RankGraphs.apart: the scheme's replicas train apart, Scheme.trains_apart)
        if getattr(loop.graphs, "apart", False) and notes:
            loop.say(f"note: scheme none: {path} holds one replica's weights and solver state "
                     f"(rank 0's, as every save), so each of the {loop.graphs.layout.replicas} "
                     "replicas "
                     "resumes from it; the others' own were never saved, and the train rows "
                     "(the ranks' mean loss) are not those of an uninterrupted run (the test "
                     "rows, rank 0's replica, are)")
        # another seed changes the run's random streams from here: the epoch
        # under way goes on in another permutation (not silently)
        note = _seed_note(ck, path, loop.job)
        if note and notes:
            loop.say(note)
        # the ranks the user launched (a parameter-server run's servers too),
        # as the file counts them: its world_size is the writing run's
        size, servers = launched_ranks(loop)
        saved_world = int(ck.attrs.get("world_size", size) or size)
        # the global batch the file's data position was counted in (its
        # reader's /state), against this run's: a changed one is said,
        # whatever the number of ranks (an unchanged one on another number
        # of ranks -- the batch per rank set to keep it, a pipeline of
        # another stage count -- is not a change)
        batches = _global_batches(loop, ck.state)
        changed = batches[0] != batches[1] if batches else saved_world != size
        if changed and loop.job.data.train is not None and notes:
            b, replicas = loop.job.train_batch, loop.graphs.data_size
            was = f" with a global batch of {batches[0]}" if batches else ""
            each = "worker" if servers else "rank"  # the ranks that read data
            if not batches:
                keep = "(keep the global batch with --set data.train.batch_size=G/N)"
            elif batches[0] % replicas == 0:
                keep = ("(keep the global batch with --set "
                        f"data.train.batch_size={batches[0] // replicas})")
            else:  # no batch per rank keeps it on this many replicas
                keep = f"({batches[0]} does not split into {replicas} equal batches per {each})"
            workers = f" ({_workers(replicas)}, {servers} parameter server(s))" if servers else ""
            loop.say(f"note: {path} was written by {saved_world} rank(s){was}, this run has "
                     f"{size}{workers}: the global batch is now {loop.job.global_batch(replicas)} "
                     f"({b} per {each} x {replicas}); the data order goes on at the same "
                     "sample, but the learning-rate schedule counts iterations, not samples "
                     + keep)
        return path

    @staticmethod
    def _adam_step0(loop, ck, fresh):
        """Adam's step counts the updates its moments have seen, as a fresh
        torch optimizer's state does: moments started from zero by this
        resume (a checkpoint of another solver type) count from its
        iteration (less the steps fp16's loss scaling skipped before it, which
        the step blob already leaves out); moments resumed count from where
        the checkpoint's did (``adam_step0``, 0 when it has none), also the
        moments of a parameter frozen in the checkpoint's run (none saved:
        they start from zero, the one step count goes on)."""
        kernels = _adam_kernels(loop)
        if not kernels:
            return
        if fresh & {"m", "v"}:
            scaler = [k for k in loop.train.kernels.values()
                      if k.op.op_type == "LossScaleUpdate"]
            step0 = int(ck.attrs["iteration"]) - (
                scaler[0].state_dict()["skipped_steps"] if scaler else 0)
        else:
            step0 = int((ck.state or {}).get("adam_step0", 0))
        for k in kernels:
            k.attrs["step0"] = step0
        if step0 and loop.world.rank == 0 and fresh & {"m", "v"}:
            loop.say(f"note: {loop.job.solver.type}'s step count (its bias correction) "
                     f"starts at 1 with its moments at iteration {int(ck.attrs['iteration'])}")

    def save(self, loop, iteration, path=None):
        """The run's checkpoint of ``iteration`` (ckpt_<iter>.h5, latest.h5,
        rotation), or with ``path`` a checkpoint file of its own. Collective:
        rank 0 writes, and the others wait for its write to end in a barrier
        of its own, so a write longer than ``parallel.stall_timeout`` (a slow
        file system) is named as such, not as the next collective's stall
        (the stop agreement's, blaming a peer that 'stopped responding')."""
        self._save(loop, iteration, path)
        if loop.world.size > 1:
            name = os.path.basename(path or f"ckpt_{int(iteration)}.h5")
            # the others' wait is not ended by a cancel: rank 0's write may be
            # the cancel's own checkpoint; rank 0's own (written) is, and it
            # waits for its peers (named as any collective's)
            writer = loop.world.rank == 0
            loop.world.barrier(
                f"the wait for rank 0's write of the checkpoint {name}",
                None if writer else "rank 0 is still writing it (a slow file system: raise "
                "parallel.stall_timeout), or it stopped responding", cancellable=writer)
        if path is None:
            Cancel.last_checkpoint = int(iteration)

    def _save(self, loop, iteration, path=None):
        loop.train.drain()  # the weights of this iteration, updated
        loop.emit("before_save", iteration)  # e.g. the servers' momenta (ps_worker.py)
        share_running_stats(loop)  # scheme none: each replica keeps its own
        if path is None:
            loop.state.last_saved = iteration
        state = self.state_dict(loop)
        # whole blobs on file (shards, stages): streamed to rank 0 parameter
        # by parameter or bucket by bucket as the file is written
        params, solver = scheme_of(loop.job).checkpoint_sections(
            loop.graphs, loop.ws, loop.world, lambda: self._held(loop))
        if loop.world.rank != 0:
            with Cancel.waiting_for_rank0():  # rank 0 writes as it gathers: not a stall
                for section in (params, solver):  # a streamed section's collectives
                    for _ in section.items():
                        pass
            loop.emit("after_save", iteration)
            return
        payload = dict(params=params, solver=solver, state=state,
                       world_size=launched_ranks(loop)[0],
                       seed=loop.job.seed, config_text=dump_config(loop.job),
                       run_id=loop.state.run_id, elapsed=loop.elapsed(),
                       tokenizer=getattr(loop.graphs, "vocabulary", None))
        if path is not None:  # a checkpoint of its own (checkpoint.best): no rotation
            save_checkpoint(path, iteration=iteration, **payload)
            loop.emit("after_save", iteration)
            return
        replaced = []
        save_run_checkpoint(loop.out_dir, iteration, loop.job.checkpoint.keep, replaced,
                            **payload)
        if loop.state.start_iter:  # a resumed run: what the continuation it replaces wrote
            best = ((state or {}).get("watch") or {}).get("best") or {}
            replaced += remove_replaced_best(loop.out_dir, loop.state.run_id, loop.state.start_iter,
                                             [name for _, _, name in best.get("kept", [])])
        if replaced:
            loop.say(f"removed {', '.join(os.path.basename(p) for p in replaced)}: written after "
                     f"iteration {loop.state.start_iter} by the run this resume replaces")
        loop.state.last_finite = (os.path.join(loop.out_dir, LATEST), iteration)
        loop.emit("after_save", iteration)  # e.g. the servers' momenta let go (ps_worker.py)
        if loop.state.metrics is not None and loop.state.start_iter:
            loop.state.metrics.commit()  # the resumed run's rows and config replace the old ones
            write_config(loop)


    @staticmethod
    def _held(loop):
        """This rank's (params, solver) part: the parameters, or the blobs
        holding its part of them (``held_weights``: a ZeRO-3 rank's weight
        shards), and their per-parameter solver state."""
        params = {p: to_numpy(loop.ws[p]) for p in scheme_of(loop.job).held_weights(loop.graphs)}
        states = solver_states(loop.job.solver.type)
        solver = {p: {s: to_numpy(loop.ws[state_name(p, s)]) for s in states
                      if state_name(p, s) in loop.ws.arrays} for p in loop.graphs.params}
        return params, {p: s for p, s in solver.items() if s}



def _workers(n):
    """'1 worker', 'N workers' (the resume notes of a parameter-server run)."""
    return f"{n} worker" + ("" if n == 1 else "s")

def _adam_kernels(loop):
    """The loop's Adam and AdamW update kernels (fused or not)."""
    return [k for k in loop.train.kernels.values()
            if k.op.op_type in ("AdamUpdate", "AdamWUpdate", "MultiAdamUpdate")]


def _whole(loop, param, name):
    """What the checkpoint must hold for blob ``name`` (``param`` or its
    solver state): its array, or a zero-memory stand-in of the whole shape
    for a tensor-parallel shard."""
    arr = loop.ws[name]
    blob = loop.graphs.graph.blobs[param]
    shape = whole_shape(blob)
    if shape == tuple(arr.shape):
        return arr
    return np.broadcast_to(np.zeros((), dtype=arr.dtype), shape)


def finished_run(loop, iteration):
    """Whether a resume at ``iteration`` has nothing to do: past max_iter, or
    at it in a folder holding the finished run's latest.h5 (the loop's own
    test, without its collective: only rank 0 prints the notes this decides)."""
    max_iter = loop.job.solver.max_iter
    return iteration > max_iter or (iteration == max_iter and
                                    os.path.exists(os.path.join(loop.out_dir, "latest.h5")))


def _order_seed(run_seed, spec):
    """The seed the train split's epoch order is drawn from (``spec``: its
    ``shuffle`` and ``seed``): the split's own seed, else the run's; None
    for a split read in file order."""
    if not spec.get("shuffle", True):
        return None
    own = spec.get("seed")
    return int(run_seed) if own is None else int(own)


def _seed_note(ck, path, job):
    """The note on a resume whose seeds differ from those of the run that
    wrote checkpoint ``ck``, or None: the run's seed (dropout masks, random
    crops and flips) and, apart from it, the one the train data's epoch
    order is drawn from (``data.train.seed`` where given, read from the
    checkpoint's saved config; the run's seed otherwise)."""
    saved = ck.attrs.get("seed")
    train = job.data.train
    if saved is None or train is None:
        return None
    saved, seed = int(saved), int(job.seed)
    now = {"shuffle": train.shuffle, "seed": train.seed}
    then = (saved_config(ck.attrs.get("config")) or {}).get("data")
    then = then.get("train") if isinstance(then, dict) else None
    if not isinstance(then, dict):  # not said: the split as now
        then = now
    order_then, order_now = _order_seed(saved, then), _order_seed(seed, now)

    def order(s):
        return "file order (not shuffled)" if s is None else f"the order of seed {s}"
    reorder = ("the epoch under way goes on in another order (some of its samples are read "
               "twice, others not at all, until it ends)")
    if saved != seed and order_then == saved and order_now == seed:  # both the run's seed
        return (f"note: {path} was written by a run of seed {saved}, this run's is {seed}: the "
                "shuffled data order and the dropout masks follow the new seed from here, so "
                f"{reorder}; --seed {saved} continues the run as it was")
    if order_then != order_now:
        back = ("data.train.shuffle: false" if order_then is None else
                f"data.train.seed: {order_then}")
        run = (f" (and the run's seed, of the dropout masks, is {seed}, the file's {saved}: "
               f"--seed {saved} keeps those)" if saved != seed else "")
        return (f"note: {path} was written by a run whose train data was read in "
                f"{order(order_then)}, this run's in {order(order_now)} (data.train.seed, "
                f"data.train.shuffle), so {reorder}{run}; {back} continues it as it was")
    if saved != seed:
        why = ("data.train.shuffle is false" if order_now is None else
               f"data.train.seed {order_now} draws it")
        return (f"note: {path} was written by a run of seed {saved}, this run's is {seed}: the "
                "dropout masks and the random crops and flips follow the new seed from here, "
                f"not the train data's order ({why}, as in that run); --seed {saved} continues "
                "the run as it was")
    return None


def launched_ranks(loop):
    """(the ranks of the run, the parameter servers among them): a
    parameter-server run's loop runs over its workers' World, the servers
    stand beside it (parallel/param_server.WorkerScheme's global World)."""
    servers = len((getattr(loop.scheme, "ranks", None) or {}).get("servers", ()))
    return (loop.scheme.world.size if servers else loop.world.size), servers


def _global_batches(loop, state):
    """(the checkpoint's global batch, this run's) of the first training
    data reader of this rank that the checkpoint's ``/state`` holds a
    ``global_batch`` for (a micro-batch copy ``<op>@mb<k>`` counting as
    ``<op>``; both in the reader's units, samples per iteration); None for
    a file without one (written before it was kept) or a rank without a
    reader."""
    ranks = (state or {}).get("ranks") or {}
    for name, k in loop.train.kernels.items():
        if k.op.op_type != "DataReader":
            continue
        base = name.split("@mb")[0]
        for r in sorted(ranks, key=int):
            for n, s in ranks[r].items():
                saved = (s.get("state") or {}).get("global_batch") if isinstance(s, dict) else None
                if n.split("@mb")[0] == base and saved is not None:
                    return int(saved), int(k.batch_size) * int(k.world_size)
    return None

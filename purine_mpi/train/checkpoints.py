"""The trainer's weights and state: initialisation (fillers, ``--init``
HDF5 or .caffemodel), checkpoints (write, the best ones through
``train/watch.py``), resume (validated as a whole first) and the state a
resume needs. A part of ``Trainer`` (mixed in): it reads the trainer's
graphs, workspace and world."""
import os

from ..backend import to_numpy
from ..errors import GraphError, UserError
from ..graph.solver import solver_states, state_name
from ..io.checkpoint import (find_resumable, load_checkpoint, load_params, save_checkpoint,
                             save_run_checkpoint)
from ..io.checkpoint_check import check_finite, check_for_net, unused_note
from ..io.config import dump_config
from ..layers.fillers import fill
from ..model import init_params, kept_constant
from ..parallel.compose import Layout
from .collectives import _plain, world_gather


class CheckpointsMixin:
    # ------------------------------------------------------------- state
    def _init_params(self, init, init_skip=()):
        for p in self.params:
            self.ws.set(p, fill(self.graph.blobs[p], self.seed))
        if init and str(init).endswith(".caffemodel"):
            self._init_from_caffemodel(init, init_skip)
        elif init:
            params = load_params(init)
            wanted = init_params(params, self.params, self.job, init, init_skip)
            check_finite({p: params[p] for p in wanted}, init)
            note = unused_note(params, self.net_params, init)
            if note:
                self._say(note)
            for p in wanted:
                self._load_blob(p, params[p], init, skip_hint=True)
            skipped = f" ({', '.join(init_skip)} kept fresh: --init-skip)" if init_skip else ""
            self._say(f"loaded {len(wanted)} blob{'s' if len(wanted) != 1 else ''} from "
                      f"{init}{skipped}")

    def _init_from_caffemodel(self, path, init_skip=()):
        """Caffe weights by layer name. As with our own files every parameter
        must be found, except those of the --init-skip layers and the
        learnable ones the net keeps at a constant (lr_mult 0 and a constant
        filler: the gamma and beta of a BatchNorm without a Scale, which
        Caffe files do not hold)."""
        from ..interop.caffemodel import caffe_params
        skip = set(init_skip)
        shapes = {p: self.graph.blobs[p].shape for p in self.params
                  if p.split("/")[0] not in skip}
        values, report, factors = caffe_params(path, shapes)
        check_finite(values, path)
        if self.rank == 0:
            for line in report:
                self.log(f"{path}: {line}")
        fixed = {p for p in self.params if kept_constant(self.graph.blobs[p])}
        for p in init_params(dict.fromkeys(set(values) | fixed), self.params, self.job, path,
                             init_skip):
            if p in values:
                self._load_blob(p, values[p], path)
        for k in self.train.kernels.values():  # Caffe's running averages go on
            layer = k.op.inputs[3].split("/")[0] if k.op.op_type == "BatchNorm" else None
            if layer in factors and getattr(k, "caffe_average", False):
                k.factor = factors[layer]

    def _load_blob(self, name, value, path, skip_hint=False):
        try:
            self.ws.set(name, value)
        except GraphError as e:  # a file from another net: name the file too
            hint = (f"; to start layer '{name.split('/')[0]}' afresh instead (fine-tuning a "
                    f"changed layer), give --init-skip {name.split('/')[0]}") if skip_hint else ""
            raise UserError(f"{path}: {e}{hint}") from None

    def state_dict(self):
        """Everything beyond params and momenta that a resume needs: each
        stateful kernel's state and each random stream, per rank."""
        local = {}
        for name, k in self.train.kernels.items():
            s = {}
            if k.stateful:
                s["state"] = k.state_dict()
            if k.rng is not None:
                s["rng"] = k.rng.bit_generator.state
            if s:
                local[name] = s
        states = world_gather(self.world, local)
        return {"ranks": {str(r): s for r, s in enumerate(states)},
                "layout": self.layout.as_dict()} if states else None

    def load_state_dict(self, state):
        """Per-rank state of a checkpoint. On the layout it was written on
        (ranks, scheme, replicas x stages, micro-batches) each rank takes its
        own, random streams included: the resume is bit-exact. On another
        layout (a job requeued on other nodes, a hybrid run continued on one
        rank) each kernel takes the state of the first kernel of the same
        name, micro-batch copies ``<op>@mb<k>`` counting as ``<op>``: the
        data position carries over (readers convert it to the new global
        batch), but per-rank random streams cannot: they restart from the seed."""
        ranks = state.get("ranks", {})
        saved = state.get("layout")
        same_world = len(ranks) == self.size and (saved is None or
                                                  self.layout.same_shape(saved))
        if not ranks or (same_world and str(self.rank) not in ranks):
            raise UserError("the checkpoint holds no per-rank state (ranks: "
                            f"{sorted(ranks) or 'none'})")
        if same_world:
            mine = ranks[str(self.rank)]
        else:
            mine = {}
            for r in sorted(ranks, key=int):
                for name, s in ranks[r].items():
                    mine.setdefault(name.split("@mb")[0], s)
            if self.rank == 0:
                was = Layout(**saved).describe() if saved else f"[{len(ranks)} rank(s)]"
                self.log(f"note: resuming a {len(ranks)}-rank checkpoint on {self.size} "
                         f"rank(s), layout {was} -> {self.layout.describe()}: the weights and "
                         "solver state load by name, each stage taking its layers'; the data "
                         "order continues at the same sample count; random streams (dropout) "
                         "restart from the seed, so the run is not bit-identical to an "
                         "uninterrupted one")
        for name, k in self.train.kernels.items():
            s = mine.get(name if same_world else name.split("@mb")[0])
            if s is None:
                continue
            if "state" in s and k.stateful:
                k.load_state_dict(s["state"])
            if same_world and "rng" in s and k.rng is not None:
                k.rng.bit_generator.state = _plain(s["rng"])

    def _resume(self, path):
        if path == "auto":  # latest.h5, else the newest ckpt_<iter>.h5 that loads
            path, ck = find_resumable(self.out_dir, self._say)
            if path is None:
                self._say(f"no checkpoint in {self.out_dir}; starting from scratch")
                return
        else:
            ck = load_checkpoint(path)
        # the whole checkpoint is checked against the net before any of it is loaded
        check_for_net(ck, path, self.net_params, {p: self.ws[p] for p in self.params},
                      {(p, s): self.ws[state_name(p, s)] for p in self.params
                       for s in solver_states(self.solver.type)
                       if state_name(p, s) in self.ws.arrays})
        fresh = set()
        for p in self.params:
            self._load_blob(p, ck.params[p], path)
            for s in solver_states(self.solver.type):
                m = state_name(p, s)
                if m not in self.ws.arrays:
                    continue
                if s in ck.solver.get(p, {}):
                    self._load_blob(m, ck.solver[p][s], path)
                else:
                    fresh.add(s)
        if fresh:
            self._say(f"note: {path} holds no '{', '.join(sorted(fresh))}' solver state for "
                      f"solver type {self.solver.type!r}; that state starts from zero")
        if ck.state:
            self.load_state_dict(ck.state)
        self.start_iter = int(ck.attrs["iteration"])
        self.elapsed0 = float(ck.attrs.get("elapsed", 0.0))
        self.run_id = str(ck.attrs.get("run_id") or "") or self.run_id
        self._last_saved = self.start_iter
        self._say(f"resumed from {path} at iteration {self.start_iter}")
        saved_world = int(ck.attrs.get("world_size", self.size) or self.size)
        if saved_world != self.size and self.job.data.train is not None:
            b = self.job.train_batch
            self._say(f"note: {path} was written by {saved_world} rank(s), this run has "
                      f"{self.size}: the global batch is now "
                      f"{self.job.global_batch(self.data_size)} "
                      f"({b} per rank x {self.data_size}); the data order goes on at the same "
                      "sample, but the learning-rate schedule counts iterations, not samples "
                      "(keep the global batch with --set data.train.batch_size=G/N)")

    def save(self, iteration, path=None):
        """The run's checkpoint of ``iteration`` (ckpt_<iter>.h5, latest.h5,
        rotation), or with ``path`` a checkpoint file of its own. Collective."""
        self.train.drain()  # the weights of this iteration, updated
        self.scheme.before_save(self, iteration)
        if path is None:
            self._last_saved = iteration
        state = self.state_dict()
        params = {p: to_numpy(self.ws[p]) for p in self.params}
        states = solver_states(self.solver.type)
        solver = {p: {s: to_numpy(self.ws[state_name(p, s)]) for s in states
                      if state_name(p, s) in self.ws.arrays} for p in self.params}
        solver = {p: s for p, s in solver.items() if s}
        if self.pipeline:  # each stage holds its own layers' parameters
            parts = world_gather(self.world, (params, solver))
            if self.rank == 0:  # replica 0's stages (the replicas hold the same values)
                for r in self.layout.replica_ranks(0):
                    params.update(parts[r][0])
                    solver.update(parts[r][1])
        if self.rank != 0:
            return
        payload = dict(params=params, solver=solver, state=state, world_size=self.size,
                       seed=self.seed, config_text=dump_config(self.job),
                       run_id=self.run_id, elapsed=self.elapsed())
        if path is not None:  # a checkpoint of its own (checkpoint.best): no rotation
            save_checkpoint(path, iteration=iteration, **payload)
            return
        save_run_checkpoint(self.out_dir, iteration, self.job.checkpoint.keep,
                            **payload)
        if getattr(self, "_metrics", None) is not None and self.start_iter:
            self._metrics.commit()  # the resumed run's rows and config replace the old ones
            self._write_config()

    # ------------------------------------------------------------ output
    def _finished(self):
        """Whether the run folder holds the finished run (its latest.h5), as
        rank 0 sees it (it writes the checkpoints), on every rank alike."""
        done = os.path.exists(os.path.join(self.out_dir, "latest.h5"))
        return self.world.allgather_object(done, "the finished-run check")[0] \
            if self.size > 1 else done

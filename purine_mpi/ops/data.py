"""The data op: reads the next batch of a data source, with prefetch.

``DataReader`` is a source op (no inputs) with outputs ``[data, label]``:
data ``(batch_size, *sample_shape)`` float32 (or attrs ``dtype``) and label
``(batch_size,)`` int64; a text source (data/text.py) gives int32 tokens
``(batch_size, T)`` and their next tokens ``(batch_size, T)`` int32. The label is always produced, also for nets that do
not use it (pruning drops its consumers, not the blob). Which samples a call
reads is the data-parallel rule of ``purine_mpi.data.sources.batch_indices``, so a
run reads the same samples whatever its number of ranks.

Attrs:
    source      the data spec as in the config: {source: hdf5|synthetic, path,
                split, shape, classes, num_samples, shuffle, seed}
    batch_size  per-rank batch size B
    rank, world_size   this replica's index among the data-parallel replicas
    seed        run seed: the shuffle order and synthetic data derive from it,
                unless the spec gives its own ``seed``; the transform's random
                crops and flips always do
    dtype       data dtype (default float32)
    train       training phase (default true): random crops and mirroring;
                false gives center crops and no mirroring
    pad_label   the label of a padding position (-1 in a test graph, whose loss
                and accuracy ops skip it as their own attr ``pad_label``,
                job/replica.py ``mark_padding``):
                after ``pad_from(n)`` every position at or past n of the
                data order (the wrapped-around tail of one pass) delivers
                its sample with this label, so it counts in no figure
    id_limit    the rows of the embeddings that read the data as token ids
                (the fewest; job/replica.py sets it): each batch is checked
                on the host, in the prefetch thread, to lie in [0, id_limit),
                the embedding op's message (ops/embedding.py ``check_ids``)
                raised by the run that takes the batch -- on a GPU too,
                where the embedding op reads no ids back
    count_label the ``ignore_label`` of the SoftmaxLoss ops that read this
                op's label over data-parallel shards, or a list of them
                (job/replica.py ``global_label_counts`` sets it): one more
                output per label, after the label, the shard's normaliser
                for that label, a 0-d float64: max(n, 1) / world_size,
                n the labels of the whole global batch of the iteration
                (the ``world_size`` replicas' windows, docs/config.md
                "Sample order") that are not that label. Each shard's
                loss is then its sum over its counted positions divided by
                it, and the mean of the shards' losses (what the 1/world_size
                of the gradients and the reported loss take) is the global
                batch's mean over its counted positions. Only the labels of
                the global batch are read, once, every label counted in
                them (no data; a source without its labels apart reads them through
                ``gather``). Micro-batch copies of the op count once: copy 0
                alone has the attr, and every copy's losses read its outputs
                (parallel/micro_batch.py)
    count_over  ``global`` (default; above) or ``replica``: n counts this
                replica's batch only (its ``micro_batches`` windows, for a
                scheme whose replicas exchange no gradients), the
                normaliser max(n, 1) / micro_batches

A spec's transform keys (``scale``, ``mean``, ``mirror``, ``crop_size``,
see ``purine_mpi.data.transform``) are applied here, in the prefetch thread;
the data output has the transformed sample shape.

Readers of one spec and seed in a process share the source and its epoch
order (``data/sources.shared_source``): the M micro-batch copies of a
replica's reader hold one synthetic pool or text split, not M, while each
gathers its own rows in its own prefetch thread.

The kernel keeps the iteration index of the next batch (``position``); it is
saved in checkpoints through ``state_dict``. A long-lived daemon thread
gathers batch t+1 while batch t is in use; an exception there is raised by the next
``run``. There is no gradient: data is never differentiated.

On a GPU (``parallel/placement.py`` puts the op on the device's ``h2d`` copy
stream, with device outputs) the prefetch thread writes each batch into one
of two page-locked staging pairs (data, label), alternately (double
buffering). The host side of an iteration is ``before_iteration``, which
the stream dispatcher calls every iteration, also when a CUDA graph
replays the op: it takes the ready pair (waiting for the prefetch thread if
it is behind) and starts the prefetch of the next batch. The device side,
``run``, is two ``cudaMemcpyAsync`` from the pair's page-locked buffers
into the outputs -- legal inside a stream capture, unlike CuPy's
``ndarray.set``, and reading what the buffers hold when they run. So the
copy is captured with the iteration; the pair is the capture's key (one
graph per pair: a captured copy keeps the addresses it was captured with).
Before the prefetch thread refills a pair it waits (in its own thread, off
the iteration) on the event the dispatcher hands ``after_launch`` after the
device work that read the pair (the graph holding the copy, when captured).
So no pinned buffer is overwritten while a copy still reads it, and the
iteration makes no host copy of the batch.
"""
import atexit
import queue
import threading
import time
import weakref

import numpy as np

from ..base.backend import get_xp
from ..base.errors import ShapeError
from ..data.sources import (batch_indices, batch_positions, batch_start, batch_types,
                            gather_labels, shared_source, source_info)
from ..data.transform import apply_transform, output_shape
from .embedding import check_ids
from .registry import OpKernel, register


def count_labels(attrs):
    """A DataReader's attr ``count_label`` as a list of ints (none: [])."""
    labels = attrs.get("count_label")
    if labels is None:
        return []
    return [int(v) for v in (labels if isinstance(labels, (list, tuple)) else [labels])]


@register
class DataReader(OpKernel):
    """outputs: data (B, *shape), label (B,) int64 -- the next batch of a
    source (and, with attr ``count_label``, the shard's loss normalisers)."""

    op_type = "DataReader"
    category = "io"
    stateful = True
    IDLE_S = 10.0  # the prefetch thread ends after this long without a request

    @classmethod
    def infer(cls, attrs, ins):
        if ins:
            raise ShapeError(f"DataReader takes no inputs, got {len(ins)}")
        batch = int(attrs["batch_size"])
        rank, world = int(attrs.get("rank", 0)), int(attrs.get("world_size", 1))
        if batch < 1 or not 0 <= rank < world:
            raise ShapeError(f"DataReader needs batch_size >= 1 and 0 <= rank < world_size, "
                             f"got batch_size {batch}, rank {rank}, world_size {world}")
        _, sample_shape = source_info(attrs["source"])  # metadata only
        sample_shape = output_shape(attrs["source"], sample_shape)
        dtype, label_shape, label_dtype = batch_types(attrs["source"],
                                                      attrs.get("dtype", "float32"))
        outs = [((batch,) + tuple(sample_shape), dtype), ((batch,) + label_shape, label_dtype)]
        return outs + [((), "float64")] * len(count_labels(attrs))

    def __init__(self, op):
        super().__init__(op)
        self.batch_size = int(self.attrs["batch_size"])
        self.rank = int(self.attrs.get("rank", 0))
        self.world_size = int(self.attrs.get("world_size", 1))
        self.seed = int(self.attrs.get("seed", 0))
        self.train = bool(self.attrs.get("train", True))
        self.position = 0  # iteration index of the next batch run() delivers
        self._source = self._order = self._shared = None
        self._pending = None  # (iteration, result slot)
        #: on a GPU: two page-locked (data, label) staging pairs, the event of
        #: the last copy out of each (None: none queued yet), the pair the next
        #: request fills, and the runtime that synchronises those events
        self._pinned, self._copied, self._fill_next, self._runtime = None, [None, None], 0, None
        self._current = None  # the pair this iteration's copy reads (stream dispatcher)
        self._pad_limit = None  # pad_from: positions >= it get attr pad_label
        self._requests, self._lock, self._worker = queue.SimpleQueue(), threading.Lock(), None

    # ------------------------------------------------------------- batches
    def _ensure_source(self):
        if self._source is None:
            # readers of one spec and seed share the source and its epoch
            # order (the micro-batch copies of a replica's reader: one
            # synthetic pool, not M; data/sources.shared_source)
            held = self._shared = shared_source(self.attrs["source"], self.seed)
            self._source, self._order = held.source, held.order

    def prepare(self, iteration, pad_limit=None):
        """(data, labels) NumPy arrays of batch ``iteration`` (no prefetch);
        with ``pad_limit`` the positions at or past it get attr ``pad_label``."""
        self._ensure_source()
        indices = batch_indices(iteration, self.rank, self.world_size, self.batch_size,
                                self._order)
        data, labels = self._source.gather(indices)
        positions = batch_positions(iteration, self.rank, self.world_size, self.batch_size)
        data = apply_transform(data, self.attrs["source"], positions, self.seed, self.train)
        if self.attrs.get("id_limit") is not None:  # token ids, before any transfer
            check_ids(data, int(self.attrs["id_limit"]))
        if pad_limit is not None:
            pad = (positions >= pad_limit).reshape((-1,) + (1,) * (labels.ndim - 1))
            labels = np.where(pad, labels.dtype.type(self.attrs["pad_label"]), labels)
        batch = (np.ascontiguousarray(data), np.ascontiguousarray(labels))
        if count_labels(self.attrs):
            batch += self.shard_normalisers(iteration)
        return batch

    def shard_normalisers(self, iteration):
        """Attr ``count_label``'s outputs of batch ``iteration``, one per
        label L: max(n, 1) / S, n the labels of the iteration's global batch
        (every replica's window, S = world_size; with attr ``count_over:
        replica`` this replica's micro-batches' windows, S = micro_batches)
        other than L; a tuple of 0-d float64."""
        shards, first = self.world_size, 0
        if self.attrs.get("count_over", "global") == "replica":
            shards = int(self.attrs.get("micro_batches", 1))
            first = self.rank - int(self.attrs.get("micro_batch", 0))
        start = batch_start(iteration, first, self.world_size, self.batch_size)
        labels = gather_labels(self._source,
                               self._order.indices(start, shards * self.batch_size))
        labels = np.asarray(labels)
        return tuple(np.array(max(int(np.count_nonzero(labels != label)), 1) / shards,
                              dtype=np.float64) for label in count_labels(self.attrs))

    def _serve(self):
        """The prefetch thread: gathers the batches _start asks for, one at a
        time; it ends after IDLE_S seconds without a request (a reader that
        is no longer run) and _start starts a new one when needed. One
        long-lived thread, not one per batch: a thread per iteration grew
        the native memory by ~300 bytes per iteration under MPI."""
        while True:
            try:
                request = self._requests.get(timeout=self.IDLE_S)
            except queue.Empty:
                with self._lock:
                    if self._requests.empty():
                        self._worker = None
                        return
                continue
            if request is None:  # stop_prefetch: the run or the process is ending
                with self._lock:
                    # a request queued after a stop that timed out (or a
                    # second stop's marker) is still this thread's to serve
                    if self._requests.empty():
                        self._worker = None
                        return
                continue
            iteration, slot = request
            try:
                batch = self.prepare(iteration, slot["pad_limit"])
                if "pair" in slot:
                    batch = self._stage(slot["pair"], batch)
                slot["batch"] = batch
            except BaseException as e:  # handed to run(), which raises it in the caller
                slot["error"] = e
            finally:
                slot["done"].set()

    def _stage(self, pair, batch):
        """Prefetch thread, on a GPU: write ``batch`` into staging pair
        ``pair`` once the copy that last read that pair has finished."""
        event = self._copied[pair]
        if event is not None:
            self._runtime.sync_event(event)
            self._copied[pair] = None
        for dst, src in zip(self._pinned[pair], batch):
            np.copyto(dst, src, casting="unsafe")
        return pair

    def _start(self, iteration):
        self._ensure_source()  # load the file here, so its errors surface in the caller
        slot = {"done": threading.Event(), "pad_limit": self._pad_limit}
        if self._pinned is not None:  # alternate the staging pairs
            slot["pair"], self._fill_next = self._fill_next, 1 - self._fill_next
        with self._lock:
            self._requests.put((iteration, slot))
            if self._worker is None:
                self._worker = threading.Thread(target=self._serve, daemon=True,
                                                name=f"prefetch:{self.op.name}")
                self._worker.start()
                _PREFETCHING.add(self)
        self._pending = (iteration, slot)

    def stop_prefetch(self, timeout=None):
        """End the prefetch thread once the batch it gathers is done (the
        request queued after it is None), waiting up to ``timeout`` s."""
        worker = self.ask_stop_prefetch()
        if worker is not None:
            worker.join(timeout)

    def ask_stop_prefetch(self):
        """Queue the prefetch thread's end after the requests before it,
        without waiting; the thread to join (None: none runs). A request
        queued after it is served all the same (``_serve``)."""
        with self._lock:
            worker = self._worker
            if worker is not None:
                self._requests.put(None)
            return worker

    def _take(self, iteration):
        if self._pending is not None and (self._pending[0] != iteration or
                                          self._pending[1]["pad_limit"] != self._pad_limit):
            self._pending[1]["done"].wait()  # a stale prefetch (position or padding reset)
            self._pending = None
        if self._pending is None:
            self._start(iteration)
        _, slot = self._pending
        slot["done"].wait()
        self._pending = None
        if "error" in slot:
            raise slot["error"]
        return slot["batch"]

    def setup(self, ins, outs):
        if self._pinned is None and get_xp(outs[0]) is not np:
            from ..gpu.streams import pinned_empty
            self._pinned = [tuple(pinned_empty(o.shape, o.dtype) for o in outs)
                            for _ in range(2)]
        self._start(self.position)

    def capturable_on(self, ins, outs):
        """Outputs on a GPU (``setup`` stages through page-locked memory):
        the op's device work is the copy of the pair ``before_iteration``
        took, so a CUDA graph may capture it. Otherwise (host outputs) None:
        its run() moves host state, which capture_blocker says as for any
        stateful kernel."""
        return True if outs and outs[0].location.device >= 0 else None

    def before_iteration(self, iteration, host_write):
        """On a GPU, from the stream dispatcher, every iteration: take the
        staged pair of the next batch (the key of the capture that copies
        it) and start the prefetch of the batch after it."""
        if self._pinned is None:  # host outputs (a simulated device): run() reads
            return None
        pair = self._take(self.position)
        self._current = pair
        self.position += 1
        self._start(self.position)
        return pair

    def after_launch(self, event, runtime):
        """The event after the device work that copied the current pair:
        its next refill waits on it."""
        if self._current is not None:
            self._runtime = runtime
            self._copied[self._current] = event

    def run(self, ins, outs):
        if self._pinned is not None:
            if self._current is None:  # no stream dispatcher: take the batch here
                for dst, src in zip(outs, self._pinned[self._take(self.position)]):
                    dst.set(src)
                self.position += 1
                self._start(self.position)
                return
            from ..gpu.streams import copy_to_device_async
            for dst, src in zip(outs, self._pinned[self._current]):
                copy_to_device_async(dst, src)
            return
        for dst, src in zip(outs, self._take(self.position)):
            dst[...] = get_xp(dst).asarray(src)
        self.position += 1
        self._start(self.position)

    # ----------------------------------------------------------------- state
    def reset_position(self, position=0):
        """Make the next run() deliver batch ``position`` (e.g. 0 before each
        evaluation pass over the test split)."""
        self.position = int(position)

    def pad_from(self, limit):
        """Make positions at or past ``limit`` of the data order padding:
        their label is attr ``pad_label`` (None: no padding, every position
        is a sample, wrapping around the split)."""
        if limit is not None and "pad_label" not in self.attrs:
            raise ValueError(f"DataReader {self.op.name}: padding needs attr pad_label")
        self._pad_limit = None if limit is None else int(limit)

    def state_dict(self):
        return {"position": int(self.position),
                "global_batch": self.batch_size * self.world_size, "seed": self.seed}

    def load_state_dict(self, state):
        """Continue where a saved run stopped. A run resumed with another
        global batch (ranks x batch_size) continues at the same sample count,
        rounded down to a whole batch."""
        position = int(state["position"])
        saved_batch = int(state.get("global_batch", self.batch_size * self.world_size))
        self.reset_position(position * saved_batch // (self.batch_size * self.world_size))


#: the readers whose prefetch thread was started (weakly: a reader dropped
#: is no longer stopped at exit; its thread ends after IDLE_S)
_PREFETCHING = weakref.WeakSet()
#: how long the process's exit waits for the batches in flight, in all
EXIT_WAIT_S = 30.0


def stop_prefetch_threads(timeout=EXIT_WAIT_S):
    """Stop every reader's prefetch thread, letting the batch it gathers
    finish (registered with atexit). Each run ends with the next batch
    being prefetched; a daemon thread still inside NumPy when the
    interpreter finalises is ended by pthread_exit, whose forced unwinding
    through NumPy's C++ frames aborts the process ("terminate called
    without an active exception", exit status -6 after a finished run: seen
    once from `bench` in a whole-suite run)."""
    stop_readers(list(_PREFETCHING), timeout)


def stop_readers(readers, timeout=EXIT_WAIT_S):
    """End the prefetch threads of ``readers`` (DataReader kernels) once
    the batch each gathers is done: all asked at once, then waited for up
    to ``timeout`` s in all (not that long for each reader in turn)."""
    deadline = time.monotonic() + timeout
    workers = [w for w in (r.ask_stop_prefetch() for r in readers) if w is not None]
    for worker in workers:
        worker.join(max(0.0, deadline - time.monotonic()))


atexit.register(stop_prefetch_threads)

"""Asynchronous host staging of a GPU's MPI buffers, for the stream
dispatcher (``runtime/streams_dispatcher.StreamDispatcher`` mixes it in).

With an MPI that is not CUDA-aware (``comm/device.cuda_aware``) a comm op's
device buffers go through page-locked host mirrors allocated once
(``comm/device.HostStage``). No synchronous ``get``/``set``:

- as soon as the op's writers are launched (``_push_ready``), or at the
  latest when the comm poster first asks the gate, its device-to-host
  ``cudaMemcpyAsync`` copies are queued on the device's ``stage_d2h``
  stream, after the writers' events and after the op's previous copy back
  (MPI's buffer must be free); the gate opens, and MPI reads the mirror,
  once the event recorded after those copies has fired -- polled, never
  waited on; collectives still in ``seq`` order (the poster holds the ops
  after a closed gate);
- the epilogue, the host-to-device copy back and the 1/N scale, is queued
  on the device's ``comm`` stream; consumers wait on the event after it.

With a profiler each copy is a trace event of category ``staging``:
``<op>:d2h`` on the ``stage_d2h`` row, ``<op>:h2d`` (with the scale) on the
``comm`` row.

Layer: dispatch (docs/DESIGN.md); may import the foundation, devices, data,
ops, graph, job and composition layers below it, and its own.
"""
import contextlib
import dataclasses
import threading

#: the stream thread of each device's device-to-host staging copies
COPY_OUT_STREAM = "stage_d2h"


@dataclasses.dataclass(frozen=True)
class StageCopy:
    """What a staging copy's trace event names (category ``staging``)."""

    name: str
    op_type: str = "HostStage"


class HostStaging:
    """The staging half of the stream dispatcher; uses its ``runtime``,
    ``kernels``, ``_key``, ``_deps``, ``_gates``, ``_events``, ``_stream``,
    ``_thread_row``, ``profiler`` and ``_timed``."""

    def _init_staging(self, keys):
        #: comm op -> the event after its device-to-host copies (this
        #: iteration), and the event after its last copy back
        self._staged_out, self._copied_back = {}, {}
        self._async_staged = {}
        self._stage_lock = threading.Lock()
        for name, k in self.kernels.items():
            if keys.get(name) is not None and k.category == "comm" and hasattr(k, "copy_out"):
                k.async_staging = True

    def _needs_staging(self, name):
        staged = self._async_staged.get(name)
        if staged is None:
            k = self.kernels[name]
            staged = self._async_staged[name] = bool(
                self._key[name] is not None and getattr(k, "async_staging", False)
                and k.stages_out())
        return staged

    def _push_ready(self, name):
        """A staged comm op's copies to its mirrors are queued as soon as
        its inputs' writers are launched, also while ordered ops before it
        still hold it back from the MPI post."""
        if self._is_comm[name] and self._needs_staging(name):
            self._stage_out(name)
        super()._push_ready(name)

    def _stage_out(self, name):
        """Queue (once per iteration) the device-to-host copies of comm op
        ``name``'s host stages on the device's ``stage_d2h`` stream, after
        its writers and its previous copy back; returns the event after them."""
        with self._stage_lock:
            event = self._staged_out.get(name)
            if event is not None:
                return event
            rt, device = self.runtime, self._key[name][0]
            copy = self._stream((device, COPY_OUT_STREAM))
            for p in self._gates[name]:
                rt.wait(copy, self._events[p])
            if any(self._key[p] == self._key[name] for p in self._deps[name]):
                rt.wait(copy, rt.record(device, self._stream(self._key[name])))
            back = self._copied_back.get(name)
            if back is not None:  # MPI's buffer is free once copied back
                rt.wait(copy, back)
            k = self.kernels[name]
            start = rt.record(device, copy, timing=True) if self.profiler is not None else None
            rt.launch(device, copy, k.copy_out, f"{name}:d2h")
            event = self._staged_out[name] = rt.record(device, copy, timing=start is not None)
            if start is not None:
                self._timed.append((StageCopy(f"{name}:d2h"), "staging",
                                    self._thread_row(device, COPY_OUT_STREAM), device, start, event,
                                    {"stage": "device_to_host"}))
            return event

    @contextlib.contextmanager
    def _timed_copy_back(self, name, key, stream):
        """Around a comm op's epilogue on ``stream``: with a profiler and
        staged buffers, its device time becomes an ``<op>:h2d`` event."""
        rt = self.runtime
        timed = self.profiler is not None and self._async_staged.get(name)
        start = rt.record(key[0], stream, timing=True) if timed else None
        yield
        if start is not None:
            self._timed.append((StageCopy(f"{name}:h2d"), "staging", self._thread_row(*key),
                                key[0], start, rt.record(key[0], stream, timing=True),
                                {"stage": "host_to_device"}))

"""Op kernels, registered by their ``op_type``, and gradient rules.

A kernel class::

    @register
    class Relu(OpKernel):
        '''y = max(x, 0).  Gradient: dx = dy * (x > 0).'''
        op_type = "Relu"

        @classmethod
        def infer(cls, attrs, ins):            # ins: [(shape, dtype), ...]
            return [ins[0]]                     # -> [(shape, dtype), ...]

        def run(self, ins, outs):               # arrays, preallocated
            xp = get_xp(ins[0])
            xp.maximum(ins[0], 0, out=outs[0])

``run`` writes its outputs in place (never rebinds them): output arrays can be
views into shared buffers (gradient buckets). It returns None when the work is
done, or a ``Pending`` for asynchronous ops (communication), which the
dispatcher's progress loop completes.

The registry imports no op family: each registers itself when its module
is imported, and ``purine_mpi.ops.catalog`` imports them all (the modules that
look kernels up import that one).

A gradient rule (one table, ``GRADIENTS``) emits the backward sub-graph of one
forward op through a ``GradContext`` (see ``purine_mpi.graph.grad``)::

    @gradient("Relu")
    def _relu_grad(g, op):
        dy = g.grad_of(op.outputs[0])
        if dy is not None and g.needs_grad(op.inputs[0]):
            g.emit("ReluGrad", [dy, op.inputs[0]], [g.grad_blob(op.inputs[0])])
"""
import numpy as np

from ..base.backend import get_xp
from ..base.errors import GraphError
from ..base.precision import BITS, value_dtype

KERNELS = {}
GRADIENTS = {}


class Pending:
    """An asynchronous op in flight. ``requests`` are MPI requests the progress
    loop tests together (``Testsome``); ``test()`` is used when there are none.
    ``finish()`` runs once, on completion, in the progress thread."""

    requests = ()

    def test(self):
        return True

    def finish(self):
        pass

    def describe(self):
        return ""


class OpKernel:
    """Base class of every op kernel. Subclasses set ``op_type``, implement
    ``infer`` (shape/dtype inference at build time) and ``run``."""

    op_type = None
    #: trace category: compute, comm, copy, io, update
    category = "compute"
    #: kernels that draw random numbers get ``self.rng`` (a numpy Generator,
    #: seeded per op; its state is saved in checkpoints)
    needs_rng = False
    #: kernels that keep state across iterations (besides blobs) implement
    #: ``state_dict()`` / ``load_state_dict(d)`` (e.g. a data reader's position)
    stateful = False
    #: comm kernels: posted in ``seq`` order (collectives, matched by call
    #: order) or, when False, as soon as ready (point-to-point, matched by tag)
    seq_ordered = True
    #: host work of a GPU op that must happen every iteration, also when a
    #: captured CUDA graph replays the op's device work (which runs none of
    #: its Python): ``before_iteration(iteration, host_write)``, called by the
    #: stream dispatcher before the iteration's device work is queued, returns
    #: a key (hashable, or None) -- a capture is valid for one key, e.g. the
    #: data reader's staging buffer -- and may write the op's device blobs
    #: through ``host_write(fn)``, which runs ``fn`` with the device idle.
    #: None: no such work (see ops/iteration.py and ops/data.py)
    before_iteration = None
    #: ``after_launch(event)``: the CUDA event recorded after the op's device
    #: work of this iteration (after the graph holding it, when captured)
    after_launch = None
    #: kernels whose copies under micro-batches (parallel/micro_batch.py)
    #: must know which copy they are: each copy gets attrs ``micro_batch``
    #: (k) and ``micro_batches`` (M), e.g. a Caffe batch norm's running
    #: average, which counts every micro-batch's update
    micro_batch_attrs = False
    #: kernels that read their outputs' earlier values (state kept in an
    #: output across iterations): those outputs keep their own memory in the
    #: host memory plan (runtime/memory_plan.py)
    keeps_outputs = False
    #: (input index, output index) pairs whose output the kernel computes
    #: correctly when it shares the input's memory (element-wise, reading
    #: each input element before writing that output element): the host
    #: memory plan may then put the output on the input's bytes
    in_place = ()
    #: whether a CUDA graph may capture the op's device work: True (its host
    #: state moves in ``before_iteration``), None (no objection) or False
    #: (``capture_note`` says why); a kernel whose answer depends on its
    #: blobs overrides ``capturable_on``
    capturable = None

    def __init__(self, op):
        self.op = op
        self.attrs = op.attrs
        self.rng = None

    @classmethod
    def infer(cls, attrs, ins):
        raise NotImplementedError

    def setup(self, ins, outs):
        """Called once after memory is allocated, before the first run."""

    def run(self, ins, outs):
        raise NotImplementedError

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass

    #: whether the kernel's device work calls cuBLAS (gpu/blas.gemm), so its
    #: stream gets a cuBLAS handle and workspace (``runs_products``)
    products = False
    #: whether, marked bf16/fp16 (``compute_dtype``), the kernel's products
    #: (cuBLAS, cuDNN) may run on TF32 tensor cores: every operand of them
    #: is one of its inputs, which the precision pass rounds (Cast), and
    #: bfloat16/float16 values are exact in TF32, so no product changes
    #: (``make_kernel``). Not where a product reads a float32 value the
    #: kernel computes itself (the fused Attention's probabilities).
    tf32_when_low = False

    #: the low type (``bfloat16``, ``float16``) the precision pass rounds the
    #: kernel's float32 outputs to after each run (``make_kernel``), None:
    #: no rounding
    round_dtype = None

    @classmethod
    def bits_inputs(cls, attrs):
        """The indices of the inputs the kernel (with ``attrs``) takes as
        bfloat16 bits (uint16 storage, base/precision.BITS) as well as
        float32 bfloat16 values: the precision pass stores a blob as bits
        only where every reader lists it here (parallel/precision.
        store_bits); () none (the default)."""
        return ()

    @classmethod
    def bits_outputs(cls, attrs):
        """The indices of the outputs the kernel (with ``attrs``) can write
        as the bits of the bfloat16 nearest each value it computes (the same
        rounding as ``round_low``) when the pass lists them in its attr
        ``bits_out``; () none (the default)."""
        return ()

    @classmethod
    def bits_copies(cls, attrs):
        """The indices of the float32 outputs whose bfloat16 bits the kernel
        (with ``attrs``) can write as well, as an extra output after its own
        (the pass's attr ``bits_copy``: the i-th listed output's bits are
        output ``len(outputs) + i``), the bits of a Cast of that output
        (parallel/precision.fold_copies); () none (the default)."""
        return ()

    @classmethod
    def in_place_of(cls, attrs):
        """``in_place`` for an op with ``attrs``: the pairs the memory plan
        and the test graph ask (an output's index may depend on the attrs:
        LayerNormGrad's dx bits copy comes after the gradients it lists);
        the class's ``in_place`` (the default)."""
        return cls.in_place

    @classmethod
    def bits_outputs_of(cls, op):
        """``bits_outputs`` of the graph op ``op`` (its attrs); a kernel
        whose answer depends on its inputs too would override it (none
        does: the fully connected layer writes bits with a bias as without,
        ops/fc.py). What the precision pass asks."""
        return cls.bits_outputs(op.attrs)

    def rounds_own_outputs(self, ins, outs):
        """The indices of the float32 outputs that the kernel's ``run`` on
        ``ins``/``outs`` rounds to ``round_dtype`` itself, in the pass that
        writes them (the GPU GELU kernels: no second pass over the output),
        so the precision pass does not round them again; () none (the
        default: ``round_low`` rounds every float32 output after the run).
        Rounding there gives the bits ``round_low`` would."""
        return ()

    def capturable_on(self, ins, outs):
        """``capturable`` for the op's input and output blobs ``ins`` and
        ``outs`` (graph Blobs: ``shape``, ``dtype``, ``location``), answered
        from them and the op's attrs, never from live arrays: the executor's
        segment cut and ``plan`` (runtime/segments.capture_blocker) ask it
        before anything is allocated or set up."""
        return self.capturable

    def scratch_specs(self, ins, outs):
        """The ``(shape, dtype)`` arrays of scratch the kernel reserves on a
        GPU for inputs ``ins`` and outputs ``outs`` (device arrays, or any
        objects with ``shape``, ``dtype`` and ``size``: ``plan`` hands it
        the blobs' shapes before anything is allocated); [] none. The one
        copy of each size: ``setup`` reserves them, ``run`` takes them
        (``temporaries``), runtime/footprint.py counts them."""
        return []

    def host_scratch(self, ins, outs):
        """The arrays the kernel's host ``run`` keeps in its thread's caches
        (ops/im2col.Hold: im2col columns, padded copies) for inputs ``ins``
        and outputs ``outs`` (arrays or stand-ins with ``shape`` and
        ``dtype``); [] none. The one copy of each size: ``run`` takes its
        buffers by these Holds, ``plan``'s host scratch row sums them per
        worker lane (im2col.held_by)."""
        return []

    #: whether the host ``run`` takes ``temporaries`` of ``scratch_specs``'
    #: sizes (``host_temporaries``)
    temporaries_on_host = False

    def host_temporaries(self, ins, outs):
        """The ``(shape, dtype)`` arrays live at the peak of the kernel's
        host ``run`` besides its inputs and outputs: those it takes from
        ``temporaries`` and the NumPy temporaries its expressions make (new
        arrays each run, freed when it ends), from the shapes, as the code
        allocates them (tests/test_host_temporaries.py measures them):
        ``plan``'s kernel temporaries row; [] none."""
        return self.scratch_specs(ins, outs) if self.temporaries_on_host else []

    def scratch_note(self, ins, outs):
        """Where the scratch size comes from, in words (None: its shapes):
        e.g. a cuDNN plan's workspace from the tuner's cache or the cap."""
        return None

    def runs_products(self, ins, outs):
        """Whether the op's device work calls cuBLAS (``products``)."""
        return self.products

    def temporaries(self, like, *specs):
        """Arrays of the given ``(shape, dtype)`` for the kernel's
        intermediate values (contents undefined, disjoint). On a GPU they are
        views of the scratch of the op's stream, allocated once and kept, so
        a run inside a CUDA-graph capture allocates nothing (an allocation
        during a capture breaks it); on the host, new arrays. ``like``: an
        array on the device the temporaries are for. Take them all in one
        call: the next call on the same stream may hand out the same bytes."""
        if get_xp(like) is np:
            return [np.empty(shape, dtype) for shape, dtype in specs]
        from ..gpu.raw import array_device, op_scratch
        return op_scratch(self, array_device(like)).take(*specs)

    def reserve_temporaries(self, like, *specs):
        """Make room now (in ``setup``) for a later ``temporaries(like,
        *specs)``, so the scratch is never allocated while a CUDA graph
        captures the op; nothing on the host."""
        if get_xp(like) is not np:
            from ..gpu.raw import array_device, op_scratch
            op_scratch(self, array_device(like)).reserve(*specs)


def out_dtype(attrs, dtype, index=0):
    """The dtype ``infer`` gives output ``index`` of a kernel with ``attrs``
    computed from values of ``dtype``: bfloat16 bits (BITS) where the
    precision pass stores it so (attr ``bits_out``, ``bits_outputs``), else
    the values' dtype (base/precision.value_dtype: float32 for bits)."""
    return BITS if index in attrs.get("bits_out", ()) else value_dtype(dtype)


class ProductKernel(OpKernel):
    """A kernel whose device work is cuBLAS products (gpu/blas.py:
    ``products``) that read only its own inputs, which the precision pass
    rounds, so marked bf16/fp16 they may run on TF32 (``tf32_when_low``)."""

    products = True
    tf32_when_low = True


def spans(n, step):
    """The slices of ``n`` items ``step`` at a time (the last one shorter):
    the pieces an op's host kernel runs one by one."""
    return [slice(s, min(s + step, n)) for s in range(0, n, step)]


def specs_nbytes(specs):
    """The bytes of a list of ``(shape, dtype)`` (an op's scratch or host
    temporaries specs)."""
    return sum(int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
               for shape, dtype in specs)


def register(cls):
    """Class decorator: register a kernel under its ``op_type``."""
    if not cls.op_type:
        raise TypeError(f"{cls.__name__} has no op_type")
    if cls.op_type in KERNELS and KERNELS[cls.op_type] is not cls:
        raise TypeError(f"op_type {cls.op_type!r} registered twice")
    KERNELS[cls.op_type] = cls
    return cls


def gradient(op_type):
    """Decorator: register ``fn(g, op)``, the gradient rule of ``op_type``."""
    def deco(fn):
        GRADIENTS[op_type] = fn
        return fn
    return deco


def get_kernel_class(op_type, op_name=None):
    try:
        return KERNELS[op_type]
    except KeyError:
        where = f"op '{op_name}': " if op_name else ""
        known = ", ".join(sorted(KERNELS))
        raise GraphError(f"{where}unknown op_type '{op_type}' (known: {known})") from None


def make_kernel(op):
    """The kernel of ``op``. An op the precision pass (parallel/precision.py)
    marked with a low ``compute_dtype`` (bfloat16, float16) rounds its
    outputs to it after each run, as a GPU's bf16/fp16 GEMM writes its fp32
    accumulator out in the low type (its inputs are low already: Cast ops);
    an accumulating writer adds its float32 result unrounded; its products
    run on TF32 tensor cores where its kernel says they may
    (``tf32_when_low``: exact for these operands). An update op
    with attr ``skip_if`` does nothing on a step whose overflow flag is set
    (fp16's loss scaling, graph/loss_scale.py)."""
    kernel = get_kernel_class(op.op_type, op.name)(op)
    dtype = op.attrs.get("compute_dtype")
    if dtype not in (None, "float32") and kernel.tf32_when_low:
        _tf32_products(kernel)
    if dtype not in (None, "float32") and not op.accumulate and op.op_type != "Cast":
        _round_outputs(kernel, dtype)
    if op.attrs.get("skip_if"):
        _skippable(kernel, op.attrs["skip_if"])
    return kernel


def flag_set(array):
    """Whether the overflow flag ``array`` (NumPy or device; ops/loss_scale.py)
    is set: on a device, one read back."""
    from ..base.backend import to_numpy
    return bool(np.asarray(to_numpy(array)).reshape(-1)[0] > 0)


def _skippable(kernel, flag):
    """Make ``kernel`` (an update op) do nothing on a step whose overflow
    flag, the blob ``flag`` (ops/loss_scale.py), is set: fp16's skipped
    step leaves the weights and the solver state bit for bit as they were.
    The flag is read on the host, so the op runs eagerly (not captured)."""
    run = kernel.run

    def skipping_run(ins, outs):
        if flag_set(kernel.workspace[flag]):
            return None
        return run(ins, outs)

    kernel.run = skipping_run
    kernel.capturable = False
    kernel.capture_note = "skipped on the host when fp16's overflow flag is set"


def _tf32_products(kernel):
    """Make ``kernel``'s cuBLAS products run with TF32 allowed (gpu/blas.
    tf32_products, on the thread that runs it), whatever the process's
    ``tf32``: the fp32 ops of the same job keep theirs. Its convolutions
    ask cuDNN for TF32 plans themselves (ops/conv.py)."""
    run = kernel.run

    def tf32_run(ins, outs):
        if get_xp(next(iter(ins or outs), np.empty(0))) is np:
            return run(ins, outs)
        from ..gpu.blas import tf32_products
        with tf32_products(True):
            return run(ins, outs)

    kernel.run = tf32_run


def round_low(kernel, arrays, dtype):
    """Round the float32 ``arrays`` in place to ``dtype`` (``bfloat16`` or
    ``float16``): on a GPU one kernel each (cuda/precision.cu, no scratch:
    nothing to reserve, nothing allocated in a capture); on the host
    base/precision.round_to, through ``kernel``'s temporaries of its
    ``scratch_spec``s. The same bits either way."""
    if not arrays:
        return
    if get_xp(arrays[0]) is not np:
        from ..gpu.kernels import round_in_place
        for array in arrays:
            round_in_place(array, dtype)
        return
    from ..base.precision import round_to, scratch_spec
    specs = [scratch_spec(a.shape, dtype) for a in arrays]
    for array, scratch in zip(arrays, kernel.temporaries(arrays[0], *specs)):
        round_to(array, dtype, scratch)


def _round_outputs(kernel, dtype):
    """Make ``kernel`` round its float32 outputs to ``dtype`` after each run
    (``round_low``: one kernel per output on a GPU), but those whose indices
    the kernel lists in ``fp32_outputs`` (the attention statistics: float32
    by definition) and those its run rounded itself (``round_dtype`` set
    here; ``rounds_own_outputs``)."""
    run = kernel.run
    keep = set(getattr(kernel, "fp32_outputs", ()))   # outputs that stay float32
    kernel.round_dtype = dtype

    def rounded_run(ins, outs):
        result = run(ins, outs)
        done = keep.union(kernel.rounds_own_outputs(ins, outs))
        round_low(kernel, [o for i, o in enumerate(outs)
                           if o.dtype == np.float32 and i not in done], dtype)
        return result

    kernel.run = rounded_run


"""Every op family, loaded once: importing this module registers all kernels
and gradient rules in ``purine_mpi.ops.registry``.

The registry itself is a passive table (it imports no family), and each
family registers from its own module: the compute families in
``purine_mpi/ops/``, the communication kernels in ``purine_mpi/comm/ops.py``
(so this module imports comm/, the folder beside ops/ in the same layer).
Modules that look kernels up by ``op_type`` (graph building, gradients, the
dispatchers) import this one, so the order in which the families are first
imported never matters and no family imports another. Look kernels up
through this module (``get_kernel_class``, ``make_kernel``, ``GRADIENTS``).
"""
from . import (activation, attention, basic, batchnorm, clip, conv, data,  # noqa: F401
               dropout, embedding, fc, layernorm, loss_scale, lrn, iteration, lr_policy, pool, softmax,
               tensor, updates, watch)
from ..comm import nccl as comm_nccl, ops as comm_ops  # noqa: F401
from ..comm import rma_ops  # noqa: F401  (Put, WaitWrite)
from ..comm import rma_pull  # noqa: F401  (Get, Publish)
from ..comm import rma_reduce  # noqa: F401  (an Allreduce through a shared window)
from ..comm import window_sync  # noqa: F401  (stage 3's gathers on one node: a barrier)
from .registry import GRADIENTS, KERNELS, get_kernel_class, make_kernel  # noqa: F401,E402

"""TensorBoard event files (``train --tensorboard``), through tensorboardX.

Rank 0 writes ``OUT/tb/events.out.tfevents.*``: one scalar per figure of
each ``metrics.jsonl`` row, tagged ``<phase>/<key>`` (``train/loss``,
``train/lr``, ``train/images_per_s``, ``test/loss``, ``test/accuracy``, and
any further test metric by its key), at step ``iter`` with the row's
``timestamp`` as wall time -- the same numbers as the JSON row. A resumed run
appends a new event file that starts with a purge marker at the resumed
iteration + 1, so TensorBoard drops what a killed run logged after its
checkpoint. View with ``tensorboard --logdir runs``.

tensorboardX is optional (``pip install 'purine_mpi[tensorboard]'``);
``require_tensorboard`` checks for it before training starts.
"""
import os
import sys

from ..base.errors import UserError
from ..base.runfiles import make_run_folder

INSTALL = "pip install 'purine_mpi[tensorboard]'"
# what a row holds besides figures
_NOT_SCALARS = ("phase", "iter", "time", "timestamp", "samples", "tokens")


def require_tensorboard():
    """The tensorboardX SummaryWriter class, or a UserError saying how to install it.

    tensorboardX's writer module imports torch where it is installed, only
    to accept torch tensors besides NumPy arrays; we write Python floats.
    That import was 2.5-5 s of a ``--tensorboard`` run's start-up (measured
    on 2 cores: 6.1 s against 1.0 s for 20 iterations of a small net) and
    torch's libraries in rank 0's resident bytes, so torch is hidden while
    tensorboardX first loads, unless something imported it already; a later
    ``import torch`` works as before."""
    hide = "torch" not in sys.modules and "tensorboardX" not in sys.modules
    if hide:
        sys.modules["torch"] = None  # tensorboardX catches the ImportError
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        raise UserError(f"--tensorboard needs the tensorboardX package: {INSTALL}") from None
    finally:
        if hide:
            del sys.modules["torch"]
    return SummaryWriter


def fresh_suffix(folder):
    """A suffix no event file in ``folder`` ends with: ``.<pid>.<k>``.

    tensorboardX names a file ``events.out.tfevents.<whole seconds>.<host>``
    and opens it for writing: a run resumed within the second the previous
    one started (quick runs, an immediate requeue) reused the name and wiped
    the earlier run's events."""
    names = os.listdir(folder)
    k = 0
    while any(n.endswith(f".{os.getpid()}.{k}") for n in names):
        k += 1
    return f".{os.getpid()}.{k}"


class TensorBoardLog:
    """Scalars of metrics rows into an event file in ``folder``."""

    def __init__(self, folder, purge_step=None):
        writer = require_tensorboard()
        make_run_folder(folder)  # tb/ itself, never a link to a folder elsewhere
        self.writer = writer(logdir=folder, purge_step=purge_step, flush_secs=10,
                             filename_suffix=fresh_suffix(folder))

    def write(self, rec):
        phase, step = rec.get("phase", "train"), int(rec["iter"])
        for key, value in rec.items():
            if key in _NOT_SCALARS or isinstance(value, bool) \
                    or not isinstance(value, (int, float)):
                continue  # a null (non-finite) figure is left out, as JSON has no number
            self.writer.add_scalar(f"{phase}/{key}", float(value), step,
                                   walltime=rec.get("timestamp"))
        self.writer.flush()

    def close(self):
        self.writer.close()

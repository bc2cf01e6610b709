"""Run folders: where a training run writes, and who may write there.

- Without ``--out``, each run of a job gets a new numbered folder
  ``runs/<name>/<N>`` (1, 2, ...), so a second run never clobbers the first;
  ``--resume auto`` continues the newest folder of that job that holds a run
  (a pre-numbering ``runs/<name>`` with its own files counts too).
- An explicit ``--out`` that already holds another run's files (metrics,
  checkpoints, traces) needs ``--resume`` (continue it) or ``--force`` (start
  afresh: that run's files are deleted first); otherwise exit 2 naming both.
- A run holds an exclusive lock on its folder (``.purine.lock``, an
  ``fcntl.flock`` taken by rank 0 for the life of the process): a second run
  started into the same folder exits 2 and names the first (pid, host, start).

Rank 0 decides and every rank gets its answer, so all ranks of a job agree.
"""
import fcntl
import os
import re
import shutil
import socket
import time

from ..errors import UserError
from .checkpoint import LATEST, list_checkpoints

LOCK_FILE = ".purine.lock"
_RUN_FILE_RE = re.compile(r"^(metrics\.jsonl|latest\.h5|ckpt_\d+\.h5|trace\.rank\d+\.json|"
                          r"config\.yaml|events\.out\.tfevents\..*|tb)$")
_held = []  # open lock files of this process (closing one would release its lock)


def run_files(folder):
    """The files of a run in ``folder`` (sorted names; [] if none), with its
    TensorBoard folder ``tb``."""
    if not os.path.isdir(folder):
        return []
    return sorted(n for n in os.listdir(folder) if _RUN_FILE_RE.match(n))


def numbered_runs(base):
    """[(N, path)] of the numbered run folders under ``base``, oldest first."""
    if not os.path.isdir(base):
        return []
    return sorted((int(n), os.path.join(base, n)) for n in os.listdir(base)
                  if n.isdigit() and os.path.isdir(os.path.join(base, n)))


def _new_numbered(base):
    os.makedirs(base, exist_ok=True)
    n = (numbered_runs(base) or [(0, None)])[-1][0] + 1
    while True:
        path = os.path.join(base, str(n))
        try:
            os.mkdir(path)  # atomic: two runs starting together get two folders
            return path
        except FileExistsError:
            n += 1


def choose_run_dir(name, out=None, resume=None, force=False, runs_root="runs"):
    """The folder this run writes to (see the module docstring); creates it.
    Returns (path, note or None)."""
    if out:
        held = run_files(out)
        if held and not resume and not force:
            raise UserError(f"--out {out} holds another run's files ({', '.join(held[:4])}"
                            f"{', ...' if len(held) > 4 else ''}); continue that run with "
                            "--resume auto, start afresh there with --force (its files are "
                            "deleted), or give another --out")
        if held and force and not resume:
            for n in held:
                path = os.path.join(out, n)
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path)  # tb/
                else:
                    os.remove(path)
            os.makedirs(out, exist_ok=True)
            return out, f"--force: deleted the previous run's files in {out}"
        os.makedirs(out, exist_ok=True)
        return out, None
    base = os.path.join(runs_root, name)
    if resume == "auto":
        for _, path in reversed(numbered_runs(base)):
            if run_files(path):
                return path, None
        if os.path.isfile(os.path.join(base, LATEST)) or list_checkpoints(base):
            return base, None  # a run from before numbered folders
    return _new_numbered(base), None


def lock_run_dir(folder):
    """Take the folder's exclusive lock for the life of this process (rank 0
    only); a UserError naming the holder if another run has it."""
    path = os.path.join(folder, LOCK_FILE)
    f = open(path, "a+", encoding="utf-8")
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise UserError(f"run folder {folder} is in use by another run ({holder}); wait for "
                        "it to end, or give another --out") from None
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()} on {socket.gethostname()}, started "
            f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    f.flush()
    _held.append(f)
    return path


def prepare_run_dir(world, name, out=None, resume=None, force=False):
    """Rank 0 chooses (``choose_run_dir``) and locks the folder; every rank
    gets the path. Returns it."""
    answer = None
    if world.rank == 0:
        path, note = choose_run_dir(name, out, resume, force)
        lock_run_dir(path)
        if note:
            print(note, flush=True)
        answer = path
    if world.size > 1:
        answer = world.allgather_object(answer, "the run folder")[0]
    return answer

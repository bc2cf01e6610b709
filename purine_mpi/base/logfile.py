"""The run folder's log file, ``OUT/train.log``: the lines rank 0 prints
(the start-up block, progress, test figures, notes), appended across
resumes, and the errors of any rank, so a batch job's folder keeps what its
terminal showed (as Caffe's GLOG files and Lightning's loggers do).

``open_run_log(out_dir, rank)`` registers the file for this process;
``tee(log)`` makes a log function that also appends each line there (rank
0); ``note_error(text, rank)`` appends an error from any rank, in one
write, so lines of two ranks never interleave. Standard library only: the
error paths of every layer may call it.

The log's last line says how the run ended, written on every exit path
once the run folder's log is open (``end_run(status)``: the CLI on a
return, the abort handlers on an uncaught error or a one-rank user error)::

    run ended: finished at iteration 900 (exit 0)
    run ended: diverged at iteration 12 (exit 3)
    run ended: stopped by SIGTERM at iteration 340 with a checkpoint (exit 143)
    run ended: user error (exit 2)
    run ended: failed on rank 1 (exit 1)

``set_outcome(result, max_iter)`` records what the loop returned (the
trainer), for the words of that line.
"""
import math
import os
import time

from .errors import UserError
from .runfiles import open_run_fd, write_all

LOG_NAME = "train.log"
_path = None
_rank = 0
_outcome = None  # what the training loop returned, in words (set_outcome)
_end_hooks = []  # called once the run ends (at_end)
_end_status = None  # the exit status end_run was given


def end_status():
    """The exit status the run ended with (``end_run``), or None before:
    what the ``at_end`` hooks read."""
    return _end_status


def new_run():
    """A run of this process begins (its folder locked, its log opened):
    the exit status an earlier run of this process ended with is not its,
    nor the outcome an earlier run's loop recorded (one whose log was
    never written, a rank other than 0's, would else end this run's log
    with "finished at iteration N")."""
    global _end_status, _outcome
    _end_status, _outcome = None, None


def open_run_log(out_dir, rank=0):
    """Log this run into ``out_dir/train.log`` (returns the path)."""
    global _path, _rank
    _path, _rank = os.path.join(str(out_dir), LOG_NAME), int(rank)
    new_run()
    if _rank == 0:
        os.makedirs(str(out_dir), exist_ok=True)
        _append(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} pid {os.getpid()} ---")
    return _path


def close_run_log():
    global _path
    _path = None


def _append(line):
    if _path is None:
        return
    try:  # never through a link planted there (base/runfiles.py); a whole line or none
        fd = open_run_fd(_path, append=True)
        try:
            write_all(fd, (line.rstrip("\n") + "\n").encode("utf-8", "replace"), _path)
        finally:
            os.close(fd)
    except (OSError, UserError):
        pass  # the terminal still has it; a full disk must not end the run


def tee(log):
    """A log function that calls ``log`` and appends the line to train.log."""
    def both(msg):
        if _rank == 0:
            _append(str(msg))
        log(msg)
    return both


def note(text):
    """A line rank 0 printed itself (not through ``tee``), appended to train.log."""
    if _rank == 0:
        _append(str(text))


def note_error(text, rank=None):
    """An error of any rank, appended to train.log when a run registered it."""
    text = str(text)
    if text.startswith(("error", "rank ")):  # it says what and where already
        _append(text)
    else:
        _append(f"error (rank {_rank if rank is None else rank}): {text}")


def non_finite_figures(res):
    """The figures of a test pass's result that are NaN or inf (the
    evaluation's own as it measured them, train/evaluation.py: a pass that
    measured nothing); the one rule of the last line, the loop's row and
    final line, and ``test``'s exit status."""
    return [k for k, v in (res or {}).items()
            if k != "samples" and isinstance(v, float) and not math.isfinite(v)]


def set_outcome(result, max_iter, start_iter=0):
    """Words for the last line from the loop's ``result`` (train/loop.py)."""
    global _outcome
    result = result or {}
    if not result and start_iter >= max_iter:
        _outcome = f"already finished at iteration {start_iter}, nothing done"
    elif "diverged_at" in result:
        _outcome = f"diverged at iteration {result['diverged_at']}"
    elif not result.get("stopped_by") and non_finite_figures(result):
        # the last test pass overflowed (train/evaluation.py)
        _outcome = (f"non-finite test figures at iteration "
                    f"{result.get('early_stop') or max_iter}")
    elif "early_stop" in result:
        _outcome = f"stopped early at iteration {result['early_stop']} (solver.early_stop)"
    elif result.get("stopped_by"):
        _outcome = (f"stopped by {result['stopped_by']} at iteration {result.get('iter')} "
                    "with a checkpoint")
    else:
        _outcome = f"finished at iteration {max_iter}"


#: the words of the last line by exit status, where the loop left none
_BY_STATUS = {0: "finished", 2: "user error", 3: "non-finite weights or figures",
              130: "interrupted (SIGINT)", 141: "stdout closed (SIGPIPE)",
              143: "stopped by SIGTERM"}


def at_end(hook):
    """Call ``hook()`` when this process's run ends (``end_run``), after the
    log's last line: job/rundir.py frees the run folder's lock there."""
    if hook not in _end_hooks:
        _end_hooks.append(hook)


def end_run(status, rank=None):
    """The log's last line, ``run ended: ... (exit STATUS)``, once; rank 0
    writes it (``rank``: the rank that ends the job on its own, an abort).
    Then the ``at_end`` hooks, on any rank."""
    global _end_status
    _end_status = int(status)
    try:
        _last_line(status, rank)
    finally:
        while _end_hooks:
            _end_hooks.pop(0)()


def _last_line(status, rank):
    global _path, _outcome
    if _path is None or (rank is None and _rank != 0):
        return
    status = int(status)
    words = _outcome if _outcome is not None and status not in (1, 2) else \
        _BY_STATUS.get(status, "failed")
    if rank is not None:
        words += f" on rank {rank}"
    _append(f"run ended: {words} (exit {status})")
    _path, _outcome = None, None

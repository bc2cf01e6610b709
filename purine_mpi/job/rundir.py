"""Run folders: where a training run writes, and who may write there.

- Without ``--out``, each run of a job gets a new numbered folder
  ``runs/<name>/<N>`` (1, 2, ...), so a second run never clobbers the first;
  ``--resume auto`` continues the newest folder of that job that holds a run
  (a pre-numbering ``runs/<name>`` with its own files counts too).
- An explicit ``--out`` that already holds another run's files (metrics,
  checkpoints, traces) needs ``--resume`` (continue it) or ``--force`` (start
  afresh: that run's files are deleted first); otherwise exit 2 naming both.
  ``--resume FILE`` continues that run only if FILE is one of the folder's
  checkpoints or carries the folder's ``run_id``; a checkpoint of another
  run is refused (exit 2) unless ``--force`` (the folder's files are deleted,
  FILE itself is kept, and the run starts there from FILE); a ``--resume``
  FILE or ``--init`` weights that are missing or do not load, and a job
  whose graphs do not build on its data (NaN in a data file, a label out of
  range, a layer that does not fit), are exit 2 before ``--force`` deletes
  anything.
- A run holds an exclusive lock on its folder (``.purine.lock``, an
  ``fcntl.flock`` taken by rank 0 for the life of the process): a second run
  started into the same folder exits 2 and names the first (pid, host, start).
  A run that ends (any exit status) rewrites the file ``free: ...``; one that
  was killed leaves ``pid ...``, and its lock went with it.
  The lock is taken before the folder's files are looked at, so ``--force``
  into a folder whose run is still going deletes nothing.

- A run refused at start-up (exit 2) before it wrote anything but its lock
  and train.log, in a folder it made (a new numbered one, an ``--out`` that
  was not there), removes that folder and the parents it made
  (``release_run_dirs``); so does a run stopped by a signal before its
  log was opened (its lock alone there: ``parallel.scheme: auto``'s
  calibration); a folder that was there keeps every file.
- ``--force`` deletes only what a run of ours wrote, recognised by content
  (``rundir_force.py``); a folder holding anything else of a run's names is
  refused (exit 2) and nothing is deleted.
- A run file planted as a symbolic link (or a non-regular file, or, for a
  file written in place, one with other hard links) is refused at set-up
  (exit 2 naming it); every writer opens its files through
  ``base/runfiles.py``, which never follows a link.

Rank 0 decides and every rank gets its answer, so all ranks of a job agree:
also a failure (a read-only folder, ``--out`` under a file, a full disk, a
refused file), which every rank raises as the same UserError (exit 2) at
once, under ``parallel.stall_timeout``.
"""
import atexit
import fcntl
import os
import socket
import time

from ..base import logfile
from ..base.errors import UserError
from ..base.runfiles import disk_error, missing_folders, open_run_file, refuse_link, write_all
from .checkpoint_file import LATEST, checkpoint_header, load_checkpoint, load_params
from .outputs import file_in_the_way
from .run_checkpoints import checkpoint_run_id, list_checkpoints
from .rundir_force import _REPLACED_FILES, _RUN_FILE_RE, delete_our_run, run_files

LOCK_FILE = ".purine.lock"
_held = []  # (open lock file, its text, folder) of this process (closing one releases its lock)
#: realpath of each run folder this process made -> the folders it made for
#: it (the run folder first, then the parents it made): a fresh run refused
#: at start-up removes them (``release_run_dirs``)
_made = {}


def _note_made(path, made):
    """Record the folders made for the run folder ``path``; a folder that
    was there (``made`` empty) forgets an older record of it, so a later
    run in this process does not take it for one it made."""
    if made:
        _made[os.path.realpath(path)] = made
    else:
        _made.pop(os.path.realpath(path), None)


def numbered_runs(base):
    """[(N, path)] of the numbered run folders under ``base``, oldest first."""
    if not os.path.isdir(base):
        return []
    return sorted((int(n), os.path.join(base, n)) for n in os.listdir(base)
                  if n.isdigit() and os.path.isdir(os.path.join(base, n)))


def _new_numbered(base):
    parents = missing_folders(base)
    os.makedirs(base, exist_ok=True)
    n = (numbered_runs(base) or [(0, None)])[-1][0] + 1
    while True:
        path = os.path.join(base, str(n))
        try:
            os.mkdir(path)  # atomic: two runs starting together get two folders
            _note_made(path, [os.path.realpath(path)] + parents)
            return path
        except FileExistsError:
            n += 1


def choose_run_dir(name, out=None, resume=None, force=False, runs_root="runs", lock=None,
                   init=None, job=None):
    """The folder this run writes to (see the module docstring); creates it.
    ``lock`` (a callable taking the folder) is called on an ``--out`` before
    anything in it is looked at or deleted, so a folder in use by a running
    run is refused before its files are touched; the files the run starts
    from (``resume`` FILE, ``init``) are read, and ``job``'s graphs built on
    its data, before ``--force`` deletes anything. Returns (path, note or None)."""
    if out:
        made = missing_folders(out)
        os.makedirs(out, exist_ok=True)
        _note_made(out, made)
        if lock is not None:
            lock(out)
        held = run_files(out)
        if held and not resume and not force:
            raise UserError(f"--out {out} holds another run's files ({', '.join(held[:4])}"
                            f"{', ...' if len(held) > 4 else ''}); continue that run with "
                            "--resume auto, start afresh there with --force (its files are "
                            "deleted), or give another --out")
        keep = None
        if held and resume and resume != "auto":
            if not force:
                check_resume_continues(out, resume, held)
                return out, None
            keep = os.path.realpath(resume)  # --force --resume FILE: afresh from FILE
        if held and force:
            check_sources(resume, init, job)  # missing or damaged: exit 2, nothing deleted
            delete_our_run(out, held, keep)
            return out, f"--force: deleted the previous run's files in {out}"
        return out, None
    base = os.path.join(runs_root, name)
    if resume == "auto":
        for _, path in reversed(numbered_runs(base)):
            if run_files(path):
                return _locked(path, lock), None
        if os.path.isfile(os.path.join(base, LATEST)) or list_checkpoints(base):
            return _locked(base, lock), None  # a run from before numbered folders
    return _locked(_new_numbered(base), lock), None


def check_sources(resume=None, init=None, job=None):
    """A UserError (exit 2) unless ``resume`` (a checkpoint, not ``auto``)
    and ``init`` (weights: our HDF5 read whole, a .caffemodel or
    .safetensors found) can be read, and ``job``'s graphs build on its data
    (replica.check_graphs: data files with NaN or labels out of range, a
    layer that does not fit): asked before ``--force`` deletes a run, so a
    mistyped or damaged file loses nothing."""
    if job is not None:
        from .replica import check_graphs
        check_graphs(job)
    if resume and resume != "auto":
        load_checkpoint(resume)
    if init and str(init).endswith((".caffemodel", ".safetensors")):
        if not os.path.isfile(init):
            raise UserError(f"weights file '{init}' not found")
    elif init:
        load_params(init)


def _locked(path, lock):
    if lock is not None:
        lock(path)
    return path


def folder_run_id(folder):
    """The ``run_id`` of the run a folder holds: that of its ``latest.h5``,
    else of its newest ``ckpt_<iter>.h5`` ('' if none says)."""
    candidates = [os.path.join(folder, LATEST)] * os.path.isfile(os.path.join(folder, LATEST))
    candidates += [path for _, path in reversed(list_checkpoints(folder))]
    for path in candidates:
        run_id = checkpoint_run_id(path)
        if run_id:
            return run_id
    return ""


def check_resume_continues(out, resume, held=None):
    """``--resume FILE`` into an ``--out`` that holds a run is allowed only
    when FILE continues that run: FILE lies in that folder, or its ``run_id``
    is the folder's. Otherwise a UserError naming both (the folder's metrics
    and checkpoints would be replaced by another run's), or, where FILE is
    no checkpoint (a folder, a data file), the load's own line saying so."""
    held = held if held is not None else run_files(out)
    if not held or not os.path.exists(resume):
        return  # nothing to protect; a missing FILE is reported where it is loaded
    if os.path.realpath(os.path.dirname(os.path.abspath(resume))) == os.path.realpath(out):
        return  # one of the folder's own checkpoints (going back to an older one)
    theirs, mine = folder_run_id(out), checkpoint_run_id(resume)
    if mine and theirs and mine == theirs:
        return
    if not mine:  # a folder (the run's own), a data file, a damaged file: what it is, said
        checkpoint_header(resume)  # as into another --out, not "another run (run unknown)";
        # its metadata alone: the refusal below needs no read of its (maybe GBs of) arrays
    what = (f"run {theirs[:12]}" if theirs else "a run whose checkpoints name no run_id")
    raise UserError(f"--out {out} holds another run ({what}; {', '.join(held[:4])}"
                    f"{', ...' if len(held) > 4 else ''}) than --resume {resume} (run "
                    f"{mine[:12] or 'unknown'}): resuming there would replace that run's "
                    "metrics and checkpoints; give another --out, or --force to delete "
                    "that run's files and start afresh there from the checkpoint")


def lock_run_dir(folder):
    """Take the folder's exclusive lock for the life of this process (rank 0
    only); a UserError naming the holder if another run has it."""
    path = os.path.join(folder, LOCK_FILE)
    f = open_run_file(path, "a+")  # never through a link planted there
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
    holder = (f"pid {os.getpid()} on {socket.gethostname()}, started "
              f"{time.strftime('%Y-%m-%d %H:%M:%S')}")
    if not _held:
        logfile.new_run()  # an earlier run's exit status in this process is not this one's
        logfile.at_end(release_run_dirs)  # every end, also the abort paths' os._exit
    # held before its text is written, so a refusal there (a full disk) is
    # released as any start-up refusal: a folder this process made is
    # removed. Written past the text layer (no buffered line left to fail
    # again at the release); a full disk is one line naming the lock file
    # (before: the folder named, and each try left a numbered folder
    # holding an empty lock)
    _held.append((f, holder, folder))
    write_all(f.fileno(), (holder + "\n").encode("utf-8"), path)
    return path


def release_run_dirs():
    """At the end of this process's run: mark each run folder's lock file
    free (``free: <what it said>, ended <date>``) and release the lock, so a
    finished run's folder does not read as held by a dead pid. A killed run
    cannot do this; its file keeps ``pid ...``, but the lock went with the
    process, so the next run takes it all the same.

    A run folder this process made, for a run refused at start-up (exit 2,
    ``logfile.end_status``) before it wrote anything but its lock and
    train.log (the watched-metric check, the memory check, data a graph
    does not build on: all after the folder is chosen), or stopped by a
    signal before its log was opened (128 + the signal: a SIGTERM during
    ``parallel.scheme: auto``'s calibration left a folder holding only
    ``.purine.lock``; ``_never_began``), is removed with
    the folders made for it, as the refusals before the folder leave
    nothing behind: a run of refusals left a trail of empty numbered runs.
    A folder that was there (a resumed run, an ``--out`` given) keeps its
    files."""
    while _held:
        f, holder, folder = _held.pop()
        if _remove_refused(folder, f):
            f.close()  # (closed there already, once its file was unlinked)
            continue
        try:
            f.seek(0)
            f.truncate()
            f.write(f"free: {holder}, ended {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
            f.flush()
        except OSError:
            pass  # a full disk: the lock is released all the same
        finally:
            f.close()  # closing the file releases its flock


def _never_began(status, names):
    """Whether a run that ended with ``status``, leaving the files ``names``
    in a folder it made, never began and leaves nothing to read there:
    refused at start-up (2) before any file but its lock and train.log
    (whose error the terminal showed at once), or stopped by a signal
    (128 + its number: a batch system's SIGTERM, a Ctrl-C) before its log
    was opened, its lock alone there (``parallel.scheme: auto``'s
    calibration). A run stopped by a signal once its train.log was open
    (the graph build, the data's load) keeps its folder and that log: its
    last line, "run ended: stopped by SIGTERM (exit 143)", is the only
    record in the folder of why a batch job's run, which nobody watched,
    ended before it trained. A bug's 1 keeps its train.log to be read."""
    if status == 2:
        return names <= {LOCK_FILE, logfile.LOG_NAME}
    return status is not None and 128 < status < 128 + 65 and names <= {LOCK_FILE}


def _remove_refused(folder, lock_file=None):
    """Remove ``folder`` (and the folders made for it) when this process
    made it and a start-up refusal left only its lock and train.log there;
    whether it did. Called holding the folder's lock, ``lock_file``, which
    is closed once its file is unlinked, before the folder is removed: on
    NFS, where run folders of a cluster live, a file unlinked while open
    stays as ``.nfsXXXX`` until it is closed, and the folder would stay
    with it."""
    made = _made.pop(os.path.realpath(folder), None)
    if not made or logfile.end_status() is None:
        return False
    try:
        if not _never_began(logfile.end_status(), set(os.listdir(folder))):
            return False
        for name in (logfile.LOG_NAME, LOCK_FILE):
            if os.path.lexists(os.path.join(folder, name)):
                os.unlink(os.path.join(folder, name))
        if lock_file is not None:
            lock_file.close()  # its name is gone: a run starting now makes a new one
        for path in made:  # the run folder, then the parents made for it, while empty
            os.rmdir(path)
    except OSError:
        pass  # another process's file there now: what is left stays
    return True


atexit.register(release_run_dirs)  # a process that ends before its run's end_run


def refuse_linked_run_files(folder):
    """A UserError naming the first run file of ``folder`` (any name a run
    writes there) that is a symbolic link or not a regular file: a run
    never writes through one."""
    for name in sorted(os.listdir(folder)):
        # (a checkpoint's temporary file is made anew, O_EXCL, never opened as found)
        if name == LOCK_FILE or _RUN_FILE_RE.match(name):
            refuse_link(os.path.join(folder, name), folder=name == "tb",
                        in_place=name != "tb" and not name.endswith(".h5"))  # latest.h5: a link
        elif name in _REPLACED_FILES:
            refuse_link(os.path.join(folder, name))


def _set_up(name, out, resume, force, runs_root, init=None, job=None):
    """Rank 0's part of ``prepare_run_dir``: the path, or a UserError."""
    where = out or os.path.join(runs_root, name)
    blocker = where if os.path.lexists(where) and not os.path.isdir(where) else \
        file_in_the_way(where)
    if blocker is not None:  # not OSError's bare "File exists"
        given = "--out" if out else "--out, or another checkpoint.folder"
        raise UserError(f"run folder {where}: {blocker} is a file, not a folder; give another "
                        f"{given} (a folder, or a path where one can be made)")
    try:
        # the lock is taken before the folder's files are looked at or deleted
        path, note = choose_run_dir(name, out, resume, force, runs_root=runs_root,
                                    lock=_lock_and_check, init=init, job=job)
    except OSError as exc:  # a read-only folder, --out under a file, a full disk
        err = disk_error(exc.filename or where, exc)
        at = f" ({exc.filename})" if exc.filename and exc.filename != where else ""
        raise (err if err is not None else UserError(
            f"run folder {where}: cannot set it up: {exc.strerror or exc}{at}")) from None
    if note:
        print(note, flush=True)
    return path


def _lock_and_check(folder):
    lock_run_dir(folder)
    refuse_linked_run_files(folder)


def prepare_run_dir(world, name, out=None, resume=None, force=False, runs_root="runs",
                    init=None, job=None):
    """Rank 0 chooses (``choose_run_dir``; without ``out``, a numbered folder
    of ``runs_root/name``) and locks the folder; every rank gets the path, or
    rank 0's error: every rank then raises the same UserError (exit 2), so
    a failed set-up ends the job at once instead of leaving the other ranks
    waiting. Returns the path."""
    from ..comm.world import rank0_decides
    return rank0_decides(world, lambda: _set_up(name, out, resume, force, runs_root, init, job),
                         "the run folder")

"""Writing a run's files safely: the one helper every writer of a run
folder goes through (``.purine.lock``, ``train.log``, ``config.yaml``,
``metrics.jsonl``, traces, the temporary files of checkpoints; ``tb/``).

- ``open_run_fd`` / ``open_run_file`` open a file for writing without
  following a symbolic link (``O_NOFOLLOW``) and only if what is there is a
  regular file with no other hard link; anything else (a link planted in a
  shared or group-writable folder, a FIFO, a device, another user's file
  linked in) is refused with a ``UserError`` naming it (exit 2), so a run
  never writes through to a file elsewhere.
- ``refuse_link`` says the same of a path that is about to be created or
  replaced by name (a folder such as ``tb/``).
- ``write_all`` writes bytes to a descriptor completely or not at all: on a
  failure it cuts the file back to where it was, so a record is never left
  cut mid-line, and a full disk is reported by ``disk_error``.
- ``disk_error`` turns an ``OSError`` of a write into one line naming the
  file (``no space left on device`` for ENOSPC/EDQUOT, ``file too large``
  for EFBIG), a ``UserError``.
- ``GuardedFile`` is the file HDF5 writes checkpoints and data files
  through: a failed write is remembered, not raised into HDF5, and the
  writes after it are held in memory (only those: ``stop_if_write_failed``
  stops the writers) until the caller's ``check()`` gives the one line.

Standard library only (``write_hdf5_replacing`` imports h5py when
called): the log file (foundation) uses it too.
"""
import bisect
import errno
import io
import fcntl
import os
import stat
import threading

from .errors import UserError

_FULL = (errno.ENOSPC, errno.EDQUOT)


class UnsafeRunFile(UserError):
    """A run file that is a symbolic link or not a regular file of its own."""


def _refusal(path, what):
    return UnsafeRunFile(f"{path}: {what}; a run writes only regular files of its own in its "
                         "folder and never follows a link there: remove it, or give another "
                         "--out")


def refuse_link(path, folder=False, in_place=False):
    """A UserError if ``path`` is a symbolic link (or, for a file, anything
    but a regular file; for ``folder``, anything but a folder; ``in_place``,
    a file written in place: one with other hard links). A missing path is
    fine."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        raise _refusal(path, "is a symbolic link")
    if folder and not stat.S_ISDIR(st.st_mode):
        raise _refusal(path, "is not a folder")
    if not folder and not stat.S_ISREG(st.st_mode):
        raise _refusal(path, "is not a regular file")
    if in_place and st.st_nlink > 1:
        raise _refusal(path, f"has {st.st_nlink} hard links (it is also a file elsewhere)")


def open_run_fd(path, append=False, truncate=True, read=False, mode=0o644):
    """A descriptor of ``path`` open for writing (``read``: for reading too),
    created if missing, never through a symbolic link, and only if it is a
    regular file with a single link; ``truncate`` empties it (not with
    ``append``). Refusals are ``UnsafeRunFile`` (exit 2)."""
    flags = (os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
             | (os.O_RDWR if read else os.O_WRONLY) | (os.O_APPEND if append else 0))
    try:
        fd = os.open(path, flags, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _refusal(path, "is a symbolic link") from None
        if exc.errno in (errno.ENXIO, errno.EISDIR):  # a FIFO without reader, a folder
            raise _refusal(path, "is not a regular file") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _refusal(path, "is not a regular file")
        if st.st_nlink > 1:
            raise _refusal(path, f"has {st.st_nlink} hard links (it is also a file elsewhere)")
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        if truncate and not append:
            os.ftruncate(fd, 0)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_run_file(path, mode="w", encoding="utf-8"):
    """``open_run_fd`` as a text file object: ``mode`` "w" (emptied), "a"
    (appended to) or "a+" (read and appended to, not emptied)."""
    fd = open_run_fd(path, append=mode.startswith("a"), read="+" in mode)
    return os.fdopen(fd, mode, encoding=encoding)


def make_run_folder(path):
    """Create the folder ``path`` inside a run folder (``tb/``) unless it is
    there; refuses a symbolic link or a file in its place."""
    refuse_link(path, folder=True)
    os.makedirs(path, exist_ok=True)
    refuse_link(path, folder=True)  # not swapped for a link meanwhile
    return path


def disk_error(path, exc):
    """The ``UserError`` for an ``OSError`` ``exc`` of writing ``path``:
    one line naming the file, ``no space left on device`` when it is
    ENOSPC/EDQUOT, ``file too large`` when it is EFBIG (the file-size
    limit, ``ulimit -f``: Python ignores SIGXFSZ, so the write fails).
    Returns None for other errors."""
    if getattr(exc, "errno", None) in _FULL or "No space left on device" in str(exc) \
            or "errno = 28," in str(exc):
        return UserError(f"{path}: no space left on device; free space there or give another "
                         "--out")
    if getattr(exc, "errno", None) == errno.EFBIG:
        return UserError(f"{path}: file too large for this process's file-size limit ('ulimit "
                         "-f') or the file system; raise the limit or give another --out")
    return None


#: what writing a new file or folder at a path the user named fails with
#: there: no permission, a read-only file system, a place no file can be
#: made (/proc), a part of the path that is a file
_REFUSED = (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOENT, errno.ENOTDIR)


def cannot_write(path, tmp, exc, option="--out"):
    """The ``UserError`` for an ``OSError`` ``exc`` of creating ``tmp`` (the
    temporary name a write of ``path`` goes through) where files cannot be
    made: one line naming ``path``; None for any other error (one of
    another file, e.g. an input read while writing, stays what it is)."""
    code = getattr(exc, "errno", None)
    mine = getattr(exc, "filename", None) == tmp or str(tmp) in str(exc)
    if code in _REFUSED and mine:
        return UserError(f"{path}: cannot be written there ({os.strerror(code)}); give "
                         f"another {option}")
    if code == errno.ENAMETOOLONG and mine:
        return name_too_long(path, tmp, option)
    return None


def name_too_long(path, tmp=None, option="--out"):
    """The ``UserError`` for a ``path`` too long for the file system
    (ENAMETOOLONG): its name, or (``tmp``) the temporary name
    ``PATH.tmp.<pid>`` its write goes through, which a name near the limit
    (255 bytes on most file systems) or a path near the system's limit on
    a whole path (4095 bytes on Linux) passes."""
    name = os.path.basename(str(path))
    folder = os.path.dirname(os.path.abspath(path))
    limit, path_max = _pathconf(folder, "PC_NAME_MAX", 255), _pathconf(folder, "PC_PATH_MAX",
                                                                      4096)
    size = len(os.fsencode(name))
    if tmp is not None and size <= limit < len(os.fsencode(os.path.basename(tmp))):
        why = (f"its write goes through the temporary file '{os.path.basename(tmp)}' "
               f"({len(os.fsencode(os.path.basename(tmp)))} bytes) and this file system takes "
               f"names of at most {limit} bytes (the name itself has {size})")
    elif tmp is not None and len(os.fsencode(str(path))) < path_max <= len(os.fsencode(str(tmp))):
        why = (f"its write goes through the temporary file '{os.path.basename(tmp)}' beside "
               f"it, a path of {len(os.fsencode(str(tmp)))} bytes, and this system takes paths "
               f"of at most {path_max - 1} bytes (the path itself has "
               f"{len(os.fsencode(str(path)))})")
    else:
        why = os.strerror(errno.ENAMETOOLONG)
    return UserError(f"{path}: the name is too long: {why}; give a shorter {option}")


def _pathconf(folder, name, default):
    try:
        return os.pathconf(folder, name)
    except (OSError, ValueError):
        return default


def folder_of(path):
    """The folder that holds the file ``path``, as the system finds it: the
    text before its last ``/`` (``.`` where none), never made absolute
    lexically (``os.path.abspath`` reads ``link/../new/f`` as ``new``
    beside the link; the system, and a folder made from this, beside the
    link's target, where the file's own open looks)."""
    return os.path.dirname(str(path)) or "."


def missing_folders(path):
    """The folders ``os.makedirs(path)`` makes that do not exist yet, as
    the system finds them (``link/../new`` is ``new`` beside the link's
    target, not beside the link): ``path`` first, then the others deepest
    first. Every prefix of ``path`` as written counts: ``a/b/../c`` makes
    ``a/b`` on its way to ``a/c``, which its real path alone (``a/c``)
    does not name. The folders a command that makes ``path`` may remove
    again when it fails, left empty."""
    path = str(path)
    target = os.path.realpath(path)
    prefix, missing = os.sep if path.startswith(os.sep) else "", set()
    for part in path.split(os.sep):
        if not part:
            continue
        prefix = os.path.join(prefix, part) if prefix else part
        real = os.path.realpath(prefix)  # '..' after a missing folder: its real parent
        if not os.path.lexists(real):
            missing.add(real)
    rest = sorted(missing - {target}, key=lambda p: (-p.count(os.sep), p))
    return ([target] if target in missing else []) + rest


def make_folder(path, option="--out"):
    """``os.makedirs(path, exist_ok=True)`` for an output the user named
    with ``option`` (the option the line tells to give again: ``--out``,
    ``--calibration``, ``--calibrate``); a folder that cannot be made there
    is one line naming it (exit 2)."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        if exc.errno == errno.ENAMETOOLONG:
            raise name_too_long(path, option=option) from None
        code = exc.errno if exc.errno in _REFUSED + (errno.EEXIST,) else None
        if code is None:
            raise
        why = "a file is there" if code == errno.EEXIST else os.strerror(code)
        raise UserError(f"{path}: cannot make this folder ({why}); give another {option}") \
            from None


def make_parent(path, option="--out"):
    """``make_folder`` of the folder that holds the file ``path`` (as the
    system finds it, ``folder_of``; ``option``: the option that named it):
    what every writer of an output file calls before its write; returns
    that folder."""
    folder = folder_of(path)
    make_folder(folder, option)
    return folder


def check_writable(path, option="--out"):
    """Before a command's work: ``path`` (a file the user named with --out)
    can be written, found as its write would find it (its folder made, a
    file of its own made there and removed): the same one line as that
    write (``make_folder``, ``cannot_write``, ``disk_error``), not after an
    evaluation of the whole data. Nothing is left behind, whatever ends the
    check (a refusal, Ctrl-C): the temporary file goes, and so do the
    folders it made (the write makes them again; a command that fails
    before it leaves no empty folder). A temporary file of that name left
    by a killed write (the same process id) is removed, as the write
    removes it."""
    if os.path.isdir(path) and not os.path.islink(path):  # the rename over it would fail
        raise UserError(f"{path} is a folder, but the output is one file: give the file's "
                        "path")
    folder = folder_of(path)
    made = missing_folders(folder)  # the folders missing now, deepest first
    tmp = temp_name(path)
    ours = False  # from the open on: a file under that name is this check's
    try:
        make_folder(folder, option)
        if os.path.lexists(tmp):
            os.remove(tmp)  # never written through a link left under that name
        ours = True
        try:
            with open(tmp, "xb"):
                pass
        except OSError as exc:
            ours = False
            raise disk_error(path, exc) or cannot_write(path, tmp, exc, option) or exc
    finally:
        if ours and os.path.lexists(tmp):
            os.remove(tmp)
        for f in made:  # deepest first; one another process filled stays
            try:
                os.rmdir(f)
            except FileNotFoundError:
                continue  # not made: make_folder was refused on its way
            except OSError:
                break


def temp_name(path):
    """The temporary name beside ``path`` that ``write_replacing`` writes
    (and ``check_writable`` tries): ``PATH.tmp.<pid>``."""
    return f"{path}.tmp.{os.getpid()}"


def write_replacing(path, write):
    """``write(tmp)`` into a temporary name beside ``path``, then rename it
    over ``path``: never a half-written file under the final name, whatever
    ends the write (an error, Ctrl-C: the temporary file goes and what was
    at ``path`` stays as it was; a full disk: ``disk_error``'s one line)."""
    tmp = temp_name(path)
    if os.path.lexists(tmp):
        os.remove(tmp)  # never written through a link left under that name
    try:
        write(tmp)
        os.replace(tmp, path)
    except OSError as exc:  # a full disk, a place no file can be made: one line
        raise disk_error(path, exc) or cannot_write(path, tmp, exc) or exc
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


#: the mode HDF5 creates a file by name with (less the umask): a data file
#: written by ``write_hdf5_replacing`` keeps the mode it had when HDF5 made it
HDF5_MODE = 0o666


def write_hdf5_replacing(path, fill, mode=0o644):
    """An HDF5 file at ``path`` by ``write_replacing``: ``fill(f)`` writes
    the open ``h5py.File`` ``f``, which writes through a ``GuardedFile``
    of the temporary name, so a full disk or the file-size limit is
    ``disk_error``'s one line (HDF5 writing a file by name meets the
    failure itself: its errors, a traceback and a crash of the process).
    The file is created with ``mode`` less the umask (``HDF5_MODE``: as
    HDF5 creates a file by name)."""
    import h5py

    def write(tmp):
        with GuardedFile(tmp, mode) as raw:
            with h5py.File(raw, "w") as f:
                fill(f)
                f.flush()
            raw.check()
    write_replacing(path, write)


def write_text_replacing(path, text):
    """``text`` (UTF-8) into ``path`` by ``write_replacing``: the temporary
    name is created anew (never a link's target) and renamed over ``path``,
    so a link planted there is replaced, never written through."""
    def write(tmp):
        with open_run_file(tmp) as f:
            f.write(text)
    write_replacing(path, write)


def write_all(fd, data, path):
    """Write ``data`` (bytes) at the end of ``fd`` completely, or cut the
    file back to its size before and raise (``disk_error``'s UserError for
    a full disk or the file-size limit, the ``OSError``, naming ``path``,
    otherwise)."""
    start = os.lseek(fd, 0, os.SEEK_END)
    view = memoryview(data)
    try:
        while view:
            view = view[os.write(fd, view):]
    except OSError as exc:
        try:
            os.ftruncate(fd, start)
        except OSError:
            pass
        err = disk_error(path, exc)
        if err is not None:
            raise err from None
        if exc.errno and not exc.filename:  # os.write names no file: name it
            raise OSError(exc.errno, exc.strerror, path) from None
        raise


class _WriteStopped(Exception):
    """Raised by ``stop_if_write_failed`` out of a writer's loop: the
    ``GuardedFile`` it writes met a failure, so what is left is never
    produced; the file's ``__exit__`` turns it into that failure."""


_OPEN = threading.local()  # .files: the GuardedFiles this thread has entered


def write_failed():
    """Whether a write of the ``GuardedFile`` whose ``with`` this thread
    entered last (the file the writer writes now) has failed (a full disk):
    a writer then writes no more. Only that file's: a file written inside
    the ``with`` of another that failed (a checkpoint, whose ``check()``
    passes when its own writes did) is written whole."""
    files = getattr(_OPEN, "files", ())
    return bool(files) and files[-1].error is not None


def stop_if_write_failed():
    """Called by a writer between the pieces it writes (a chunk of samples,
    a data set) inside ``with GuardedFile(...)`` (``write_hdf5_replacing``'s
    ``fill``, ``save_checkpoint``): once a write of the file has failed (a
    full disk), raise ``_WriteStopped``, so the rest (possibly GBs) is
    never computed nor held in memory; leaving the ``with`` of the file
    raises the write's ``OSError`` in its place (``check()``'s error, the
    caller's one line). Nothing outside such a ``with``."""
    if write_failed():
        raise _WriteStopped()


class GuardedFile(io.RawIOBase):
    """A new file (created exclusively, never through a link) for a library
    that writes through a Python file object (h5py's ``fileobj`` driver).
    A failed write (a full disk) is not raised into the library (HDF5
    answers it with errors of its own, or a crash): it is remembered, and
    the file goes on so the library's reads stay consistent; the caller
    asks ``check()`` when the library is done and removes the file.

    After a failure the bytes written so far stay on disk (reads below that
    size read them there) and only the writes from then on are kept, in
    memory, as a sparse overlay of byte ranges that reads see on top of the
    disk's bytes (holes read as zeros, as in a file): every byte the library
    wrote reads back as written, and memory grows with what is written
    after the failure, not with the file. Writers bound that too by calling
    ``stop_if_write_failed`` between pieces."""

    def __init__(self, path, mode=0o644):
        super().__init__()
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     mode)
        self._file = io.FileIO(fd, "r+b", closefd=True)
        self.path, self.error = path, None
        # after a failure: the position, the file's size, the disk's bytes
        # still valid ([0, _disk_end)), the overlay: sorted disjoint starts
        # and {start: bytearray}
        self._pos = self._size = self._disk_end = 0
        self._starts, self._spans = [], {}

    def __enter__(self):
        if not hasattr(_OPEN, "files"):
            _OPEN.files = []
        _OPEN.files.append(self)
        return super().__enter__()

    def __exit__(self, exc_type, exc, tb):
        try:
            _OPEN.files.remove(self)
        except (AttributeError, ValueError):
            pass
        super().__exit__(exc_type, exc, tb)
        stopped = exc
        while stopped is not None and not isinstance(stopped, _WriteStopped):
            stopped = stopped.__context__  # (an error of closing HDF5's file after it)
        if stopped is not None and self.error is not None:
            raise self.error from None  # the write's failure, not the writer's stop
        return False

    def readable(self):
        return True

    def writable(self):
        return True

    def seekable(self):
        return True

    @property
    def overlay_bytes(self):
        """Bytes held in memory (the writes after a failure)."""
        return sum(len(b) for b in self._spans.values())

    def readinto(self, buffer):
        if self.error is None:
            return self._file.readinto(buffer)
        out = memoryview(buffer).cast("B")
        pos, n = self._pos, max(0, min(len(out), self._size - self._pos))
        end, got = pos + n, 0
        if pos < self._disk_end:  # the bytes on disk below the failure
            fd, stop = self._file.fileno(), min(end, self._disk_end)
            while pos + got < stop:
                k = os.preadv(fd, [out[got:stop - pos]], pos + got)
                if k <= 0:
                    break
                got += k
        out[got:n] = bytes(n - got)  # holes (and disk bytes cut away) read as zeros
        i = max(0, bisect.bisect_right(self._starts, pos) - 1)
        while i < len(self._starts) and self._starts[i] < end:  # the overlay on top
            start = self._starts[i]
            span = self._spans[start]
            lo, hi = max(start, pos), min(start + len(span), end)
            if lo < hi:
                out[lo - pos:hi - pos] = span[lo - start:hi - start]
            i += 1
        self._pos += n
        return n

    def seek(self, pos, whence=0):
        if self.error is None:
            return self._file.seek(pos, whence)
        base = {0: 0, 1: self._pos, 2: self._size}[whence]
        if base + pos < 0:
            raise OSError(errno.EINVAL, "negative seek position")
        self._pos = base + pos
        return self._pos

    def tell(self):
        return self._file.tell() if self.error is None else self._pos

    def truncate(self, size=None):
        if self.error is None:
            try:
                return self._file.truncate(size)
            except OSError as exc:
                self._fail(exc)
        size = self._pos if size is None else size
        self._disk_end = min(self._disk_end, size)  # grown again: zeros, not old bytes
        for start in [s for s in self._starts if s + len(self._spans[s]) > size]:
            if start >= size:
                del self._spans[start]
            else:
                del self._spans[start][size - start:]
        self._starts = [s for s in self._starts if s in self._spans]
        self._size = size
        return size

    def write(self, data):
        view = memoryview(data).cast("B")
        if self.error is None:
            pos = self._file.tell()
            try:
                done = 0
                while done < len(view):  # os.write: the fd's offset, as FileIO's
                    done += os.write(self._file.fileno(), view[done:])
                return done
            except OSError as exc:
                self._fail(exc)
                self._pos = pos
        if not view:  # nothing written: a file does not grow (a position past its end)
            return 0
        self._put(self._pos, view)
        self._pos += len(view)
        self._size = max(self._size, self._pos)
        return len(view)

    def _fail(self, exc):
        """Remember ``exc``; from now on the disk's bytes are read, never
        written (what a write cut short left there is overlaid)."""
        self.error = exc
        self._pos = self._file.tell()
        self._size = self._disk_end = os.fstat(self._file.fileno()).st_size

    def _put(self, pos, view):
        """Overlay ``view`` at ``pos``: the spans it overlaps or extends
        become one (an append to a span extends it in place)."""
        end = pos + len(view)
        if not view:
            return
        i = bisect.bisect_right(self._starts, pos) - 1  # the last span starting at or before
        touches = i >= 0 and self._starts[i] + len(self._spans[self._starts[i]]) >= pos
        if touches and (i + 1 == len(self._starts) or self._starts[i + 1] >= end):
            start = self._starts[i]
            self._spans[start][pos - start:end - start] = view  # in place (or grown)
            return
        lo = i if touches else i + 1
        hi = bisect.bisect_left(self._starts, end)  # the spans starting before ``end``
        first = min(pos, self._starts[lo]) if lo < hi else pos
        last = max([end] + [s + len(self._spans[s]) for s in self._starts[lo:hi]])
        merged = bytearray(last - first)
        for s in self._starts[lo:hi]:
            span = self._spans.pop(s)
            merged[s - first:s - first + len(span)] = span
        merged[pos - first:end - first] = view
        self._starts[lo:hi] = [first]
        self._spans[first] = merged

    def close(self):
        self._file.close()
        self._starts, self._spans = [], {}
        super().close()

    def check(self):
        """Raise the ``OSError`` a write met (the caller names the file it
        stands for: ``disk_error``); else fsync the file."""
        if self.error is None:
            try:
                os.fsync(self._file.fileno())
            except OSError as exc:
                self.error = exc
        if self.error is not None:
            raise self.error

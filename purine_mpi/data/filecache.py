"""What a data file holds, read once per process and file version.

``per_file_version(path, load, stat_path=None)`` returns ``load(path)``,
kept per ``file_identity`` of ``stat_path`` (default ``path``): the
readers' prefetch threads and the ranks' start-up checks share one read,
and a file rewritten in between is read again (and replaces the version
kept: one per path). A file that cannot be stat'ed is read every time
(its error then comes from ``load``). ``same_version`` tells whether what
was read of a racy file is still its content once the file is no longer
racy (its digest, once more), so an unchanged file is not read twice.

``file_identity(path)`` is the version of a file that every per-process
cache of what a data file holds keys on (here, data/sources.py's shared
sources and in-memory HDF5 splits): the real path, device, inode, size,
modification and status-change times (``st_mtime_ns``, ``st_ctime_ns``),
and, for a *racy* file, a digest of its bytes. The times alone cannot
tell two versions apart on a file system with coarse timestamps (FAT: 2 s;
ext3, HFS+, some NFS servers: 1 s): a same-size rewrite within one tick
keeps every stat field, and ``st_ctime_ns`` is as coarse as the mtime.
Git's "racily clean" rule settles it: a file whose mtime or ctime lies
more than ``RACY_SECONDS`` before now has not changed since without
moving one of them (a later write stamps a later tick); a file changed
more recently than that is racy, and its identity adds a BLAKE2b digest
of its content, so two versions of it differ whatever the clock says.
The digest reads the whole file, but only a file changed within the last
``RACY_SECONDS``, and of at most ``HASH_BYTES`` (a larger one is keyed
by its stat fields alone: the one case left unnoticed is a same-size
rewrite of such a file within one timestamp tick, inside one process); a
header or attribute digest would not do (a rewrite with other values and
the same shapes leaves the HDF5 header as it was).
The ctime also catches what keeps the mtime on purpose (``cp -p``,
``rsync -t``, ``touch -d``: a ctime cannot be set back).
"""
import hashlib
import os
import stat as _stat_mod
import threading
import time

_CACHE, _LOCK = {}, threading.Lock()

#: a file changed within this many seconds of now is racy (its stat fields
#: may not move on a rewrite): its identity holds a digest of its bytes.
#: Larger than the coarsest file-system tick (FAT's 2 s) plus a margin for
#: a file server's clock against this host's.
RACY_SECONDS = 10
#: file_identity's digest field of a racy file when no digest is asked for
RACY = "racy"
#: the largest racy file whose digest keys a cache of what a scan of its
#: keys found (an LMDB's metadata: the scan reads as many pages as the
#: digest, a larger database is scanned again each time instead)
HEADER_DIGEST_BYTES = 64 << 20
#: the largest racy file whose digest keys a cache of its header (an HDF5
#: split's shapes, a text file's token count): a start-up looks ~25 times
#: (each op's shapes, the plan, the notes), and a header is read in ~1.5
#: ms, as long as hashing 1 MiB takes (a 60 MB file: ~200 ms), so a larger
#: racy file's header is read again at each look instead
INFO_DIGEST_BYTES = 1 << 20
#: a racy file larger than this is not hashed: its stat fields key it, as
#: a file that is not racy (hashing it would cost a start-up seconds)
HASH_BYTES = 256 << 20
#: the block the digest reads at a time
_BLOCK = 1 << 20


def _stat(path):
    return os.stat(path)


def content_digest(path):
    """BLAKE2b (16 bytes, hex) of a file's bytes."""
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_BLOCK), b""):
            h.update(block)
    return h.hexdigest()


def file_identity(path, digest=True, now_ns=None):
    """``(real path, st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns,
    digest)`` of ``path``: ``digest`` is None unless the file is racy (its
    mtime or ctime within ``RACY_SECONDS`` of now, or in the future): then
    a regular file's content digest, or ``RACY`` where ``digest`` is False
    or a number of bytes the file is larger than (a caller that reads only
    a header of a possibly large file: ``INFO_DIGEST_BYTES``), and the
    caller keeps nothing it read (a header is cheap to read again). A racy
    file over ``HASH_BYTES`` is not read: its stat fields key it. Raises
    OSError when the file cannot be stat'ed."""
    st = _stat(path)
    now = time.time_ns() if now_ns is None else now_ns
    changed = max(st.st_mtime_ns, st.st_ctime_ns)
    hashed = None
    racy = now - changed < RACY_SECONDS * 10**9
    if racy and st.st_size > HASH_BYTES:
        # a large file just written (data made, then a run started): hashing
        # it costs seconds a look, waiting out its window up to RACY_SECONDS;
        # its stat fields key it, as an older file's (the limit: a same-size
        # rewrite within one timestamp tick of a file this large, inside one
        # process, is not noticed)
        racy = False
    if racy and (digest is False or (digest is not True and st.st_size > digest)):
        hashed = RACY  # the caller keeps nothing of a racy file
    elif racy and _stat_mod.S_ISREG(st.st_mode):
        try:
            hashed = content_digest(path)
        except OSError:  # unreadable: its reader says why
            hashed = ("unreadable", now)
    return (os.path.realpath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns,
            st.st_ctime_ns, hashed)


def same_version(held, identity, path):
    """Whether ``held`` (a ``file_identity`` taken when something was read)
    and ``identity`` (taken just now) are one version of ``path``: equal;
    or the same stat fields, ``held`` taken while the file was racy (a
    digest) and ``identity`` since it is not: then its bytes decide, hashed
    once more (a rewrite within the tick would have kept every stat field;
    from now on one moves them). Keeps a cache from loading an unchanged
    file again, and holding it twice, once its racy window has passed."""
    if held == identity:
        return True
    if held[:-1] != identity[:-1] or identity[-1] is not None or \
            not isinstance(held[-1], str) or held[-1] == RACY:
        return False
    try:
        return content_digest(path) == held[-1]
    except OSError:  # unreadable now: its reader says why
        return False


def per_file_version(path, load, stat_path=None, digest=True):
    """``load(path)``, once per ``file_identity`` of ``stat_path``
    (``digest``: ``INFO_DIGEST_BYTES`` where ``load`` reads only a header
    of a possibly large file, ``HEADER_DIGEST_BYTES`` where it scans an
    LMDB's keys: a larger racy file's is read every time)."""
    try:
        identity = file_identity(stat_path or path, digest)
    except OSError:
        return load(path)
    if identity[-1] == RACY:  # changed just now, no digest asked: read, keep nothing
        return load(path)
    # one version kept per (load, path): a rewritten file's replaces the old
    slot = (load, os.path.abspath(path))
    with _LOCK:
        held = _CACHE.get(slot)
    if held is not None and same_version(held[0], identity, stat_path or path):
        if held[0] != identity:  # checked past its racy window: keyed by stat now
            with _LOCK:
                _CACHE[slot] = (identity, held[1])
        return held[1]
    value = load(path)
    with _LOCK:  # another thread's read of this version first: theirs, shared
        held = _CACHE.get(slot)
        if held is not None and held[0] == identity:
            return held[1]
        _CACHE[slot] = (identity, value)
    return value

"""What a data file holds, read once per process and file version.

``per_file_version(path, load, stat_path=None)`` returns ``load(path)``,
kept per (absolute path, modification time, size) of ``stat_path`` (default
``path``): the readers' prefetch threads and the ranks' start-up checks
share one read, and a file rewritten in between is read again. A file that
cannot be stat'ed is read every time (its error then comes from ``load``).
"""
import os
import threading

_CACHE, _LOCK = {}, threading.Lock()


def per_file_version(path, load, stat_path=None):
    try:
        stat = os.stat(stat_path or path)
        tag = (load, os.path.abspath(path), stat.st_mtime_ns, stat.st_size)
    except OSError:
        return load(path)
    with _LOCK:
        value = _CACHE.get(tag)
    if value is None:
        value = load(path)
        with _LOCK:
            value = _CACHE.setdefault(tag, value)
    return value

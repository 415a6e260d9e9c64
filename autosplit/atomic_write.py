"""Write a file whole or not at all: a temporary file in the same folder, then one rename."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

__all__ = ["file_mode", "write_text_atomic"]


def file_mode(path: str | Path) -> int:
    """The permission bits a file written at ``path`` keeps: those of the file there, else
    what a new file gets under the process's umask."""
    try:
        return os.stat(path).st_mode & 0o777
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path``, replacing what is there only once all of it is
    written: into a temporary file beside ``path`` (with the permissions of the file it
    replaces: :func:`file_mode`), flushed to disk, then renamed over it (``os.replace``, atomic
    on one file system). On any failure the temporary file is removed and ``path`` is as it
    was.

    Raises:
        OSError: the folder is missing or not writable, the disk is full, or the rename fails.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, file_mode(path))
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise

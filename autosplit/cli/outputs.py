"""The files one command writes: checked before any work, written together once it succeeded.

What a command of the CLI guarantees with :func:`check_outputs` and :meth:`Outputs.commit`:

- **Inputs are never overwritten.** An output path that is one of the command's inputs (the
  same file after resolving symbolic links, or a hard link to it) is refused before any work,
  and so are two outputs naming the same file.
- **Outputs are checked up front.** Each output's folder must exist and be writable, the
  output must not be a folder or a special file (``/dev/null``), and a figure's extension must
  be one matplotlib writes.
- **All or nothing.** Nothing is written until the command has succeeded. Then every output is
  first written to a temporary file in its own folder; if any of these writes fails, the
  temporary files are removed and no output exists. Only then are they renamed into place
  (``os.replace``, atomic on one file system). If a rename fails, the outputs already renamed by
  this command are rolled back: the file each replaced is restored from a hard link taken
  before (where the file system has none, the new output is removed instead).
"""

from __future__ import annotations

import os
import secrets
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from autosplit.atomic_write import file_mode
from autosplit.errors import InvalidInputError

__all__ = ["Outputs", "check_outputs", "figure_formats"]

Writer = Callable[[Path], object]


def figure_formats() -> tuple[str, ...]:
    """File extensions matplotlib can save a figure as (``"png"``, ``"svg"``, ``"pdf"`` …)."""
    from matplotlib.figure import Figure

    return tuple(sorted(Figure().canvas.get_supported_filetypes()))


def _same_file(a: str, b: str) -> bool:
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)  # hard links, case-insensitive file systems
    except OSError:
        return False


def _check_target(option: str, path: str, figure: bool) -> None:
    shown = f"{option} {path!r}"
    if os.path.isdir(path):
        raise InvalidInputError(f"{shown} is a folder: give a file name, e.g. {option} "
                                f"{os.path.join(path, 'plan.png' if figure else 'plan.json')}")
    if os.path.lexists(path) and not os.path.islink(path) and not os.path.isfile(path):
        raise InvalidInputError(f"{shown} is not a regular file (a device or a pipe): autosplit "
                                "replaces the file it writes, so give a file name")
    folder = os.path.dirname(path) or "."
    if not os.path.exists(folder):
        raise InvalidInputError(f"cannot write {shown}: folder {folder!r} does not exist")
    if not os.path.isdir(folder):
        raise InvalidInputError(f"cannot write {shown}: {folder!r} is not a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise InvalidInputError(f"cannot write {shown}: folder {folder!r} is not writable")
    if figure:
        suffix = Path(path).suffix.lower().lstrip(".")
        formats = figure_formats()
        if suffix not in formats:
            found = f"extension .{suffix}" if suffix else "no extension"
            raise InvalidInputError(f"{shown} has {found}: a figure can be written as "
                                    f"{', '.join('.' + f for f in formats)}")


def check_outputs(outputs: Mapping[str, str | None], inputs: Mapping[str, str | None],
                  figures: tuple[str, ...] = ("--plot",)) -> Outputs:
    """Check the outputs of a command before it does any work.

    Args:
        outputs: option → path of each file the command may write (``None``: not asked for).
        inputs: what → path of each file the command reads (``None``: not given), e.g.
            ``{"the model file": "toy.py", "--profile": "profile.json"}``.
        figures: the options whose files are figures (their extension must be one
            :func:`figure_formats` lists).

    Raises:
        InvalidInputError: an output is an input, two outputs are one file, or an output cannot
            be written (see the module's docstring).
    """
    chosen = {option: str(path) for option, path in outputs.items() if path}
    read = {what: str(path) for what, path in inputs.items() if path}
    for option, path in chosen.items():
        for what, source in read.items():
            if _same_file(path, source):
                also = "" if path == source else f" {source!r}"
                raise InvalidInputError(f"{option} {path!r} is {what}{also}: autosplit never "
                                        "overwrites an input, so write to another file")
    seen: dict[str, str] = {}
    for option, path in chosen.items():
        for other, earlier in seen.items():
            if _same_file(path, earlier):
                raise InvalidInputError(f"{option} {path!r} and {other} {earlier!r} are the same "
                                        "file: give each output its own name")
        seen[option] = path
        _check_target(option, path, option in figures)
    return Outputs(tuple(chosen.items()))


@dataclass(frozen=True, slots=True)
class Outputs:
    """The checked outputs of one command: ``(option, path)`` pairs."""

    paths: tuple[tuple[str, str], ...]

    def commit(self, writers: Mapping[str, Writer]) -> list[str]:
        """Write the outputs named by ``writers`` (option → function writing a given path), all
        or none (see the module's docstring); returns the paths written, in order.

        Raises:
            InvalidInputError: a file could not be written (the message says which and why); no
                output of this call is left behind.
        """
        known = dict(self.paths)
        unknown = sorted(set(writers) - set(known))
        assert not unknown, f"outputs {unknown} were not checked before the command ran"
        staged: list[tuple[str, str, str]] = []  # (option, temporary file, target)
        try:
            for option, write in writers.items():
                target = known[option]
                staged.append((option, _temporary(target), target))
                try:
                    write(Path(staged[-1][1]))
                except OSError as exc:
                    raise InvalidInputError(f"cannot write {option} {target!r}: {_reason(exc)}; "
                                            "no file was written") from exc
            _rename_all(staged)
        finally:
            for _, tmp, _ in staged:
                if os.path.lexists(tmp):
                    os.unlink(tmp)
        return [target for _, _, target in staged]


def _temporary(target: str) -> str:
    """A new empty file beside ``target``, with ``target``'s extension and the permissions
    ``target`` has (or a new file would get)."""
    folder = os.path.dirname(target) or "."
    name = os.path.basename(target)
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{name}.", suffix=Path(name).suffix)
    except OSError as exc:
        raise InvalidInputError(f"cannot write {target!r}: {_reason(exc)}") from exc
    os.fchmod(fd, file_mode(target))
    os.close(fd)
    return tmp


def _rename_all(staged: list[tuple[str, str, str]]) -> None:
    """Move every temporary file onto its target; on a failure, undo those already moved."""
    done: list[tuple[str, str | None]] = []  # (target, hard link to the file it replaced)
    try:
        for option, tmp, target in staged:
            backup = _backup(target)
            try:
                os.replace(tmp, target)
            except OSError as exc:
                if backup is not None:
                    os.unlink(backup)
                raise InvalidInputError(f"cannot write {option} {target!r}: {_reason(exc)}; the "
                                        "outputs of this command were rolled back") from exc
            done.append((target, backup))
    except BaseException:
        for target, backup in reversed(done):
            try:
                if backup is not None:
                    os.replace(backup, target)
                else:
                    os.unlink(target)
            except OSError:  # pragma: no cover - the folder changed under us
                pass
        raise
    for _, backup in done:
        if backup is not None:
            os.unlink(backup)


def _backup(target: str) -> str | None:
    """A hard link to the file at ``target`` (to restore it), or None (no file, or no links)."""
    if not os.path.lexists(target) or os.path.isdir(target):
        return None
    folder = os.path.dirname(target) or "."
    link = os.path.join(folder, f".{os.path.basename(target)}.{secrets.token_hex(6)}.old")
    try:
        os.link(target, link, follow_symlinks=False)
    except OSError:
        return None
    return link


def _reason(exc: OSError) -> str:
    return exc.strerror or str(exc) or type(exc).__name__

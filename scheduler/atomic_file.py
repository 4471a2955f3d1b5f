"""Files that readers see whole or not at all: a temporary file in the same folder, fsynced,
renamed over the target; and the folder-level pieces the checkpoint and history writers share."""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from typing import Callable, Iterator

TMP_SUFFIX = ".tmp"


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[str]:
    """Yields a temporary path to write; on success it replaces `path`, on error it is removed.
    Temporaries are named `.<name>.<random>.tmp`, so a crashed writer's leftovers are easy to find."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=TMP_SUFFIX)
    os.close(fd)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp made it private; the result is an ordinary file
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        f.write(text)


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a folder's renames and unlinks durable (best effort: not every file system can)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def link_or_copy(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """A hard link (free, and immune to the source's name being replaced or deleted later); a copy
    where src sits on another file system."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


@contextlib.contextmanager
def new_folder(target: str, prefix: str, complete: Callable[[str], bool]) -> Iterator[str]:
    """Yields a temporary folder beside `target` to fill; on success it is renamed into place (if
    another writer finished `target` first, `complete(target)` says so and theirs stays), and in
    any case the temporary goes: an interrupted writer leaves nothing half-written."""
    parent = os.path.dirname(os.path.abspath(target))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent, prefix=prefix)
    try:
        yield tmp
        os.chmod(tmp, 0o755)  # mkdtemp made it private; the result is an ordinary folder
        try:
            os.rename(tmp, target)  # replaces an empty target folder too
        except OSError:
            if not complete(target):
                raise
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)


def remove_stale(root: str | os.PathLike, matches: Callable[[str], bool], max_age_s: float) -> None:
    """Delete the files and folders of `root` whose name matches and that nobody touched for
    max_age_s: a killed writer's leftovers (a fresh one may belong to a writer still running)."""
    now = time.time()
    try:
        entries = list(os.scandir(root))
    except OSError:
        return
    for entry in entries:
        with contextlib.suppress(OSError):
            if matches(entry.name) and now - entry.stat(follow_symlinks=False).st_mtime > max_age_s:
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path, ignore_errors=True)
                else:
                    os.unlink(entry.path)

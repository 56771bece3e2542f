"""Copy one committed step into another checkpoint folder: local <-> S3, bucket to bucket.

A copy is a writer of the destination folder like a job, and follows the same protocol:

1. the source step must be committed (its COMMIT recorded by its folder's lease, the manifest
   matching it; with keys configured, its signature checked) and not abandoned by a rollback;
2. the destination's lease is taken for the whole copy (a folder leased by a live job is
   refused: CheckpointLockedError names the holder), so no job can start there meanwhile and
   the copy's commit goes into the lease's record like a save's;
3. `prepare_step` empties `step-N/` (an earlier interrupted copy's leftover goes; a committed
   step-N is refused unless `overwrite`, then removed marker first);
4. every file streams through a bounded thread pool, one chunk at a time, its size, CRC32C
   and digest (when the manifest has one) computed from the bytes as they pass and checked
   against the manifest before the destination object is closed: a corrupt source file never
   becomes a whole object there, and the copy stops with CheckpointCorruptError naming it;
5. `commit.commit_copy`: the manifest byte for byte (an HMAC signature of it stays valid: it
   is carried over in the new COMMIT), COMMIT last with a create-if-absent, then the record in
   the destination's lease: the commit point. The COMMIT names the copier's lease generation;
   the manifest keeps the source's.

Killed at any point before the record, the destination holds a step folder without a recorded
COMMIT: no reader counts it, and the next copy of that step (or the next job, or `forge-ckpt
gc`) removes it. On an error the copy removes its own partial step itself.
"""

from __future__ import annotations

import contextlib
import json
import logging
import posixpath
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

from ..errors import CheckpointCorruptError, CheckpointError, CheckpointLockedError
from ..storage import FileRecord, Storage, StorageError, crc32c_of_bytes, open_storage
from ..storage.base import Checksums, check_record, expected_algo
from . import branch, commit, layout
from .lock import Lease
from .signing import Signer

log = logging.getLogger("forge_ckpt")
CHUNK = 16 * 1024 * 1024  # bytes held per file in flight: memory is about workers x this
# (path, its bytes, bytes copied so far, bytes in all): called after each file
Progress = Callable[[str, int, int, int], None]


@dataclass
class CopyResult:
    step: int
    source: str  # URL of the source step folder
    dest: str  # URL of the destination step folder
    files: int
    nbytes: int
    seconds: float


def copy_step(
    src: str | Storage,
    step: int,
    dest: str | Storage,
    *,
    src_options: dict[str, Any] | None = None,
    dest_options: dict[str, Any] | None = None,
    overwrite: bool = False,
    workers: int = 4,
    lease_ttl_s: float = 60.0,
    signer: Signer | None = None,
    progress: Progress | None = None,
) -> CopyResult:
    """Copy committed step `step` of checkpoint folder `src` into folder `dest` and commit it
    there (see the module docstring). `*_options`: storage options of an `s3://` folder
    (endpoint, credentials; docs/storage.md). `signer`: checks the source's signature when it
    has keys (default: the environment's keys, if any); the signature is kept either way."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    source = src if isinstance(src, Storage) else open_storage(src, src_options)
    target = dest if isinstance(dest, Storage) else open_storage(dest, dest_options)
    _check_folders(source, target)
    start = time.perf_counter()
    data, signature, manifest = read_source(source, step, signer or Signer.from_config())
    lease = Lease(target, lease_ttl_s)
    try:
        target.makedirs("")
        lease.acquire()
    except CheckpointLockedError as e:
        raise CheckpointLockedError(f"cannot copy step {step} into {target.url}: {e}") from None
    try:
        _copy_under_lease(source, target, step, (data, signature, manifest), overwrite, workers,
                          progress)  # fmt: skip
    except CheckpointCorruptError as e:
        if layout.is_committed(source, step):
            raise
        raise CheckpointError(
            f"step {step} of {source.url} was removed while it was copied (retention or a "
            f"rollback of the job writing that folder?): {e}. Nothing was committed at "
            f"{target.url}; copy a newer step"
        ) from e
    finally:
        lease.release()
    name = layout.step_name(step)
    result = CopyResult(step, source.where(name), target.where(name), len(manifest.files),
                        manifest.nbytes, time.perf_counter() - start)  # fmt: skip
    log.info("copied step %d to %s: %d files, %.1f MB in %.2fs", step, result.dest,
             result.files, result.nbytes / 1e6, result.seconds)  # fmt: skip
    return result


def _check_folders(source: Storage, target: Storage) -> None:
    for store in (source, target):
        if store.url.startswith("mem://"):
            raise ValueError(f"{store.url}: copy works between durable folders (local, s3://)")
    if source.url == target.url:
        raise ValueError(f"source and destination are the same folder ({source.url})")


def read_source(
    source: Storage, step: int, signer: Signer
) -> tuple[bytes, str | None, layout.Manifest]:
    """The committed step's manifest bytes (those copied, tied by their CRC to the marker that
    was checked), the signature its COMMIT carries, and the parsed manifest."""
    layout.read_committed(source, step, signer if signer.active else None)
    if step in branch.superseded(source):
        raise CheckpointError(
            f"step {step} of {source.url} was abandoned by a rollback (a newer branch's "
            "committed step supersedes it): no job resumes from it; copy a live step"
        )
    name = layout.step_name(step)
    marker = json.loads(source.read(f"{name}/{layout.MARKER}", 0, 4096))
    data = bytes(source.read(f"{name}/{layout.MANIFEST}"))
    if crc32c_of_bytes(data) != marker.get("manifest_crc32c"):
        raise CheckpointCorruptError(
            source.where(name), "the step changed while it was read (saved again meanwhile?)",
            "copy it again",
        )  # fmt: skip
    manifest = layout.Manifest.from_bytes(data, source.where(f"{name}/{layout.MANIFEST}"))
    return data, marker.get("signature"), manifest


def _copy_under_lease(
    source: Storage,
    target: Storage,
    step: int,
    what: tuple[bytes, str | None, layout.Manifest],
    overwrite: bool,
    workers: int,
    progress: Progress | None,
) -> None:
    """Steps 3-5 of the module docstring; a failure before the commit removes the step."""
    data, signature, manifest = what
    name = layout.step_name(step)
    if layout.is_marked(target, step):
        if not overwrite:
            raise CheckpointError(
                f"step {step} is already committed at {target.where(name)}; pass "
                "overwrite=True (--overwrite) to replace it"
            )
        log.warning("replacing committed step %d at %s", step, target.where(name))
        commit.remove_step(target, step)
    commit.prepare_step(target, step)
    committing = False
    try:
        _copy_files(source.sub(name), target.sub(name), manifest.files, workers, progress)
        committing = True
        commit.commit_copy(target, step, data, signature)
    except BaseException as e:
        if not committing or getattr(e, "not_committed", False):
            _discard(target, step)
        raise


def _discard(target: Storage, step: int) -> None:
    try:
        commit.remove_if_uncommitted(target, step)
    except (OSError, CheckpointError) as e:  # not committed: the next copy or job removes it
        log.warning("could not remove the partial copy of step %d: %s", step, e)


def _copy_files(
    source: Storage,
    target: Storage,
    files: list[FileRecord],
    workers: int,
    progress: Progress | None,
) -> None:
    """Every file, `workers` at a time; the first failure cancels the files not yet begun."""
    folders = sorted({posixpath.dirname(f.path) for f in files} - {"", *_PREPARED})
    for folder in folders:
        target.makedirs(folder)
    total, done, mutex = sum(f.size for f in files), [0], threading.Lock()

    def one(rec: FileRecord) -> None:
        copy_file(source, target, rec)
        with mutex:
            done[0] += rec.size
            if progress is not None:
                progress(rec.path, rec.size, done[0], total)

    with ThreadPoolExecutor(workers, thread_name_prefix="forge-ckpt-copy") as pool:
        futures: list[Future] = [pool.submit(one, rec) for rec in files]
        finished, _ = wait(futures, return_when=FIRST_EXCEPTION)
        failed = next((f for f in finished if f.exception() is not None), None)
        if failed is not None:
            for f in futures:
                f.cancel()
            raise failed.exception()  # type: ignore[misc]
    for folder in folders:  # the names of their files (actors/, trainer/: by the commit)
        target.sync_dir(folder)


_PREPARED = (layout.ACTORS, layout.TRAINER)  # made by prepare_step, synced by the commit


def copy_file(source: Storage, target: Storage, rec: FileRecord) -> FileRecord:
    """Stream one file, checked against its manifest record before the copy is closed."""
    where = source.where(rec.path)
    sums = Checksums(expected_algo(rec))
    with target.writer(rec.path, exclusive=True) as out:
        while sums.size < rec.size:
            chunk = _read(source, rec.path, sums.size, min(sums.size + CHUNK, rec.size))
            if not chunk:
                break  # shorter than the manifest says: check_record names it
            sums.update(chunk)
            out.write(chunk)
        size = sums.size + len(_read(source, rec.path, rec.size, rec.size + 1))
        check_record(where, size, sums.crc, rec, sums.record(rec.path))
        wrote = out.close()
    if (wrote.size, wrote.crc32c) != (rec.size, rec.crc32c):
        raise StorageError(
            f"{target.where(rec.path)}: the destination holds {wrote.size} bytes with crc32c "
            f"{wrote.crc32c}, not the {rec.size} bytes read ({rec.crc32c}); copy again"
        )
    return wrote


def _read(source: Storage, path: str, start: int, end: int) -> bytearray:
    try:
        return source.read(path, start, end)
    except FileNotFoundError:
        raise CheckpointCorruptError(source.where(path), "file is missing") from None


@contextlib.contextmanager
def copy_progress(console: Any) -> Iterator[Progress]:
    """A progress callback for the CLI: a rich bar on a terminal, one plain line per file
    otherwise (greppable in logs)."""
    if not console.is_terminal:
        yield lambda path, size, done, total: console.print(
            f"copied {path} ({size / 1e6:,.1f} MB; {done / max(total, 1):.0%} of "
            f"{total / 1e6:,.1f} MB)", markup=False, highlight=False,
        )  # fmt: skip
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

    with Progress("copy", BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  console=console, transient=True) as bar:  # fmt: skip
        task = bar.add_task("copy", total=None)
        yield lambda path, size, done, total: bar.update(task, completed=done, total=total)

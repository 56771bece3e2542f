"""A `copy_step` that SIGKILLs its own process at one point of the copy.

Run by tests/test_copy.py as `python copy_child.py SRC_FOLDER STEP DEST POINT` (S3 options,
if any, as JSON in FORGE_CKPT_TEST_DEST_OPTIONS). The kill points are set by wrapping
forge_ckpt's own functions in this process only, as tests/crash_child.py does for saves.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading

from forge_ckpt.steps import commit, transfer
from forge_ckpt.steps.lock import Lease
from forge_ckpt.storage.local import LocalWriter
from forge_ckpt.storage.s3 import S3Writer

POINTS = ("mid_file", "after_file", "after_manifest", "after_marker", "after_record")


def die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def mid_file(real):
    def write(self, data):
        real(self, data)
        if self.path.startswith("actors/"):
            die()

    return write


def install(point: str) -> None:
    calls = [0]
    mutex = threading.Lock()

    def counted(real, when):  # die after the `when`-th call of `real` (any thread)
        def wrapper(*args, **kwargs):
            out = real(*args, **kwargs)
            with mutex:
                calls[0] += 1
                if calls[0] >= when:
                    die()
            return out

        return wrapper

    if point == "mid_file":  # an actor file's first 64 KiB written, the rest not
        transfer.CHUNK = 64 * 1024
        for cls in (LocalWriter, S3Writer):
            cls.write = mid_file(cls.write)  # type: ignore[method-assign]
    elif point == "after_file":
        transfer.copy_file = counted(transfer.copy_file, 1)
    elif point == "after_record":
        Lease.record = counted(Lease.record, 1)  # type: ignore[method-assign]
    else:
        real_create = commit._create
        name = "manifest.json" if point == "after_manifest" else "COMMIT"

        def create(store, path, data, lease):
            real_create(store, path, data, lease)
            if path.endswith(name):
                die()

        commit._create = create


def main() -> None:
    src, step, dest, point = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    install(point)
    options = json.loads(os.environ.get("FORGE_CKPT_TEST_DEST_OPTIONS", "{}"))
    transfer.copy_step(src, step, dest, dest_options=options or None)
    print("copy completed")


if __name__ == "__main__":
    main()

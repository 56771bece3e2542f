"""What the tiers benchmark borrows from the rest of the suite: benchmarks/disk.py's raw-disk
baselines and page-cache control, and benchmarks/run.py's machine description.

Typed here, imported for real at run time: mypy checks the tiers modules against these
signatures without following into disk.py and run.py, which do not pass mypy on their own
(numpy's stubs, and the modules run.py pulls in) and are not the tiers benchmark's to change.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

MiB = 1 << 20

if TYPE_CHECKING:

    def settle() -> None: ...
    def python_write(path: str, nbytes: int) -> float: ...
    def cold_read(path: str, method: str) -> float: ...
    def drop_cache(paths: list[str], method: str) -> None: ...
    def drop_cache_method() -> str: ...
    def remove(path: str) -> None: ...
    def mem_available() -> int: ...
    def machine_info(work_dir: str) -> dict[str, Any]: ...

else:
    from .disk import (  # noqa: F401
        cold_read,
        drop_cache,
        drop_cache_method,
        mem_available,
        python_write,
        remove,
        settle,
    )

    def machine_info(work_dir: str) -> dict[str, Any]:
        """Cores, CPU, RAM, kernel, the disk's file system, versions (run.py's description)."""
        from .run import machine_info as describe

        return describe(work_dir)

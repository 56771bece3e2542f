"""The GPU section: async `save()` blocking with the trainer's state on a CUDA device."""

from __future__ import annotations

from collections.abc import Callable

from .common import fmt, gib, series, table


def _rows(gpu: dict) -> list[list[str]]:
    trials = gpu["trials"]

    def col(fn: Callable[[dict], float], digits: int = 3) -> str:
        return fmt(series(trials, fn), digits)

    return [
        ["trainer state", gib(gpu["trainer"]["tensor_bytes"])],
        ["forge_ckpt async: `save()` blocked, s", col(lambda r: r["forge_async"]["blocked_s"])],
        ["bare device-to-host copy into pinned memory, s", col(lambda r: r["d2h_copy"])],
        [
            "forge_ckpt blocked / bare copy",
            col(lambda r: r["forge_async"]["blocked_s"] / r["d2h_copy"], 2),
        ],
        [
            "TorchTitan async: `dcp_save` blocked, s",
            col(lambda r: r["titan_async"]["blocked_s"]),
        ],
        [
            "forge_ckpt blocked / TorchTitan async blocked",
            col(lambda r: r["forge_async"]["blocked_s"] / r["titan_async"]["blocked_s"], 2),
        ],
        ["forge_ckpt async: `save()` to commit, s", col(lambda r: r["forge_async"]["total_s"])],
        ["TorchTitan async: to written, s", col(lambda r: r["titan_async"]["total_s"])],
        ["forge_ckpt sync save, s", col(lambda r: r["forge_sync"]["total_s"])],
    ]


def gpu_section(gpu: dict) -> list[str]:
    return [
        "## GPU\n",
        "Trainer only, its model and AdamW state on the GPU. `save()` in async mode returns "
        "once the state is copied into pinned CPU buffers that are reused between saves; "
        "the bare copy is a loop of `copy_` into pinned buffers allocated beforehand (the "
        "floor of any snapshot), TorchTitan async is `dcp_save` with `AsyncMode.ASYNC` on "
        "the same tensors.\n",
        table(["GPU figure", "median (min-max)"], _rows(gpu)),
        "",
    ]

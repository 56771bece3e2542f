"""forge_ckpt's benchmark suite: `python -m benchmarks.run` (or `make bench`).

Every figure is a ratio against a baseline measured in the same run on the same disk (raw
fsync'd writes, cold reads, `torch.save`, TorchTitan's `CheckpointManager` alone), so the
results stay comparable on machines whose disks differ or drift. The run writes
`docs/benchmarks.md`, `docs/benchmarks.json` and the plots under `docs/img/`.

Modules: `disk` (raw baselines, page-cache control), `contention` (the load average and the
competing-load flag every benchmark records), `actors` / `trainer_rank` / `timers` (the Ray
trainer and actors under test, with phase timers), `experiments` (the measurements),
`sections` (each stand-alone benchmark's section of the page). Subpackages, one per subject:
`storage` (the storage part: S3 and local DCP I/O, no Ray; the S3 client comparison), `grpo`
(the GRPO app's step overhead and trainer save: `python -m benchmarks.grpo.overhead`,
`python -m benchmarks.grpo.save`), `report` (one module per section of the page: tables,
plots). Stand-alone: `python -m benchmarks.integrity`, `python -m benchmarks.stall`,
`python -m benchmarks.tiers`.
"""

import logging


def setup_logging() -> None:
    """The benchmarks' progress lines with a time stamp; forge_ckpt's own only if they warn."""
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(name)s %(message)s", datefmt="%H:%M:%S"
    )
    logging.getLogger("forge_ckpt").setLevel(logging.WARNING)

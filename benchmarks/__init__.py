"""forge_ckpt's benchmark suite: `python -m benchmarks.run` (or `make bench`).

Every figure is a ratio against a baseline measured in the same run on the same disk (raw
fsync'd writes, cold reads, `torch.save`, TorchTitan's `CheckpointManager` alone), so the
results stay comparable on machines whose disks differ or drift. The run writes
`docs/benchmarks.md`, `docs/benchmarks.json` and the plots under `docs/img/`.

Modules: `disk` (raw baselines, page-cache control), `actors` / `trainer_rank` / `timers` (the
Ray trainer and actors under test, with phase timers), `experiments` (the measurements),
`storage_bench` / `storage_methods` (the storage part: S3 and local DCP I/O, no Ray), `report`
(a package, one module per section of the page: tables, plots).
"""

"""DatasetActor: serves prompt batches through torchdata's `StatefulDataLoader`.

Order: the loader shuffles with a `torch.Generator` that is re-seeded from (seed, epoch) at the
start of every epoch, so epoch e's order depends on nothing but the seed. Items are built by
`num_workers` worker processes (0 = in this process).

State: the epoch, the loader's own `state_dict()` (sampler position and generator, worker
states) and what identifies the data. The loader counts only batches it has handed out, so the
cursor saved is exactly what the training loop consumed, never what workers prefetched.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from forge_ckpt import Checkpointable, CheckpointMismatchError

from .seeding import derive_seed, seed_process
from .task import SortDataset, collate


class DatasetActor(Checkpointable):
    def __init__(self, seed: int, task_cfg: dict, data_cfg: dict, batch_size: int) -> None:
        seed_process(seed, "dataset")
        warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
        self.seed = seed
        self.batch_size = batch_size
        self.num_workers = int(data_cfg.get("num_workers", 2))
        self.dataset = SortDataset(
            seed=seed,
            size=int(data_cfg["size"]),
            alphabet=task_cfg["alphabet"],
            min_len=int(task_cfg["min_len"]),
            max_len=int(task_cfg["max_len"]),
        )
        if len(self.dataset) < batch_size:
            raise ValueError(f"dataset.size={len(self.dataset)} < batch size {batch_size}")
        self.generator = torch.Generator().manual_seed(self._epoch_seed(0))
        self.loader = StatefulDataLoader(
            self.dataset,
            batch_size=batch_size,
            shuffle=True,
            generator=self.generator,
            num_workers=self.num_workers,
            collate_fn=collate,
            drop_last=True,
        )
        self.epoch = 0
        self.batches_served = 0
        self._iter: Any = None

    def next_batch(self) -> dict[str, list]:
        """The next `batch_size` prompts: {"id": [...], "prompt": [...], "answer": [...]}."""
        if self._iter is None:  # first call, or first after a load: the loader resumes
            self._iter = iter(self.loader)
        try:
            batch = next(self._iter)
        except StopIteration:
            self.epoch += 1
            self.generator.manual_seed(self._epoch_seed(self.epoch))
            self._iter = iter(self.loader)
            batch = next(self._iter)
        self.batches_served += 1
        return batch

    def _epoch_seed(self, epoch: int) -> int:
        return derive_seed(self.seed, f"shuffle-epoch-{epoch}")

    def identity(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "num_workers": self.num_workers,
            "batch_size": self.batch_size,
            "dataset_size": len(self.dataset),
            "dataset_hash": self.dataset.content_hash(),
        }

    # ---- Checkpointable -----------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "batches_served": self.batches_served,
            "loader": self.loader.state_dict(),
            "identity": self.identity(),
        }

    def validate_state_dict(self, state: dict[str, Any]) -> None:
        saved, current = state["identity"], self.identity()
        diffs = [
            f"dataset {key} changed: checkpoint={saved.get(key)}, current={current[key]}"
            for key in current
            if saved.get(key) != current[key]
        ]
        if diffs:
            raise CheckpointMismatchError(
                diffs,
                hint="resume with the dataset settings the checkpoint was taken with "
                "(dataset.num_workers included: worker states are per worker), or start fresh",
            )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch = int(state["epoch"])
        self.batches_served = int(state["batches_served"])
        self._iter = None
        self.loader.load_state_dict(state["loader"])  # applied by the next iter(loader)

"""DatasetActor: one of `dataset.replicas` actors that together serve each step's prompts.

Order: epoch e's order is a pure function of (seed, e): a permutation of the dataset's indices
cut to a whole number of batches (`epoch_order`). Replica k of K serves `order[k::K]`, in that
order, `batch_size / K` prompts a step; the step's batch is the replicas' parts in replica
order. Items are built by `num_workers` DataLoader worker processes (0 = in this process); an
item is a function of its index only, so the workers hold no state that matters.

State: the epoch, the indices of it this replica has served (`consumed`, sorted) and the ones it
still has to serve (`remaining`, in order), and what identifies the data. Only batches handed
out count as consumed, never what workers prefetched. Because the record is by index, a resume
may change `num_workers` (logged), and the replica count through `reshard_states`, which
merges the consumed sets and deals the rest of the epoch out again: every prompt is still
served exactly once per epoch. A changed seed, dataset or batch size is refused.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader

from forge_ckpt import Checkpointable, CheckpointMismatchError, reshard

from .seeding import derive_seed, seed_process
from .task import SortDataset, collate

FIXED = ("seed", "batch_size", "dataset_size", "dataset_hash")  # a change cannot be resumed


def epoch_order(seed: int, epoch: int, size: int, batch_size: int) -> list[int]:
    """Epoch `epoch`'s prompts in order: whole batches only (the rest waits for later epochs)."""
    gen = torch.Generator().manual_seed(derive_seed(seed, f"shuffle-epoch-{epoch}"))
    return torch.randperm(size, generator=gen)[: size // batch_size * batch_size].tolist()


class DatasetActor(Checkpointable):
    def __init__(
        self,
        seed: int,
        task_cfg: dict,
        data_cfg: dict,
        batch_size: int,
        replica: int = 0,
        replicas: int = 1,
    ) -> None:
        seed_process(seed, "dataset" if replica == 0 else f"dataset-{replica}")
        if batch_size % replicas:
            raise ValueError(
                f"dataset.batch_size={batch_size} is not divisible by dataset.replicas={replicas}"
            )
        self.seed, self.batch_size = seed, batch_size
        self.replica, self.replicas, self.share = replica, replicas, batch_size // replicas
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
        self._start_epoch(0)

    def _start_epoch(self, epoch: int) -> None:
        order = epoch_order(self.seed, epoch, len(self.dataset), self.batch_size)
        self.epoch, self.consumed, self.remaining = epoch, [], order[self.replica :: self.replicas]
        self._iter: Any = None

    def next_batch(self, before: dict[str, list] | None = None) -> dict[str, list]:
        """This replica's `batch_size / replicas` prompts appended to `before` (the parts of the
        replicas before it): {"id": [...], "prompt": [...], "answer": [...]}."""
        if not self.remaining:
            self._start_epoch(self.epoch + 1)
        if self._iter is None:  # epoch start, or first call after a load
            loader = DataLoader(
                self.dataset,
                batch_size=self.share,
                sampler=list(self.remaining),
                num_workers=self.num_workers,
                collate_fn=collate,
            )
            self._iter = iter(loader)
        batch = next(self._iter)
        assert batch["id"] == self.remaining[: self.share], "the loader left the recorded order"
        del self.remaining[: self.share]
        self.consumed += batch["id"]
        return batch if before is None else {k: before[k] + batch[k] for k in batch}

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
            "consumed": sorted(self.consumed),
            "remaining": list(self.remaining),
            "identity": self.identity(),
        }

    def validate_state_dict(self, state: dict[str, Any]) -> list[str]:
        """Refuse what changes the data; name (and accept) a changed worker count."""
        if "remaining" not in state:
            raise CheckpointMismatchError(
                [
                    "dataset: the checkpoint holds a loader position, not the consumed-index "
                    "record this version of the app resumes from"
                ],  # fmt: skip
                hint="resume it with the app version that wrote it, or start fresh",
            )
        saved, current = state["identity"], self.identity()
        changed = {k: f"dataset {k} changed: checkpoint={saved.get(k)}, current={current[k]}"
                   for k in current if saved.get(k) != current[k]}  # fmt: skip
        refused = [line for k, line in changed.items() if k in FIXED]
        if refused:
            raise CheckpointMismatchError(
                refused,
                hint="resume with the seed, dataset and batch size the checkpoint was taken "
                "with, or start fresh",
            )
        if len(state["remaining"]) % self.share:
            raise CheckpointMismatchError(
                [
                    f"dataset replica {self.replica}: {len(state['remaining'])} prompts left in "
                    f"the epoch, not a multiple of its {self.share} per step"
                ]  # fmt: skip
            )
        return [line for k, line in changed.items() if k not in FIXED]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch = int(state["epoch"])
        self.consumed, self.remaining = list(state["consumed"]), list(state["remaining"])
        self._iter = None  # the next batch builds a loader over what remains

    @staticmethod
    def reshard_states(states: list[dict[str, Any]], replicas: int) -> list[dict[str, Any]]:
        """N replicas' records -> M: the consumed sets merged, the rest of the epoch dealt out
        in epoch order (`remaining[j::M]`), checked to make up the epoch exactly."""
        ident = states[0]["identity"]
        order = epoch_order(
            ident["seed"], states[0]["epoch"], ident["dataset_size"], ident["batch_size"]
        )
        return reshard.repartition_indices(states, replicas, order=order)

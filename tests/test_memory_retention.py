"""Memory retention when two runs of it overlap (no Ray: the tier's retention works on any
storage). A save cancelled by its caller's deadline leaves its retention running in its
thread while the next save's begins; both worked on one shared list, and the second
`list.remove` of a step raised ValueError out of a save that had committed (found by the
simulation, forge_ckpt/sim)."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

from forge_ckpt.memory.tier import MemoryTier
from forge_ckpt.storage import StorageSpec
from forge_ckpt.storage.local import LocalStorage


class HeldDelete(LocalStorage):
    """The first delete waits until the test lets it go."""

    def __init__(self, spec: StorageSpec) -> None:
        super().__init__(spec)
        self.entered, self.go = threading.Event(), threading.Event()
        self.held = False

    def delete(self, path: str) -> None:
        if not self.held:
            self.held = True
            self.entered.set()
            assert self.go.wait(60)
        super().delete(path)


def tier_on(store: LocalStorage, keep: int) -> MemoryTier:
    tier: Any = MemoryTier.__new__(MemoryTier)
    tier.config = SimpleNamespace(memory_keep=keep)
    tier.store, tier._pinned, tier._recent = store, set(), None
    return tier


def test_overlapping_retentions_both_finish_and_keep_the_newest(tmp_path):
    store = HeldDelete(StorageSpec(str(tmp_path)))
    for step in (1, 2, 3, 4):
        store.makedirs(f"step-{step}")
        store.write(f"step-{step}/COMMIT", b"x")
    tier = tier_on(store, keep=1)
    tier._recent = [1, 2]
    errors: list[BaseException] = []

    def first() -> None:
        try:
            tier._retention(3)  # removes 1 and 2; held in the delete of step 1's marker
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=first)
    t.start()
    assert store.entered.wait(60)
    tier._retention(4)  # the next save's, meanwhile: removes 1, 2 and 3
    store.go.set()
    t.join(60)
    assert not t.is_alive()
    assert errors == []
    assert [s for s in (1, 2, 3, 4) if store.exists(f"step-{s}/COMMIT")] == [4]
    assert tier._recent == [4]

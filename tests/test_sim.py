"""The deterministic simulation of the protocol (forge_ckpt/sim, docs/protocol.md): seeded
schedules of the real coordinator, commit, lease and storage code under faults, with the
invariants checked as they run; and proof that it catches a fix taken back out."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

pytest.importorskip("greenlet", reason="the simulation needs greenlet (pip install -e '.[sim]')")

from forge_ckpt import branch, lock  # noqa: E402
from forge_ckpt.commit import retire_after  # noqa: E402
from forge_ckpt.sim.scenario import run_seed  # noqa: E402
from forge_ckpt.storage.s3 import S3Storage  # noqa: E402

SEEDS = int(os.environ.get("FORGE_CKPT_SIM_SEEDS", "1000"))


@pytest.fixture(autouse=True)
def quiet():
    logging.getLogger("forge_ckpt").setLevel(logging.CRITICAL)
    yield
    logging.getLogger("forge_ckpt").setLevel(logging.NOTSET)


def first_violation(seeds: range) -> tuple[int, str] | None:
    for seed in seeds:
        out = run_seed(seed)
        if out.violation is not None:
            return seed, out.violation
    return None


@pytest.mark.timeout(1200)
def test_every_schedule_keeps_every_invariant():
    """The default budget, in a process of its own: the same hash seed as a replay (set order
    must not differ), and a schedule that hangs ends that process with its stacks, not this."""
    cmd = [sys.executable, "-m", "forge_ckpt.sim", "--seeds", str(SEEDS), "--hang-s", "120"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1100)
    print(done.stdout[-3000:])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"{SEEDS} schedules in" in done.stdout and "0 violated" in done.stdout


@pytest.mark.timeout(120)
def test_a_seed_replays_exactly():
    """Same seed, same schedule, event for event (what makes a failure reproducible)."""
    for seed in (3, 4):  # one on S3, one on POSIX
        a, b = run_seed(seed), run_seed(seed)
        assert a.trace == b.trace
        assert len(a.trace) > 50


@pytest.mark.timeout(300)
def test_it_finds_the_rollback_that_retires_before_the_new_branch_commits(monkeypatch):
    """Fix 2 taken back out: the first save after load(step=K) retires the newer steps at
    once. A save that then fails has lost them (I1)."""

    def retire_now(store, branch_from):  # the old behaviour
        retire_after(store, branch_from)
        return []

    monkeypatch.setattr(branch, "abandoned_by", retire_now)
    found = first_violation(range(200))
    assert found is not None and found[1].startswith("I1"), found


@pytest.mark.timeout(300)
def test_it_finds_a_lost_reply_taken_for_another_writer(monkeypatch):
    """Fix 7 taken back out: a conditional write whose reply was lost, retried, meets its own
    write and reads as another writer's (I7)."""
    monkeypatch.setattr(S3Storage, "_applied", lambda self, path, data: None)
    monkeypatch.setattr(lock.Lease, "_own_write", lambda self, data: None)
    found = first_violation(range(200))
    assert found is not None and found[1].startswith("I7"), found


@pytest.mark.timeout(300)
def test_it_finds_a_late_commit_when_readers_ignore_the_lease_record(monkeypatch):
    """Fix 8 taken back out: readers count every COMMIT, not only those the lease records.
    A stalled job's COMMIT that lands after its successor took over then counts (I1 or I3).
    The default budget (seeds 0-999) does not reach such a schedule; seed 2376 is the first
    that does (`make simulate SEEDS=3000` finds it), so this replays the seeds around it."""
    from forge_ckpt.layout import Fence

    monkeypatch.setattr(Fence, "admits", lambda self, step: True)
    monkeypatch.setattr(Fence, "problem", lambda self, step, marker: None)
    found = first_violation(range(2300, 2400))
    assert found is not None and found[1][:2] in ("I1", "I3"), found

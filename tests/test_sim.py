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

from forge_ckpt.sim.runner import DEFAULT_SEEDS  # noqa: E402
from forge_ckpt.sim.scenario import run_seed  # noqa: E402

SEEDS = int(os.environ.get("FORGE_CKPT_SIM_SEEDS", str(DEFAULT_SEEDS)))
ENV = {**os.environ, "PYTHONHASHSEED": "0"}  # what the simulation needs (else it starts again)
FIX8_SEED = 5433  # the first violation with fix8 reverted (docs/protocol.md, revert table)
STALE_MEMORY_DELETE_SEED = 4454  # the same, for stale-memory-delete


@pytest.fixture(autouse=True)
def quiet():
    logging.getLogger("forge_ckpt").setLevel(logging.CRITICAL)
    yield
    logging.getLogger("forge_ckpt").setLevel(logging.NOTSET)


@pytest.mark.timeout(1200)
def test_every_schedule_keeps_every_invariant():
    """The default budget (10,000 schedules, on every core), in processes of its own: the same
    hash seed as a replay (set order must not differ), and a schedule that hangs ends its
    process with its stacks, not this one. Its time is printed, never asserted."""
    cmd = [sys.executable, "-m", "forge_ckpt.sim", "--seeds", str(SEEDS), "--hang-s", "120"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1100, env=ENV)
    print(done.stdout[-3000:], "load average: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"{SEEDS} schedules in" in done.stdout and "0 violated" in done.stdout


@pytest.mark.timeout(120)
def test_a_seed_replays_exactly():
    """Same seed, same schedule, event for event (what makes a failure reproducible)."""
    for seed in (3, 4, 21):  # one on S3, one on POSIX; 4 and 21 run the memory tier
        a, b = run_seed(seed), run_seed(seed)
        assert a.trace == b.trace
        assert len(a.trace) > 50


@pytest.mark.timeout(120)
def test_a_late_report_of_a_step_the_successor_retired_is_true():
    """Schedules where a job committed a step under its lease, stalled past it, and its
    successor loaded the step, then retired (646) or abandoned (6075) it before the save
    returned "committed": true, and not I3 (the oracle held such schedules to I3 once). In 18
    a job taken over then saved step 1, which its successor had committed, and is told it
    lost the lease (it was told "committed" without writing once: I3, fixed by checking the
    lease first)."""
    want = {646: "job0 save(4) committed", 6075: "job1 save(5) committed",
            18: "job0 save(1) failed: lost the lease"}  # fmt: skip
    for seed, line in want.items():
        result = run_seed(seed)
        assert result.violation is None, f"seed {seed}: {result.violation}"
        assert any(line in event for event in result.trace), f"seed {seed}: {line}"


@pytest.mark.timeout(120)
def test_a_load_by_a_job_taken_over_may_return_what_its_record_vouched_for():
    """Seed 6406: a stalled job's load read the lease's record before its successor took the
    folder over, and returned step 3, the newest then; the successor's step 4 came after
    that read. The oracle holds only a load by a job that kept the folder to "now" (I2)."""
    result = run_seed(6406)
    assert result.violation is None, result.violation
    assert any("job1 load(None) -> 3" in event for event in result.trace)


def first_violation_with(revert: str, first: int = 0, seeds: int = SEEDS) -> str:
    """The first violation within the default budget (or `seeds` from `first`) with one fix
    taken back out (in processes of their own, hash seed pinned: what a replay gives); the
    search stops there."""
    cmd = [sys.executable, "-m", "forge_ckpt.sim", "--first", str(first), "--seeds", str(seeds),
           "--revert", revert, "--stop-first", "--hang-s", "120"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1100, env=ENV)
    print(done.stdout[-2000:])
    assert done.returncode == 1, f"{revert} reverted, yet no violation:\n" + done.stdout[-2000:]
    return next(line for line in done.stdout.splitlines() if line.startswith("seed "))


@pytest.mark.timeout(1200)
def test_it_finds_a_commit_removed_by_its_own_abort():
    """Fix 1 taken back out: a save that fails or is cancelled (a caller's deadline, close())
    during its commit aborts, and the abort removes the step whatever it holds (I1)."""
    assert ": I1 " in first_violation_with("fix1")


@pytest.mark.timeout(1200)
def test_it_finds_the_rollback_that_retires_before_the_new_branch_commits():
    """Fix 2 taken back out: the first save after load(step=K) retires the newer steps at
    once. A save that then fails has lost them (I1)."""
    assert ": I1 " in first_violation_with("fix2")


@pytest.mark.timeout(1200)
def test_it_finds_a_lost_reply_taken_for_another_writer():
    """Fix 7 taken back out: a conditional write whose reply was lost, retried, meets its own
    write and reads as another writer's (I7)."""
    assert ": I7 " in first_violation_with("fix7")


@pytest.mark.timeout(1200)
def test_it_finds_a_late_commit_when_readers_ignore_the_lease_record():
    """Fix 8 taken back out: readers count every COMMIT, not only those the lease records. A
    stalled job's COMMIT that lands after its successor took over then counts: readers list
    the stale step (I3), the successor loses a step (I1), loads the stale one (I2) or is told
    its own step was taken (I7). The late-COMMIT family (world.py: one schedule in 20 holds
    a COMMIT of the first job until its successor has opened) makes such schedules; without
    it none was found in the default budget (seed 22949 was the first).

    The first such seed in the budget, 5433, is run alone: searching the 5,432 before it took
    two minutes of every suite run. `python -m forge_ckpt.sim --revert fix8 --stop-first`
    searches the whole budget; a change that shifts the schedules moves the seed, and this
    test then says so (re-run that search and pin the seed it prints)."""
    line = first_violation_with("fix8", first=FIX8_SEED, seeds=1)
    assert any(f": {i} " in line for i in ("I1", "I2", "I3", "I7")), line


@pytest.mark.timeout(1200)
def test_it_finds_a_memory_save_behind_a_newer_durable_step():
    """Fix 3 taken back out: a save to the memory tier checks only the memory steps. A job
    whose load failed saves step 1 on a folder whose newest durable step is higher; the step
    is persisted, and the folder's retention then removes it by its number (I1)."""
    line = first_violation_with("fix3")
    assert any(f": {i} " in line for i in ("I1", "I2")), line


@pytest.mark.timeout(1200)
def test_it_finds_memory_retention_dropping_a_step_waiting_to_be_persisted():
    """Fix 4 taken back out: memory retention keeps the newest `memory_keep` steps and drops
    a step whose persist has not ended (its persist then finds no copy left)."""
    assert ": I1 " in first_violation_with("fix4")


@pytest.mark.timeout(1200)
def test_it_finds_a_recovery_load_that_raises_a_persist_failure():
    """Fix 5 taken back out: a job that lost nodes while persisting recovers (restarts its
    actors, `load()`), and the load raises the persist's failure instead of loading the
    newest whole step of either tier (I2)."""
    assert ": I2 " in first_violation_with("fix5")


@pytest.mark.timeout(1200)
def test_it_finds_a_stale_memory_delete():
    """The memory tier's deletes taken back to trusting the caller's lease without renewing
    it: a stale job's save removes its successor's memory step in progress as a leftover, or
    its retention removes the successor's step of that number (I1; seed 16233 on the code
    of the time). Its durable counterpart, a stale preparation (`stale-prepare`), is found
    only past the budget: test_fence_review.py holds that one. The holders' fence by lease
    generation refuses those removals too, so the revert takes both out; its first seed,
    4454, is run alone (as fix8's: a change that shifts the schedules moves it)."""
    line = first_violation_with("stale-memory-delete", first=STALE_MEMORY_DELETE_SEED, seeds=1)
    assert ": I1 " in line, line


@pytest.mark.timeout(600)
def test_workers_report_what_one_process_reports():
    """Seeds run by two workers in blocks give the same violations, in seed order, each with
    its replay command, as one process running them in turn (each seed is hermetic)."""
    out = []
    for jobs in ("1", "2"):
        cmd = [sys.executable, "-m", "forge_ckpt.sim", "--seeds", "60", "--revert", "fix2",
               "--jobs", jobs]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=500, env=ENV)
        assert done.returncode == 1, done.stdout + done.stderr
        out.append([line for line in done.stdout.splitlines() if "schedules in" not in line])
    assert out[0] == out[1]
    seeds = [int(line.split()[1].rstrip(":")) for line in out[0] if line.startswith("seed ")]
    assert len(seeds) == 5 and seeds == sorted(seeds)
    for s in seeds:
        assert f"  replay: python -m forge_ckpt.sim --seed {s} --trace" in out[0]

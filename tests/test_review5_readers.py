"""Review 5, claim 4: the readers' re-read of the commit record (`layout._steady`) gives up
after four changed records and returns the fifth count unchecked: the review-4 break again
(sim seed 52182) for a reader whose listing is slow next to the writer's commits (an S3
listing of a big folder; a writer that commits every few seconds). Held storage: each of the
reader's listings waits until the writer, the real coordinator, has committed one more step
and its retention (keep_last=1) has removed the one before."""

from __future__ import annotations

import asyncio
import threading

import _held_storage as hs
import pytest
from _held_storage import Clock, Comp, Handle, held_rules, job  # noqa: F401

from forge_ckpt.steps import layout
from forge_ckpt.storage import StorageSpec

pytestmark = pytest.mark.usefixtures("held_rules")


async def test_a_reader_outpaced_five_times_still_finds_the_committed_step(tmp_path, monkeypatch):
    monkeypatch.setattr(hs.HeldFS, "list", hs._wrap("list"))  # the listing can be held too
    a = job(tmp_path, Clock(), "host-a", keep_last=1)
    a.register("c0", Handle(Comp(1)))
    assert (await a.save(1)).committed
    holds = [hs.Hold() for _ in range(5)]
    taken = [0]

    def each_listing(path: str) -> None:  # the reader's listings, one hold each
        if threading.current_thread().name != "reader" or taken[0] >= len(holds):
            return
        held = holds[taken[0]]
        taken[0] += 1
        held.entered.set()
        assert held.go.wait(hs.WAIT_S)

    hs.RULES.append(("list", str(tmp_path), each_listing))
    reader = hs.HeldFS(StorageSpec(f"held://{tmp_path}"))
    out: list = []
    t = threading.Thread(target=lambda: out.append(layout.marked_steps(reader)), name="reader")
    t.start()
    for n, held in enumerate(holds):
        await held.reached()  # the reader read a record, and lists now
        assert (await a.save(n + 2)).committed  # the record changes; step n+1 is retired
        held.go.set()
    await asyncio.to_thread(t.join, 30)
    print("committed:", a.steps(), "the reader counts:", out, "listings:", taken[0])
    a.close()
    assert out == [a.steps()] == [[6]], "a reader found no committed step while one was"


async def test_a_retried_save_of_a_committed_step_is_not_told_nothing_was_committed(tmp_path):
    """Claim 6 (change 2: the already-committed path checks the lease first): the caller
    retries save(1) after step 1 committed (say its first reply was lost). The lease's
    renewal in that check meets one transient storage error; the save then raises "save of
    step 1 aborted, nothing was committed (step 1 is still the newest committed step)": a
    committed step reported as not committed, in words that contradict themselves."""
    clock = Clock()
    a = job(tmp_path, clock, "host-a")
    a.register("c0", Handle(Comp(1)))
    assert (await a.save(1)).committed
    clock.t += a._lease.ttl_s / 2  # the check renews (its last renewal is over ttl/3 old)
    hs.fail("replace", ".forge_ckpt.lease")  # one transient error on that renewal
    try:
        again = await a.save(1)
        outcome = f"committed={again.committed}"
    except Exception as e:  # what the caller is told
        outcome = f"{type(e).__name__}: {e}"
    steps = a.steps()
    a.close()
    print("retry:", outcome, "| committed steps:", steps)
    assert steps == [1]
    assert "nothing was committed" not in outcome, outcome

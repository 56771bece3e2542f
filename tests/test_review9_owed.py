"""Review 9: `FollowUps.run_owed` (7bf2757) reads `owed[0]`, awaits a storage call, then pops
`owed[0]`. Two callers at once (two `wait()`s: `wait()` takes no lock and, with
`every=False`, does not wait for the other's look) both read the same entry: the second pops
an entry it never checked, or an empty list (held storage, no Ray; lost reply forced as in
test_review8_owed)."""

from __future__ import annotations

import asyncio
import errno
import threading
from typing import Any

import pytest
from _held_storage import Clock, Comp, Handle, held_rules, job  # noqa: F401
from _owed_faults import failing_looks, lose_replies

from forge_ckpt import CheckpointSaveError
from forge_ckpt.coordination import follow_ups

pytestmark = pytest.mark.usefixtures("held_rules")


async def test_two_waits_at_once_with_one_owed_entry(tmp_path, monkeypatch):
    """save(2) lands, its reply is lost: one owed entry. Two `wait()`s at once (a training
    task's and a shutdown's) both look at it; the second to resume pops an empty list:
    IndexError escapes `wait()`, where it must return (nothing failed)."""
    a = job(tmp_path, Clock(), "host-a")
    a.register("c0", Handle(Comp(1)))
    assert (await a.save(1)).committed
    lose_replies(monkeypatch, {2})
    with pytest.raises(CheckpointSaveError, match="outcome is unknown"):
        await a.save(2)
    assert len(a._follow_ups.owed) == 1
    outcomes = await asyncio.gather(a.wait(), a.wait(), return_exceptions=True)
    await a.aclose()
    print(f"two wait()s: {outcomes!r}")
    assert not [o for o in outcomes if isinstance(o, BaseException)], outcomes


async def owing_step_2(tmp_path: Any, monkeypatch: Any) -> Any:
    """A job whose step 1 committed and whose step 2 landed with its reply lost (owed); the
    commit of step 3 will lose its reply too."""
    a = job(tmp_path, Clock(), "host-a", keep_last=10)
    a.register("c0", Handle(Comp(1)))
    assert (await a.save(1)).committed
    lose_replies(monkeypatch, {2, 3})
    with pytest.raises(CheckpointSaveError, match="outcome is unknown"):
        await a.save(2)
    return a


async def test_two_waits_run_one_owed_follow_up_twice(tmp_path, monkeypatch):
    """Two owed entries (steps 2 and 3: the look fails once in between, so save(3) leaves
    step 2's entry). Two `wait()`s at once: both check entry 2, each pops one entry, both
    run step 2's follow-up; step 3's entry is popped unchecked and its follow-up never runs."""
    a = await owing_step_2(tmp_path, monkeypatch)
    real, left, looked = follow_ups.committed_as, [1], []

    def look(store: Any, manifest: Any) -> bool:
        looked.append(manifest.step)
        if left[0]:
            left[0] -= 1
            raise OSError(errno.EIO, "read failed (test)")
        return real(store, manifest)

    monkeypatch.setattr(follow_ups, "committed_as", look)
    with pytest.raises(CheckpointSaveError, match="outcome is unknown"):
        await a.save(3)
    assert [m.step for m, *_ in a._follow_ups.owed] == [2, 3]
    ran: list[int] = []
    work = a._follow_ups._work

    async def counted(manifest: Any, *args: Any) -> Any:
        ran.append(manifest.step)
        return await work(manifest, *args)

    a._follow_ups._work = counted
    looked.clear()
    outcomes = await asyncio.gather(a.wait(), a.wait(), return_exceptions=True)
    await a.aclose()
    print(f"looked at {looked}; follow-ups run {ran}; wait()s: {outcomes!r}")
    assert sorted(ran) == [2, 3], f"follow-ups run: {ran} (each owed one exactly once)"


async def test_a_recovery_load_beside_a_wait(tmp_path, monkeypatch):
    """Owed entries 2 and 3. A load looked at 2 (could not tell: dropped it, then looked at
    3); meanwhile a `wait()` looked at 2 too and, told it landed, popped entry 3 unchecked
    and ran step 2's follow-up; the load's look at 3 then popped an empty list: IndexError
    escaped the recovery load. Each caller now takes its entry before it looks: the wait()
    looks at 3 while the load looks at 2, each entry is looked at once, nothing escapes."""
    a = await owing_step_2(tmp_path, monkeypatch)
    real = follow_ups.committed_as
    failing_looks(monkeypatch, 1)
    with pytest.raises(CheckpointSaveError, match="outcome is unknown"):
        await a.save(3)
    assert [m.step for m, *_ in a._follow_ups.owed] == [2, 3]
    entered = [threading.Event() for _ in range(2)]
    go = [threading.Event() for _ in range(2)]
    seen: list[int] = []

    def scripted(store: Any, manifest: Any) -> bool:
        i = len(seen)
        seen.append(manifest.step)
        entered[i].set()
        assert go[i].wait(60)
        if i == 0:
            raise OSError(errno.EIO, "read failed (test)")
        return real(store, manifest)

    monkeypatch.setattr(follow_ups, "committed_as", scripted)
    loading = asyncio.ensure_future(a.load())
    assert await asyncio.to_thread(entered[0].wait, 60)  # the load's look at 2
    waiting = asyncio.ensure_future(a.wait())
    assert await asyncio.to_thread(entered[1].wait, 60)  # the wait()'s look, at 3
    go[0].set()
    go[1].set()
    outcomes = await asyncio.gather(loading, waiting, return_exceptions=True)
    await a.aclose()
    print(f"looks {seen}; load() -> {outcomes[0]!r}; wait() -> {outcomes[1]!r}")
    assert seen == [2, 3], f"owed entries looked at: {seen}"
    assert not isinstance(outcomes[0], BaseException), f"the load raised {outcomes[0]!r}"

"""Review 13: the fix of review 11's claim 8 (a load that could not look at an owed commit,
then loaded that very step, runs its follow-up), attacked. The simulation's harness: virtual
time, the real memory tier and holders.

Claim 1: the load was a rollback to that step; the follow-up cleared the branch the rollback
had set, so the new branch's first save was refused ("already committed") and the old
branch's newer step was never abandoned (I2).
Claims 2 and 3: the entries a load could not look at were kept aside only for a load that
returned; one that raised or was cancelled neither followed nor owed them again. Such an
entry undid a later rollback, or its landed step was never persisted (I1, I2).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from _owed_faults import failing_looks
from test_review10_memory import next_job_sees, owing_memory_step_2
from test_sim_memory import Job, world  # noqa: F401

from forge_ckpt import CheckpointSaveError
from forge_ckpt.sim.actors import Component


def an_apply_fails_once(monkeypatch: Any, action: Any = None) -> None:
    """The next actor apply fails (or, with `action`, runs it first and goes on)."""
    real, left = Component.load_state_dict, [1]

    def once(self: Any, state: Any) -> None:
        if left[0]:
            left[0] -= 1
            if action is None:
                raise RuntimeError("actor failed its load (test)")
            action()
        real(self, state)

    monkeypatch.setattr(Component, "load_state_dict", once)


def roll_back_to_2(a: Job) -> tuple[int | None, Any]:
    """load(step=2) with newer steps, then the new branch's first save: the branch point
    the load set, and what the save said."""
    got = a.run(a.coord.load(step=2))
    assert got is not None and got.step == 2
    branch_from = a.coord._timeline.branch_from
    try:
        saved: Any = a.run(a.coord.save(3)).committed
    except CheckpointSaveError as e:
        saved = f"raised {e}"
    return branch_from, saved


@pytest.mark.parametrize("look", ["works", "fails"])
def test_a_rollback_to_an_owed_step_stays_a_rollback(world, monkeypatch, look):  # noqa: F811
    a, _ = owing_memory_step_2(world, monkeypatch)
    failing_looks(monkeypatch, 10 if look == "fails" else 1)  # save(3)'s look fails: owed
    assert a.run(a.coord.save(3)).committed
    branch_from, saved = roll_back_to_2(a)
    a.run(a.coord.aclose())
    again, durable = next_job_sees(world)
    print(f"\nbranch point after load(step=2): {branch_from}; new branch's save(3): {saved}; "
          f"next job loads {again and again.step}; durable {durable}")  # fmt: skip
    assert branch_from == 2, "the rollback to 2 was undone by step 2's follow-up"
    assert saved is True
    assert again is not None and again.manifest.supersedes, "old step 3 never abandoned"


def test_an_entry_a_failed_load_could_not_look_at_is_owed_again(world, monkeypatch):  # noqa: F811
    a, _ = owing_memory_step_2(world, monkeypatch)
    failing_looks(monkeypatch, 1)  # the load's look at 2 fails once
    an_apply_fails_once(monkeypatch)
    with pytest.raises(Exception, match="actor failed its load"):
        a.run(a.coord.load())
    assert [m.step for m, *_ in a.coord._follow_ups.owed] == [2]
    for step in (3, 4):  # the job trains on; their looks at 2 run its follow-up
        assert a.run(a.coord.save(step)).committed
    a.run(a.coord.wait())
    branch_from, saved = roll_back_to_2(a)
    a.run(a.coord.aclose())
    _, durable = next_job_sees(world)
    print(f"\nbranch point: {branch_from}; new branch's save(3): {saved}; durable {durable}")
    assert branch_from == 2 and saved is True, "a stale entry undid the rollback"
    assert 2 in durable


@pytest.mark.parametrize("how", ["raised", "raised-then-retried", "cancelled"])
def test_a_failed_load_never_drops_a_landed_step(world, monkeypatch, how):  # noqa: F811
    a, _ = owing_memory_step_2(world, monkeypatch)
    failing_looks(monkeypatch, 1)  # the load's look at 2 fails once
    if how == "cancelled":
        load: list[asyncio.Task] = []
        an_apply_fails_once(monkeypatch, action=lambda: load[0].cancel())  # its deadline
        load.append(a.start(a.coord.load()))
        with pytest.raises(asyncio.CancelledError):
            world.loop.run_until_complete(load[0])
    else:
        an_apply_fails_once(monkeypatch)
        with pytest.raises(Exception, match="actor failed its load"):
            a.run(a.coord.load())
    if how == "raised-then-retried":  # the job retries the unknown save, and trains on
        assert a.run(a.coord.save(2)).committed  # already committed
        assert a.run(a.coord.save(3)).committed
        a.run(a.coord.wait())
    a.run(a.coord.aclose())  # the job ends: the holders go
    again, durable = next_job_sees(world)
    print(f"\n[{how}] durable after aclose(): {durable}; next job loads {again and again.step}")
    assert 2 in durable, "committed, due memory step 2 was never persisted and is gone"

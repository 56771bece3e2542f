"""Review 8: the "owed" follow-up of 6e21956 (a commit of unknown outcome that landed has what
it sets going run by the next save, load or wait()), on the durable folder (held storage, no
Ray). A lost reply is forced by `commit.commit_step` committing and then raising OSError."""

from __future__ import annotations

from typing import Any

import pytest
from _held_storage import Clock, Comp, Handle, held_rules, job  # noqa: F401
from _owed_faults import failing_looks, lose_replies

import forge_ckpt
from forge_ckpt import CheckpointSaveError

pytestmark = pytest.mark.usefixtures("held_rules")


async def owed_after(tmp_path: Any, monkeypatch: Any, steps: int, **kw: Any) -> Any:
    """A job that saved 1..steps-1, then `steps` whose commit landed but raised OSError."""
    a = job(tmp_path, Clock(), "host-a", **kw)
    comp = Comp(1)
    a.register("c0", Handle(comp))
    for s in range(1, steps):
        comp.version = s
        assert (await a.save(s)).committed
    comp.version = steps
    lose_replies(monkeypatch, {steps})
    with pytest.raises(CheckpointSaveError, match="outcome is unknown"):
        await a.save(steps)
    assert len(a._follow_ups.owed) == 1  # (no `_owed` before 6e21956)
    return a, comp


async def test_an_owed_follow_up_run_after_a_rollback_undoes_it(tmp_path, monkeypatch):
    """save(4) lands but its reply is lost (owed). load(step=2) cannot tell yet whether it
    landed (one storage error per look: the load looks twice), so the entry stays; the load
    rolls back to 2. The next save(3) runs step 4's follow-up first, which calls
    `branch_committed()` (the rollback is forgotten, no branch has committed) and tells the
    timeline step 4 is newest: save(3) is then told "already committed" (the OLD branch's
    step 3) and returns committed=True without saving the new state; load() then resumes
    the abandoned step 4."""
    a, comp = await owed_after(tmp_path, monkeypatch, 4, keep_last=10)
    failing_looks(monkeypatch, 2)
    loaded = await a.load(step=2)
    assert loaded is not None and loaded.step == 2 and comp.version == 2
    comp.version = 30  # the new branch's state at step 3
    saved = await a.save(3)
    comp.version = -1
    again = await a.load()
    await a.aclose()
    on_disk = forge_ckpt.committed_steps(str(tmp_path))
    print(f"save(3) committed={saved.committed}; load() -> step {again and again.step}, "
          f"version {comp.version}; committed steps {on_disk}")  # fmt: skip
    assert again is not None and again.step == 3, f"load() resumed step {again and again.step}"
    assert comp.version == 30, f"the new branch's step 3 was never saved: {comp.version}"


async def test_owed_entry_from_a_rollback_branchs_first_save(tmp_path, monkeypatch):
    """Without faults on the look: an owed first save of a new branch (step 3 after
    load(step=2), lost reply) has its follow-up run by the next save: the abandoned step 4
    must be retired and load() must return the new branch's newest step."""
    a, comp = await owed_after(tmp_path, monkeypatch, 5, keep_last=10)  # owed: 5 (landed)
    await a.wait()  # runs step 5's follow-up
    assert not a._follow_ups.owed
    assert (await a.load(step=2)).step == 2
    comp.version = 30
    lose_replies(monkeypatch, {3})
    with pytest.raises(CheckpointSaveError, match="outcome is unknown"):
        await a.save(3)
    comp.version = 40
    assert (await a.save(4)).committed
    comp.version = -1
    again = await a.load()
    await a.aclose()
    on_disk = forge_ckpt.committed_steps(str(tmp_path))
    print(f"load() -> {again and again.step} version {comp.version}; committed {on_disk}")
    assert again is not None and again.step == 4 and comp.version == 40
    assert 5 not in on_disk, f"the abandoned step 5 is still there: {on_disk}"

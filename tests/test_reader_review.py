"""A reader of a folder another job writes (review 4; sim seed 52182): it read the lease's
commit record, then listed the folder. If the live writer commits step 2 and its retention removes step 1
between the two, the reader counts nothing: step 1 is gone and step 2 is not in the record
it read. A load by a job that lost its lease (sim), or any reader of the folder, is told
"no committed step" while step 2 is committed (I2). Now the record is read again after the listing, and
the count repeated if it changed. Held storage: the reader's listing waits on an event, the
writer is the real coordinator."""

from __future__ import annotations

import asyncio
import threading

import _held_storage as hs
import pytest
from _held_storage import Clock, Comp, Handle, held_rules, hold, job  # noqa: F401

from forge_ckpt.steps import layout
from forge_ckpt.storage import StorageSpec

pytestmark = pytest.mark.usefixtures("held_rules")


async def test_a_reader_listing_across_a_commit_and_retention_still_finds_the_step(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(hs.HeldFS, "list", hs._wrap("list"))  # the listing can be held too
    a = job(tmp_path, Clock(), "host-a", keep_last=1)
    a.register("c0", Handle(Comp(1)))
    assert (await a.save(1)).committed
    held = hold("list", str(tmp_path), only=lambda: threading.current_thread().name == "reader")
    reader = hs.HeldFS(StorageSpec(f"held://{tmp_path}"))
    out: list = []
    t = threading.Thread(target=lambda: out.append(layout.marked_steps(reader)), name="reader")
    t.start()
    await held.reached()  # the reader read the record {1} and now lists
    assert (await a.save(2)).committed  # record {2}; retention removes step 1
    held.go.set()
    await asyncio.to_thread(t.join, 30)
    print("committed:", a.steps(), "the reader counts:", out)
    a.close()
    assert out == [[2]], "a reader found no committed step while step 2 was committed"

"""The life of a run's holders: which run they belong to (the folder, its incarnation and the
run's fingerprint), starting or finding them, retiring those of another run, and releasing
them when the run is closed (or, after a driver died without closing, on request).

A run's identity is its durable folder's URL (the holders' names) plus the folder's
incarnation: a random id written once into the folder (`.forge_ckpt.run`) by the first
memory-tier run that opens it. A folder that was deleted gets a new id, so holders of the
run that wrote the old folder are retired instead of offering their steps to the new run.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

import ray

from ..errors import CheckpointError
from ..storage import AlreadyExistsError, Storage
from .calls import forget
from .cluster import current
from .holder import NO_CLAIM, Claim, StaleWriteError, claim_of
from .placement import HolderRef, holder_name

log = logging.getLogger("forge_ckpt")
RUN_FILE = ".forge_ckpt.run"
NAME_GONE_S = 30.0  # Ray releases a killed actor's name asynchronously
# A holder's first answer includes its process start: on a busy node that takes far longer
# than a call (a 60 s bound failed the tier's opening under a CPU-bound load).
START_TIMEOUT_S = 300.0
# A node that joins later is looked for by saves: its holder gets this long per look, and
# one that has not answered is left for a later look (a save never waits START_TIMEOUT_S).
JOIN_WAIT_S = 5.0
CALL_S = 60.0  # a holder already there (of this run or another) answers within this


class NotReady(Exception):
    """A holder there that does not answer (its node hung, not yet declared dead): the tier
    goes on without it, and a later save's look for new nodes tries it again."""


def run_id_of(folder: str) -> str:
    """The same durable folder gives the same run id, so a restarted driver finds its holders."""
    return hashlib.sha256(folder.encode()).hexdigest()[:16]


def incarnation(durable: Storage) -> str:
    """The folder's incarnation id: read, or created at the first open (create-if-absent, so
    two openers agree; the caller holds the folder's lease anyway)."""
    data = json.dumps({"run": uuid.uuid4().hex, "created": time.time()}).encode()
    try:
        durable.create(RUN_FILE, data)
    except AlreadyExistsError:
        data = bytes(durable.read(RUN_FILE))
    try:
        return str(json.loads(data)["run"])
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(
            f"{durable.where(RUN_FILE)} is unreadable ({e}); it names this folder's run for "
            "the memory tier: delete it (the memory steps of the run before are then retired)"
        ) from None


def alive_nodes() -> list[str]:
    return current().nodes()


class Identity:
    """Who a run's holders are: names from `run_id`, owned by (fingerprint, incarnation)."""

    def __init__(
        self,
        run_id: str,
        fingerprint: str,
        inc: str,
        namespace: str,
        confirm: Callable[[], None] | None = None,
    ) -> None:
        """`confirm`: the folder lease's check (raises if lost), before an opening or a later
        look takes or retires a holder."""
        self.run_id, self.fingerprint, self.incarnation = run_id, fingerprint, inc
        self.namespace = namespace
        self.confirm = confirm
        # This opening of the folder: (order, nonce), the order newer than any claim the
        # holders served when it began (set by the first start()); every change the holders
        # make carries it (`Holder._admit`).
        self.claim: Claim = NO_CLAIM

    def start(
        self, nodes: list[str], budget: int, keep: int, joined: bool = False
    ) -> list[HolderRef]:
        """Find or start this run's holder on each node; each answers (with our budget)
        before the first save. `joined`: nodes that joined since the tier opened, looked
        for by a save: each gets JOIN_WAIT_S, and those that have not answered are left
        out (a later look tries them again) instead of failing the rest (review 10, D)."""
        if not current().ready():
            raise CheckpointError("the memory tier needs Ray: call ray.init() first")
        wait_s = JOIN_WAIT_S if joined else START_TIMEOUT_S
        found = self._look(nodes, (budget, keep), wait_s)
        if not joined:
            order = max([c[0] for _, _, c in found], default=0) + 1
            self.claim = (order, uuid.uuid4().int >> 66)
        ready = []
        for name, node, seen in found:
            self._confirm_take(seen)  # (an opening can stall past the lease: review 29)
            try:
                self._configure(name, node, (budget, keep), wait_s, (seen, joined))
            except ray.exceptions.GetTimeoutError:
                if not joined:
                    raise self._no_start(node) from None
                log.warning("memory tier: the holder on new node %s has not answered within "
                            "%.0fs; a later save looks again", node[:8], wait_s)  # fmt: skip
                continue
            except StaleWriteError as e:  # claimed since we looked
                if not joined:
                    raise
                log.warning("memory tier: the holder on new node %s is left out: %s",
                            node[:8], e)  # fmt: skip
                continue
            ready.append((name, node))
        return ready

    def _look(
        self, nodes: list[str], room: tuple[int, int], wait_s: float
    ) -> list[tuple[str, str, Claim]]:
        """Each node's holder (started if none; `room`: budget and keep) and the claim it
        serves; a hung one is left out, as if its node were lost (review 10, D2)."""
        found = []
        for node in nodes:
            name = holder_name(self.run_id, node)
            try:  # (a holder already there answers within a call's bound, or is hung)
                seen = self._retire_foreign(name, min(wait_s, CALL_S))
                if seen is None and self._exists(name):  # started meanwhile, by another
                    seen = self._retire_foreign(name, min(wait_s, CALL_S))  # (review 30)
            except NotReady:
                log.warning("memory tier: the holder on node %s does not answer; going on "
                            "without it (a later save looks again)", node[:8])  # fmt: skip
                continue
            if seen is None and not self._exists(name):  # (a kept one exists)
                self._create(name, node, *room)
            found.append((name, node, NO_CLAIM if seen is None else seen))
        return found

    def _exists(self, name: str) -> bool:
        try:
            current().actor(name, self.namespace)
        except ValueError:
            return False
        return True

    def _confirm_take(self, seen: Claim) -> None:
        """A holder is claimed over `seen` (unless ours already) only once the folder's
        lease is checked: CheckpointLockedError if this job lost it, so a stale job's
        look, or an opening that stalled past its lease, takes nothing. The claims' orders
        say nothing about the lease (reviews 28, 29)."""
        if seen != self.claim and self.confirm is not None:
            try:
                self.confirm()
            except OSError as e:  # (a lease lost raises CheckpointLockedError, as it is)
                raise CheckpointError(
                    f"memory tier: the folder's lease could not be checked before claiming "
                    f"the run's holders ({e}); nothing was claimed. Open the folder again "
                    "once its storage answers"
                ) from e

    def _configure(
        self, name: str, node: str, room: tuple[int, int], wait_s: float, look: tuple[Claim, bool]
    ) -> None:
        """Our budget, keep and claim on the holder (`room`: budget and keep), over the claim
        it served when we looked (`look`: that claim, and whether a later look found it:
        then its files of another claim go); one that died since we looked is started anew,
        and configured too. StaleWriteError if another opening claimed it since."""
        cluster, (seen, joined) = current(), look
        for fresh in (False, True):
            try:
                h = cluster.actor(name, self.namespace)
                try:
                    cluster.get(h.configure.remote(*room, self.claim, seen, joined),
                                timeout=wait_s)  # fmt: skip
                except TypeError:  # a holder of an earlier release: not fenced
                    cluster.get(h.configure.remote(*room), timeout=wait_s)
                return
            except (ValueError, ray.exceptions.RayActorError):
                if fresh:
                    raise
                # It died since we looked (a closing run's holder going away): start anew.
                self._wait_gone(name)
                forget(self.namespace, name)
                self._create(name, node, *room)
                seen = NO_CLAIM

    @staticmethod
    def _no_start(node: str) -> CheckpointError:
        return CheckpointError(
            f"the memory holder on node {node[:8]} did not answer within "
            f"{START_TIMEOUT_S:.0f}s (memory.holders.START_TIMEOUT_S): is that node "
            "overloaded or out of CPU/memory for a new actor? Retry, or run without the "
            "memory tier (memory_every=0)"
        )

    def _retire_foreign(self, name: str, wait_s: float = CALL_S) -> Claim | None:
        """Kill a holder of this folder left by another run: another fingerprint, or the run
        of an earlier incarnation of the folder (deleted and made again since). NotReady if
        the holder there does not answer within `wait_s`. The claim a kept holder serves;
        None if no holder is kept."""
        cluster = current()
        try:
            old = cluster.actor(name, self.namespace)
            info = cluster.get(old.info.remote(), timeout=wait_s)
        except (ValueError, ray.exceptions.RayActorError):
            return None
        except ray.exceptions.GetTimeoutError:
            raise NotReady(name) from None
        theirs = (info["fingerprint"], info.get("incarnation", ""))
        if theirs == (self.fingerprint, self.incarnation):
            return claim_of(info.get("claim"))
        if self.confirm is not None:  # a stale job's look kills nothing (review 28: the
            self.confirm()  # successor's holder, of a folder made again)
        log.warning("retiring memory holder %s of another run (fingerprint %r, folder "
                    "incarnation %r; ours %r, %r)", name, *theirs, self.fingerprint,
                    self.incarnation)  # fmt: skip
        cluster.kill(old)
        forget(self.namespace, name)
        self._wait_gone(name)
        return None

    def _wait_gone(self, name: str) -> None:
        cluster = current()
        deadline = cluster.monotonic() + NAME_GONE_S
        while cluster.monotonic() < deadline:
            try:
                cluster.actor(name, self.namespace)
            except ValueError:
                return
            cluster.sleep(0.05)
        raise CheckpointError(f"memory holder {name} did not go away after ray.kill")

    def _create(self, name: str, node: str, budget: int, keep: int) -> None:
        current().start_holder(name, self.namespace, node, self.run_id, self.fingerprint,
                               budget, keep, self.incarnation)  # fmt: skip

    def release(self, holders: list[HolderRef]) -> None:
        """Kill the holders (their memory is freed) and wait until their names are free, so
        that the next run of this folder starts its own instead of finding dying ones."""
        _kill_all(self.namespace, [name for name, _ in holders])


def _kill_all(namespace: str, names: list[str]) -> list[str]:
    cluster = current()
    killed = []
    for name in names:
        try:
            cluster.kill(cluster.actor(name, namespace))
        except ValueError:
            continue
        forget(namespace, name)
        killed.append(name)
    deadline = cluster.monotonic() + NAME_GONE_S
    for name in killed:
        while cluster.monotonic() < deadline:
            try:
                cluster.actor(name, namespace)
            except ValueError:
                break
            cluster.sleep(0.05)
    return killed


def release_holders(folder: str, namespace: str = "forge_ckpt") -> list[str]:
    """Kill every memory holder of `folder` (on any node) and return their names: frees the
    memory of a run whose driver died without `close()`. Only when no driver of that run is
    alive: its memory steps are gone. (Opening a coordinator on the folder and closing it
    does the same under the folder's lease.)"""
    from ..storage import normalize_url

    prefix = holder_name(run_id_of(normalize_url(folder)), "")
    named: list[Any] = ray.util.list_named_actors(all_namespaces=True)
    mine = [a["name"] for a in named if a["namespace"] == namespace]
    return _kill_all(namespace, [n for n in mine if n.startswith(prefix)])

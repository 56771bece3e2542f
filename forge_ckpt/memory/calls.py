"""Calls to the run's holders, as `MemoryStorage` makes them: one holder's (its actor handle
by name, looked up again when it died), every live holder's at once (`on_all`), and the
direct stream's endpoint. A driver upgraded within a live run adopts holders of an earlier
release, which take neither the writer's token nor a persist's records: each such holder
alone is asked without them (`on_all`'s `newer`), the others are asked with them.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import ray

from . import transport
from .cluster import current
from .holder import Token
from .placement import HolderRef
from .transport import Endpoint, TransportError

log = logging.getLogger("forge_ckpt")
_DEAD = (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError, ValueError)
_handles: dict[tuple[str, str], Any] = {}
_endpoints: dict[tuple[str, str], Endpoint | None] = {}  # None: the holder has no listener
_warned: set[str] = set()  # holders whose stream failed (warned once)
_LEFT_OUT = object()  # a holder left out of a call (`on_all`)
_lock = threading.Lock()
DEAD, FALLBACK = "dead", "fallback"  # outcomes of a direct exchange other than its result


def forget(namespace: str, name: str) -> None:
    """Drop a cached handle (its holder was retired: a new one takes the name)."""
    with _lock:
        _handles.pop((namespace, name), None)
        ep = _endpoints.pop((namespace, name), None)
    if ep is not None:
        transport.forget(ep)


class HolderCalls:
    """The holder calls of a `MemoryStorage` (its `holders`, `namespace` and `token`)."""

    holders: list[HolderRef]
    namespace: str
    token: Token | None

    def handle(self, name: str, refresh: bool = False) -> Any:
        """The holder's actor handle by name (looked up again after a failure: a restarted
        driver may have replaced it)."""
        k = (self.namespace, name)
        with _lock:
            if refresh or k not in _handles:
                _handles[k] = current().actor(name, self.namespace)
            return _handles[k]

    def endpoint(self, name: str, refresh: bool = False) -> Endpoint | None:
        """Where the holder streams (asked through Ray once, then cached); None if it has
        no listener. Raises a `_DEAD` error if the holder is gone."""
        k = (self.namespace, name)
        with _lock:
            if not refresh and k in _endpoints:
                return _endpoints[k]
        found = self.call((name, ""), "endpoint", timeout=60.0)
        ep = None if found is None else Endpoint.from_dict(found)
        with _lock:
            old = _endpoints.get(k)
            _endpoints[k] = ep
        if old is not None and old != ep:
            transport.forget(old)
        return ep

    def direct(self, ref: HolderRef, fn: Callable[[Endpoint], Any]) -> tuple[str, Any]:
        """`fn(endpoint)` over the holder's stream: ("ok", result); (DEAD, why) when Ray says
        the holder is gone; (FALLBACK, why) when it lives but cannot be streamed to (the
        caller then goes through Ray). A failed stream is tried once more, on a fresh
        connection to the endpoint Ray gives now (a holder restarted elsewhere)."""
        why = "no listener"
        for retry in (False, True):
            try:
                ep = self.endpoint(ref[0], refresh=retry)
            except _DEAD as e:
                return DEAD, type(e).__name__
            if ep is None:
                continue  # asked again: a listener may have started since
            try:
                result = fn(ep)
            except TransportError as e:
                why = str(e)
                transport.forget(ep)
                continue
            _warned.discard(ref[0])
            return "ok", result
        if ref[0] not in _warned:  # once per holder until its stream works again
            _warned.add(ref[0])
            log.warning("memory holder on node %s: direct stream failed (%s); using Ray's "
                        "object store", ref[1][:8], why)  # fmt: skip
        return FALLBACK, why

    def call(
        self, ref: HolderRef, method: str, *args: Any, timeout: float = 60.0, fresh: bool = False
    ) -> Any:
        """One holder call; raises a `_DEAD` error if the holder is gone. `fresh`: its cached
        handle is known dead (the name may have a new holder)."""
        for attempt in (1,) if fresh else (0, 1):
            try:
                h = self.handle(ref[0], refresh=attempt == 1)
                return current().get(getattr(h, method).remote(*args), timeout=timeout)
            except ray.exceptions.RayActorError:
                if attempt == 1:
                    raise
        raise AssertionError("unreachable")

    def on_all(
        self,
        method: str,
        *args: Any,
        token: Token | None = None,
        newer: tuple = (),
        asked_without: set[str] | None = None,
    ) -> list[tuple[HolderRef, Any]]:
        """The call on every live holder at once; dead ones are left out. `token`: the
        writer's, the call's last argument; `newer`: arguments after `args` that a holder of
        an earlier release does not take either (a driver upgraded within a live run adopts
        such holders): that holder alone is asked without them (its name goes into
        `asked_without`), or left out of a call it lacks (`fence`)."""
        extra = (*newer, *(() if token is None else (token,)))
        futures = []
        for ref in self.holders:
            try:
                futures.append((ref, *self._submit(ref, method, args, extra)))
            except ValueError:  # no such actor (its node died before we looked it up)
                continue
            except AttributeError:  # an earlier release's holder lacks the call
                if not extra:
                    raise
        out, without = [], set() if asked_without is None else asked_without
        for ref, fut, given in futures:
            try:
                answer, asked = current().get(fut, timeout=60.0), given
            except _DEAD:  # once more, with every argument: a holder that took its name
                try:  # may be of this release
                    answer, asked = self._again(ref, method, args, extra)
                except _DEAD:
                    continue
            except (TypeError, AttributeError):
                if not given:
                    raise
                try:
                    answer, asked = self._without(ref, method, args), ()
                except _DEAD:
                    continue
            if answer is not _LEFT_OUT:
                out.append((ref, answer))
            if extra and not asked:
                without.add(ref[0])
        return out

    def _submit(self, ref: HolderRef, method: str, args: tuple, extra: tuple) -> tuple[Any, tuple]:
        """One holder's call started: (its future, the optional arguments it was given)."""
        fn = getattr(self.handle(ref[0]), method)
        if not extra:
            return fn.remote(*args), ()
        try:
            return fn.remote(*args, *extra), extra
        except TypeError:  # Ray checks a call's arguments as it is submitted
            _earlier_release()
            return fn.remote(*args), ()

    def _again(self, ref: HolderRef, method: str, args: tuple, extra: tuple) -> tuple[Any, tuple]:
        """A dead holder's call on the holder of its name now: (its answer, what it took). A
        refusal of `extra` may come from the dead holder's cached handle (Ray checks the
        arguments as a call is submitted): the holder of its name now is asked too."""
        for fresh in (False, True):
            try:
                return self.call(ref, method, *args, *extra, fresh=fresh), extra
            except (TypeError, AttributeError):
                if not extra:
                    raise
        return self._without(ref, method, args), ()

    def _without(self, ref: HolderRef, method: str, args: tuple) -> Any:
        """The call on a holder of an earlier release, without this release's arguments
        (`_LEFT_OUT` for `fence`: it has none to set)."""
        _earlier_release()
        return _LEFT_OUT if method == "fence" else self.call(ref, method, *args)

    def holding(
        self, keys: list[str], records: list[tuple[int, int]]
    ) -> list[tuple[HolderRef, list[bool]]]:
        """Which live holders keep a copy of each key that matches its (size, CRC32C) record.
        A holder of an earlier release can only say it keeps one: it comes last (its copy
        is checked by whoever uses it)."""
        without: set[str] = set()
        has = self.on_all("has", keys, newer=(records,), asked_without=without)
        return sorted(has, key=lambda answer: answer[0][0] in without)

    def fenced(self, method: str, *args: Any) -> list[tuple[HolderRef, Any]]:
        """`on_all` of a change, with this writer's token (`Holder._admit`)."""
        return self.on_all(method, *args, token=self.token)

    def fence_step(self, step: int) -> None:
        """This save attempt prepares `step` on every live holder: an older attempt's files
        of it go, and its late writes are refused (`Holder.fence`)."""
        if self.token is not None and self.token[2]:
            self.on_all("fence", step, token=self.token)


def _earlier_release() -> None:
    """A holder of an earlier release took a call without this release's arguments (the
    writer's token, a persist's records): said once."""
    if "fence" not in _warned:
        _warned.add("fence")
        log.warning("memory holders of an earlier release: their changes are not fenced by "
                    "the opening of the folder, nor their copies checked before a persist "
                    "(restart the run's holders)")  # fmt: skip

"""Resharding rules: how the N states an actor's replicas saved become the states of M replicas.

A rule is any function `rule(states, replicas) -> list` that takes the N saved user states
(what each replica's `state_dict()` returned, in replica order) and returns exactly `replicas`
states, one per new replica. Declare it with `coord.register(name, actors, reshard=rule)`, or
as a static method `reshard_states(states, replicas)` on the actor class. forge_ckpt never
guesses: without a rule, a changed replica count is a `CheckpointMismatchError`.

The ready-made rules below cover the common cases. Each is explicit about what must agree
across replicas: a value that is neither split nor merged must be equal in every saved state,
or the rule raises `ValueError` naming it (the coordinator turns that into an error naming the
component, and no actor is changed).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

ReshardRule = Callable[[list[Any], int], list[Any]]


def concat_split(states: list[Any], replicas: int) -> list[Any]:
    """A replay buffer: concatenate the replicas' items in replica order, then cut them into
    `replicas` contiguous parts whose sizes differ by at most one (the first parts larger).

    A state is a list, tuple, tensor or numpy array (along dim 0), or a dict of those (nested
    dicts too); each such entry is concatenated and split on its own, with the same cut points
    whenever the entries have equal lengths (rows stay aligned). Other values (a capacity, a
    name) must be equal in every saved state. The concatenation of the new states equals the
    concatenation of the saved ones exactly."""
    _check_count(replicas)
    return [_concat_split(states, replicas, j, "state") for j in range(replicas)]


def _concat_split(values: list[Any], replicas: int, j: int, where: str) -> Any:
    first = values[0]
    if isinstance(first, dict):
        _check_keys(values, where)
        return {
            k: _concat_split([v[k] for v in values], replicas, j, f"{where}[{k!r}]") for k in first
        }
    if isinstance(first, (list, tuple)):
        items = [x for v in values for x in v]
        lo, hi = _bounds(len(items), replicas, j)
        return type(first)(items[lo:hi])
    if isinstance(first, torch.Tensor):
        rows = torch.cat(list(values))
        lo, hi = _bounds(rows.shape[0], replicas, j)
        return rows[lo:hi].clone()
    if isinstance(first, np.ndarray):
        arr = np.concatenate(values)
        lo, hi = _bounds(arr.shape[0], replicas, j)
        return arr[lo:hi].copy()
    return _same(values, where)


def merge_running_stats(
    states: list[dict[str, Any]],
    replicas: int,
    *,
    count: str = "count",
    mean: str = "mean",
    m2: str = "M2",
) -> list[dict[str, Any]]:
    """Reward normalisation: merge per-replica running statistics (count, mean, M2 = sum of
    squared deviations; Chan et al.'s parallel update) into the statistics of every sample
    seen, then give each new replica that mean and variance with the count split among them
    (M2 in proportion), so that merging the new states again gives the same totals. `mean`
    and `M2` may be floats, numpy arrays or tensors; other keys must be equal everywhere.
    Other key names: `functools.partial(merge_running_stats, count="n", ...)`."""
    _check_count(replicas)
    _check_keys(states, "state")
    n, mu, sq = 0, 0.0 * states[0][mean], 0.0 * states[0][m2]
    for s in states:
        nb = s[count]
        if nb == 0:
            continue
        delta = s[mean] - mu
        total = n + nb
        mu = mu + delta * (nb / total)
        sq = sq + s[m2] + delta * delta * (n * nb / total)
        n = total
    rest = _others(states, (count, mean, m2))
    out = []
    for j in range(replicas):
        if isinstance(n, (int, np.integer)):
            lo, hi = _bounds(int(n), replicas, j)
            nj: Any = hi - lo
        else:
            nj = n / replicas
        out.append({**rest, count: nj, mean: mu, m2: sq * (nj / n) if n else sq})
    return out


def repartition_indices(
    states: list[dict[str, Any]],
    replicas: int,
    *,
    order: Sequence[int] | None = None,
    consumed: str = "consumed",
    remaining: str = "remaining",
) -> list[dict[str, Any]]:
    """A dataloader that records what it consumed: merge the replicas' `consumed` indices and
    deal the `remaining` ones out again, so that every index is served exactly once.

    Remaining indices keep the global order: `order` (the epoch's full order) when given, else
    the saved `remaining` lists interleaved round-robin, which restores the order of a strided
    split (`order[k::N]`) consumed in lockstep. New replica j gets `remaining[j::M]` and a share
    of the consumed set (only their union matters). An index consumed twice, both consumed and
    remaining, or (with `order`) missing or foreign raises; other keys must be equal."""
    _check_count(replicas)
    _check_keys(states, "state")
    done = [i for s in states for i in s[consumed]]
    left = _interleave([list(s[remaining]) for s in states])
    if len(set(done) | set(left)) != len(done) + len(left):
        raise ValueError("the saved replicas list an index twice (consumed or remaining)")
    if order is not None:
        if set(order) != set(done) | set(left) or len(set(order)) != len(order):
            raise ValueError("the saved consumed and remaining indices do not make up `order`")
        done_set = set(done)
        left = [i for i in order if i not in done_set]
    done.sort()
    rest = _others(states, (consumed, remaining))
    return [
        {**rest, consumed: done[j::replicas], remaining: left[j::replicas]} for j in range(replicas)
    ]


def _interleave(lists: list[list[int]]) -> list[int]:
    out: list[int] = []
    for p in range(max((len(x) for x in lists), default=0)):
        out += [x[p] for x in lists if p < len(x)]
    return out


def _bounds(n: int, parts: int, j: int) -> tuple[int, int]:
    """Part j of n items cut into `parts` contiguous parts, the first n % parts one larger."""
    size, extra = divmod(n, parts)
    lo = j * size + min(j, extra)
    return lo, lo + size + (1 if j < extra else 0)


def _check_count(replicas: int) -> None:
    if replicas < 1:
        raise ValueError(f"cannot reshard into {replicas} replicas")


def _check_keys(states: list[dict[str, Any]], where: str) -> None:
    keys = set(states[0])
    for i, s in enumerate(states):
        if set(s) != keys:
            raise ValueError(f"{where}: replica {i} has keys {sorted(s)}, replica 0 {sorted(keys)}")


def _others(states: list[dict[str, Any]], handled: tuple[str, ...]) -> dict[str, Any]:
    """The keys a rule does not merge: kept when every replica agrees."""
    return {
        k: _same([s[k] for s in states], f"state[{k!r}]") for k in states[0] if k not in handled
    }


def _same(values: list[Any], where: str) -> Any:
    """The value every saved state agrees on; differing values cannot be resharded blindly."""
    for i, v in enumerate(values[1:], 1):
        if not _equal(v, values[0]):
            raise ValueError(
                f"{where} differs between replicas (replica 0: {values[0]!r}, replica {i}: "
                f"{v!r}); this rule keeps such values only when all replicas agree"
            )
    return values[0]


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return bool(np.array_equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)

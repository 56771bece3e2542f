"""Where the job's actors run (`ray.placement`).

`spread` deals the actors out round-robin over the cluster's live nodes that have a CPU, in
the order the job creates them: k consecutive actors (the replicas of one role) land on
min(k, nodes) different nodes. Each is pinned with a *soft* node affinity that may spill: an
actor whose node is gone, or has no room for it, when Ray places it goes to another node
instead of waiting for that one. A cluster with no CPU anywhere gets Ray's own placement.

Ray ignores both its `SPREAD` strategy and a soft node affinity for an actor that asks for no
resources at all, as this job's actors otherwise do (0 CPUs: each runs one torch thread), and
places it on a random node: on a 3-node cluster, 3 replicas all sat on one node about one time
in nine (measured: 9 such actors under SPREAD went 6/2/1, 5/3/1, ... over 3 nodes). So a
spread actor asks for a sliver of a CPU (`SLIVER`).
"""

from __future__ import annotations

from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

SLIVER = 0.001  # CPUs a spread actor asks for: any request at all makes Ray honour the pin


class Placement:
    """Actor options for `ray.placement`, one call per actor created: `null` leaves placement
    to Ray (a random live node for each), `spread` deals them out over the live nodes."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        how = (cfg.get("ray") or {}).get("placement")
        if how not in (None, "", "default", "spread"):
            raise ValueError(f"ray.placement must be null or 'spread', got {how!r}")
        self.nodes = spread_nodes(ray.nodes()) if how == "spread" else []
        self.dealt = 0

    def __call__(self) -> dict[str, Any]:
        """The next actor's options (merge into `.options(...)`)."""
        if not self.nodes:
            return {}
        node = self.nodes[self.dealt % len(self.nodes)]
        self.dealt += 1
        # `_spill_on_unavailable`: without it a soft pin waits for a live node that has no
        # CPU free, indefinitely (Ray's docstring; found by review 39).
        pin = NodeAffinitySchedulingStrategy(node, soft=True, _spill_on_unavailable=True)
        return {"num_cpus": SLIVER, "scheduling_strategy": pin}

    def actor_options(self) -> dict[str, Any]:
        """The next actor's options for this job's actors: 0 CPUs in Ray's accounting (one
        torch thread each), or the sliver of a spread actor."""
        return {"num_cpus": 0, **self()}


def spread_nodes(nodes: list[dict[str, Any]]) -> list[str]:
    """The ids of the live nodes (as `ray.nodes()` lists them) that can take a spread actor,
    in a fixed order: a node without a CPU (a head started with `num_cpus=0`) could not."""
    return sorted(
        n["NodeID"]
        for n in nodes
        if n.get("Alive") and float((n.get("Resources") or {}).get("CPU", 0)) >= SLIVER
    )

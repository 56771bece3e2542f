"""Where the job's actors run (`ray.placement`).

`spread` deals the actors out round-robin over the cluster's live nodes, in the order the job
creates them: k consecutive actors (the replicas of one role) land on min(k, nodes) different
nodes. Each is pinned with a *soft* node affinity, so an actor whose node is gone by the time
Ray places it goes to another live node instead of waiting for it.

Ray ignores both its `SPREAD` strategy and a soft node affinity for an actor that asks for no
resources at all, as this job's actors otherwise do (0 CPUs: each runs one torch thread), and
places it on a random node: on a 3-node cluster, 3 replicas all sat on one node about one time
in nine (measured: 9 such actors under SPREAD went 6/2/1, 5/3/1, ... over 3 nodes). So a
spread actor asks for a sliver of a CPU (`SLIVER`), which any node with a CPU has room for.
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
        self.nodes = live_nodes() if how == "spread" else []
        self.dealt = 0

    def __call__(self) -> dict[str, Any]:
        """The next actor's options (merge into `.options(...)`)."""
        if not self.nodes:
            return {}
        node = self.nodes[self.dealt % len(self.nodes)]
        self.dealt += 1
        pin = NodeAffinitySchedulingStrategy(node, soft=True)
        return {"num_cpus": SLIVER, "scheduling_strategy": pin}


def live_nodes() -> list[str]:
    """The ids of the cluster's live nodes, in a fixed order (the same for every job)."""
    return sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])

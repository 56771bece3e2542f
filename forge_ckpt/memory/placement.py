"""Which holders keep a file's copies: rendezvous hashing over the holders on nodes other than
the writer's, so that losing the writer's node never takes a copy with it, and the files of
one writer spread over the other nodes. The writer's own node comes last: used only when
fewer than `copies` other nodes have a live holder (a warning says the guarantee is weaker).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

HolderRef = tuple[str, str]  # (actor name, node id)


def _score(key: str, name: str) -> bytes:
    return hashlib.blake2b(f"{key}\0{name}".encode(), digest_size=8).digest()


def preference(key: str, holders: Sequence[HolderRef], writer_node: str) -> list[HolderRef]:
    """Every holder, best first for `key`: other nodes by rendezvous score, then own node."""
    ranked = sorted(holders, key=lambda h: _score(key, h[0]), reverse=True)
    return [h for h in ranked if h[1] != writer_node] + [h for h in ranked if h[1] == writer_node]


def holder_name(run_id: str, node_id: str) -> str:
    """The detached actor's name: a restarted driver of the same run finds it by name."""
    return f"forge_ckpt_holder:{run_id}:{node_id}"

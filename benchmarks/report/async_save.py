"""'Async: what `save()` blocks on': the in-memory copy that makes the consistent cut."""

from __future__ import annotations

from .baselines import state_summary
from .common import fmt, med, met, secs


def _cpu_only_note(results: dict, ref: dict, total_rate: float) -> str:
    """Why the 5% target is out of reach without a GPU (shown when it was missed)."""
    return (
        "On a CPU-only machine the blocked time is a memory copy of the whole state, bounded "
        "by memory bandwidth (a few GB/s on this 2-core VM, shared by all the processes that "
        "copy at once); the synchronous save is bounded by the disk. The ratio is therefore "
        "about disk bandwidth / copy bandwidth, and it can only reach 5% when the disk is "
        "~20x slower than the copy; here the disk reached "
        f"{med(state_summary(ref)['raw_write_mbps']) or 0:.0f} MB/s against a copy of the "
        f"whole state at {total_rate:.0f} MB/s. TorchTitan's own async mode blocks for the "
        "same copy and longer (it allocates fresh buffers each time; forge_ckpt reuses the "
        "trainer's), see `trainer-only async blocked / TorchTitan async blocked` above. "
        "Avoiding the copy entirely would need copy-on-write snapshots (forking the actor "
        "processes, which hold Ray's threads: not safe). With a GPU trainer the copy is device-to-host into pinned buffers "
        "(tens of GB/s): "
        + (
            "see the GPU section below for the measured blocking time."
            if results.get("gpu")
            else "the target should be reachable there; it was not measurable here."
        )
        + "\n"
    )


def async_analysis(results: dict, p: dict, ref: dict, targets: dict) -> list[str]:
    out = ["### Async: what `save()` blocks on\n"]
    v = targets["async_blocked"]
    blocked = med(p["a_blocked"]) or 0.0
    stage = med(p["a_stage_copy"]) or 0.0
    snap = med(p["a_actor_snapshot"]) or 0.0
    rate = ref["trainer"]["tensor_bytes"] / stage / 1e9 if stage else 0.0
    total_rate = ref["full_bytes"] / blocked / 1e6 if blocked else 0.0
    out.append(
        f"`save()` returns once every component holds a private in-memory copy (the consistent "
        f"cut). Blocked {blocked:.3f}s: the trainer's copy into its reused staging buffers took "
        f"{stage:.3f}s ({rate:.1f} GB/s), the slowest actor's snapshot copy {snap:.3f}s, all "
        f"in parallel. Saving the trainer alone, the same copy took "
        f"{secs(p['ta_stage_copy'], 3)} (blocked {secs(p['ta_blocked'], 3)}; TorchTitan's async "
        f"`dcp_save` blocked {secs(p['titan_async_blocked'], 3)} for it): in the full save "
        f"{1 + ref['actors']} processes copy at once on {results['machine']['cores']} cores. "
        f"The rest runs in background threads; the driver's event loop stalled at "
        f"most {1000 * (med(p['a_loop_lag']) or 0):.0f} ms meanwhile. Ratio to the synchronous "
        f"save: {fmt(v['values'], 3)}, target <= 0.05: {met(v)}.\n"
    )
    if v.get("met") is False:
        out.append(_cpu_only_note(results, ref, total_rate))
    return out

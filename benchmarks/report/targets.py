"""The targets: judged at the reference state size (paired per-trial ratios), and their table."""

from __future__ import annotations

from .baselines import state_summary
from .common import REFERENCE_MIB, TARGETS, MiB, fmt, gpu_machine, med, met, series, table
from .scaling import actor_summaries

# ---- targets ----------------------------------------------------------------------------------


def reference(states: list[dict]) -> dict | None:
    if not states:
        return None
    at_or_below = [s for s in states if s["total_target"] // MiB <= REFERENCE_MIB]
    pool = at_or_below or states
    return max(pool, key=lambda s: s["total_target"])


def evaluate(results: dict) -> dict[str, dict]:
    states = results.get("state", [])
    ref = reference(states)
    out: dict[str, dict] = {}
    label = f"{ref['total_target'] // MiB} MiB" if ref else "-"
    summary = state_summary(ref) if ref else {}

    def of_medians(num: str, den: str, invert: bool = False) -> float | None:
        a, b = med(summary.get(num, [])), med(summary.get(den, []))
        if not a or not b:
            return None
        return b / a if invert else a / b

    medians = {
        "save_vs_raw": of_medians("forge_full_mbps", "raw_write_mbps"),
        "async_blocked": of_medians("forge_full_async_blocked_s", "forge_full_sync_s"),
        "trainer_vs_titan": of_medians("forge_trainer_sync_s", "titan_sync_s"),
        "load_vs_raw": of_medians("forge_load_mbps", "raw_read_mbps"),
    }
    for key in ("save_vs_raw", "async_blocked", "trainer_vs_titan", "load_vs_raw"):
        xs = summary.get(key, [])
        out[key] = {"values": xs, "where": f"total state {label}", "of_medians": medians[key]}
    actors = results.get("actors", [])
    if actors:
        summaries = actor_summaries(actors)
        last = summaries[-1]
        first = summaries[0]
        out["actors_64_vs_1"] = {
            "values": last.get("sync_vs_1", []),
            "of_medians": (med(last["sync_s"]) or 0) / (med(first["sync_s"]) or 1),
            "where": f"{last['actors']} actors vs 1, {last['bytes'] / MiB:.0f} MiB in all",
            "normalised": last.get("sync_vs_1_disk_normalised", []),
        }
    else:
        out["actors_64_vs_1"] = {"values": [], "where": "not run"}
    gpu = results.get("gpu")
    if gpu:
        xs = series(gpu["trials"], lambda r: r["forge_async"]["blocked_s"])
        out["gpu_blocked"] = {
            "values": xs,
            "where": f"{gpu['trainer']['tensor_bytes'] / 2**30:.1f} GiB on {gpu_machine(results)['cuda']}",
        }
    else:
        out["gpu_blocked"] = {"values": [], "where": "no GPU in this run"}
    for key, v in out.items():
        _, op, goal = TARGETS[key]
        m = med(v["values"])
        if m is None:
            v["met"] = None
        else:
            v["met"] = m >= goal if op == ">=" else m <= goal
            v["every_trial"] = all((x >= goal) if op == ">=" else (x <= goal) for x in v["values"])
    return out


def targets_section(targets: dict) -> list[str]:
    md: list[str] = []
    add = md.append
    add("## Targets\n")
    rows = []
    for key, (label, op, goal) in TARGETS.items():
        v = targets[key]
        digits = 3 if key == "async_blocked" else 2
        om = v.get("of_medians")
        rows.append(
            [
                label,
                f"{op} {goal}",
                fmt(v["values"], digits),
                "-" if om is None else f"{om:.{digits}f}",
                v["where"],
                met(v),
            ]
        )
    add(table(["Target", "Goal", "Measured", "Ratio of medians", "Where", "Result"], rows))
    add(
        "\n*Measured*: the median of the per-trial (paired) ratios, min-max in parentheses; the "
        "result is judged on it. *Ratio of medians*: the same figure from each side's median "
        "over the trials, unpaired, as a check that pairing did not decide the verdict."
    )
    add("")
    if targets.get("actors_64_vs_1", {}).get("normalised"):
        add(
            "The actor-scaling ratio compares runs minutes apart; divided by the raw write "
            "measured next to each (disk-normalised) it is "
            f"{fmt(targets['actors_64_vs_1']['normalised'])}.\n"
        )
    add("See [Where the time goes](#where-the-time-goes) for what limits each missed target.\n")
    return md

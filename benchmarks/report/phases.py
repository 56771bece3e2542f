"""Where the time of a save or load went: the phase timers of each process, per trial."""

from __future__ import annotations

from .common import get, series

# ---- phase breakdowns ---------------------------------------------------------------------------


def _phase(rows: list[dict], method: str, unit: int | str, name: str) -> list[float]:
    """Seconds spent in one timed phase: unit is an index into `units`, 'driver', or 'actors'
    (the slowest actor)."""

    def one(r: dict) -> float | None:
        m = r.get(method)
        if m is None:
            return None
        if unit == "driver":
            return m["driver"]["seconds"].get(name, 0.0)
        if unit == "actors":
            vals = [u["seconds"].get(name, 0.0) for u in m["units"][1:]]
            return max(vals) if vals else None
        return m["units"][unit]["seconds"].get(name, 0.0)

    return series(rows, one)


def _load_phase(rows: list[dict], unit: int | str, name: str, key: str = "load") -> list[float]:
    def one(r: dict) -> float | None:
        m = get(r, "forge_full_sync", key)
        if m is None:
            return None
        if unit == "actors":
            vals = [u["seconds"].get(name, 0.0) for u in m["units"][1:]]
            return max(vals) if vals else None
        return m["units"][unit]["seconds"].get(name, 0.0)

    return series(rows, one)


def phases_summary(point: dict) -> dict[str, list[float]]:
    rows = point["trials"]
    p: dict[str, list[float]] = {}
    # trainer-only sync save, against TorchTitan in the same trial
    p["titan_sync_s"] = series(rows, lambda r: r["titan_sync"]["total_s"])
    p["t_total"] = series(rows, lambda r: r["forge_trainer_sync"]["total_s"])
    p["t_dcp_save"] = _phase(rows, "forge_trainer_sync", 0, "dcp_save")
    p["t_crc_readback"] = _phase(rows, "forge_trainer_sync", 0, "crc_readback")
    p["t_rank_file"] = _phase(rows, "forge_trainer_sync", 0, "file_write")
    p["t_fsync_dir"] = _phase(rows, "forge_trainer_sync", 0, "fsync_dir")
    p["t_write_total"] = _phase(rows, "forge_trainer_sync", 0, "write_total")
    p["t_commit"] = _phase(rows, "forge_trainer_sync", "driver", "commit")
    p["t_prepare"] = _phase(rows, "forge_trainer_sync", "driver", "prepare_step")
    p["t_slack"] = series(rows, lambda r: r["forge_trainer_sync"]["poll_slack_s"])
    # full sync save
    p["f_total"] = series(rows, lambda r: r["forge_full_sync"]["total_s"])
    p["f_trainer_write"] = _phase(rows, "forge_full_sync", 0, "write_total")
    p["f_trainer_dcp"] = _phase(rows, "forge_full_sync", 0, "dcp_save")
    p["f_trainer_readback"] = _phase(rows, "forge_full_sync", 0, "crc_readback")
    p["f_actor_write"] = _phase(rows, "forge_full_sync", "actors", "file_write")
    p["f_actor_fsync"] = _phase(rows, "forge_full_sync", "actors", "fsync_file")
    p["f_commit"] = _phase(rows, "forge_full_sync", "driver", "commit")
    # async save
    p["a_blocked"] = series(rows, lambda r: r["forge_full_async"]["blocked_s"])
    p["a_stage_copy"] = _phase(rows, "forge_full_async", 0, "stage_copy")
    p["a_actor_snapshot"] = _phase(rows, "forge_full_async", "actors", "snapshot")
    p["a_loop_lag"] = series(rows, lambda r: r["forge_full_async"]["loop_lag_s"])
    p["a_total"] = series(rows, lambda r: r["forge_full_async"]["total_s"])
    p["a_trainer_write"] = _phase(rows, "forge_full_async", 0, "write_total")
    p["ta_blocked"] = series(rows, lambda r: r["forge_trainer_async"]["blocked_s"])
    p["ta_stage_copy"] = _phase(rows, "forge_trainer_async", 0, "stage_copy")
    p["titan_async_blocked"] = series(rows, lambda r: r["titan_async"]["blocked_s"])
    # load
    p["l_total"] = series(rows, lambda r: r["forge_full_sync"]["load"]["seconds"])
    p["l_verify"] = _load_phase(rows, 0, "verify")
    p["l_dcp_load"] = _load_phase(rows, 0, "dcp_load")
    p["l_actor_read"] = _load_phase(rows, "actors", "read_verified")
    p["l_actor_decode"] = [
        max(0.0, a - b)
        for a, b in zip(
            _load_phase(rows, "actors", "file_load"),
            _load_phase(rows, "actors", "read_verified"),
            strict=False,
        )
    ]
    p["l_raw_read"] = series(rows, lambda r: r["raw"]["read_s"])
    p["ln_total"] = series(rows, lambda r: r["forge_full_sync"]["load_noverify"]["seconds"])
    p["ln_dcp_load"] = _load_phase(rows, 0, "dcp_load", "load_noverify")
    p["ln_actor_read"] = _load_phase(rows, "actors", "read_verified", "load_noverify")
    p["titan_load_s"] = series(rows, lambda r: r["titan_sync"]["load_s"])
    return p

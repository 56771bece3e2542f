"""'Full save vs the raw disk': the trainer and the actors writing one step in parallel."""

from __future__ import annotations

from .baselines import state_summary
from .common import fmt, med, met, secs


def full_save_analysis(results: dict, p: dict, ref: dict, targets: dict) -> list[str]:
    v = targets["save_vs_raw"]
    dcp = med(p["t_dcp_save"]) or 0.0
    trainer_path = med(p["f_trainer_write"]) or 0.0
    actor_path = med(p["f_actor_write"]) or 0.0
    f_dcp = med(p["f_trainer_dcp"]) or 0.0
    text = (
        "A full step writes the trainer's DCP shard and one file per actor in parallel, then "
        f"commits ({secs(p['f_commit'], 3)}); the slowest writer decides. Trainer: "
        f"{trainer_path:.3f}s (DCP write {f_dcp:.3f}s, crc32c read-back "
        f"{secs(p['f_trainer_readback'], 3)}); slowest actor: {actor_path:.3f}s (of which fsync "
        f"{secs(p['f_actor_fsync'], 3)}). Throughput ratio {fmt(v['values'])}: {met(v)}. "
    )
    if trainer_path >= actor_path:
        text += (
            f"The trainer is the critical path. Its DCP write took {f_dcp:.3f}s here against "
            f"{dcp:.3f}s when the trainer saved alone: DCP's write (`torch.save` of every "
            "tensor into a buffered file) is slower than a raw write even alone - TorchTitan alone "
            f"reaches {fmt(state_summary(ref)['titan_vs_raw'])} of the raw disk speed - and in "
            f"a full step it shares {results['machine']['cores']} cores with the "
            f"{ref['actors']} actors' writes (crc32c + copy into the page cache) and the "
            "kernel's writeback. forge_ckpt writes the shards through its own DCP storage "
            "writer (2 threads per rank, CRC32C while writing, small writes coalesced, without "
            "the zip CRC32 `torch.save` would compute for every record: `dcp/zip_crc.py`), so no "
            "file is read back; what remains is DCP's serialization (`torch.save` per tensor). "
        )
    else:
        text += "The actors' files are the critical path here. "
    text += (
        "`dd` (one stream, 16 MiB blocks) is given as a second reference only; on this "
        "virtual disk its speed varied the most.\n"
    )
    return ["### Full save vs the raw disk\n", text]

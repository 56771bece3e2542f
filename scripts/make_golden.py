"""Write the golden checkpoint of the current on-disk format into tests/golden/v<N>/.

Every later release must load it (tests/test_golden.py), so it is written once per format
version and then frozen: the script refuses to overwrite an existing folder unless --force.

    .venv/bin/python scripts/make_golden.py [--force]

It holds one committed step (step-3; step-1 was saved too and removed by keep_last=1) of:
a trainer of 2 gloo ranks (FSDP2, TorchTitan AdamW + warmup LR, 3 train steps from fixed seeds),
an actor with 2 replicas and one with 1, each writing its own file with its RNG streams. The
actors' state comes from tests/golden_state.py (rebuilt from the seed by the test);
expected.json records what the trainer and the RNG streams must give back.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import _trainer_model  # noqa: E402
import golden_state  # noqa: E402
import ray  # noqa: E402

from forge_ckpt import CheckpointConfig, CheckpointCoordinator, spawn_trainer_ranks  # noqa: E402
from forge_ckpt.serialization.format import _TORCH_BLOB_DTYPES  # noqa: E402
from forge_ckpt.steps import layout  # noqa: E402

STEP = 3
WORLD = 2
TRAINER_SEED = 0
ACTORS = {"replay_buffer": [11, 12], "reward": [21]}  # component -> one seed per replica
EXTRA = {"golden": True, "policy_version": STEP}


def trainer_expectation(summaries: list[dict], probes: list[dict]) -> dict[str, Any]:
    """What a load must restore in the trainer: full tensors (the same on every rank), the LR
    schedule, the train state, and per rank the draws its RNG streams give next."""
    s = summaries[0]
    return {
        "world": WORLD,
        "seed": TRAINER_SEED,
        "full_params": golden_state.digest(s["full_params"]),
        "full_moments": golden_state.digest(s["full_moments"]),
        "lr": golden_state.digest(s["lr"]),
        "last_lr": golden_state.digest(s["last_lr"]),
        "last_epoch": s["last_epoch"],
        "train_step": s["train_step"],
        "probe": golden_state.digest(probes),
    }


async def write(folder: str) -> dict[str, Any]:
    """Train, save step 1 and step 3 (keep_last=1), and describe what step 3 holds."""
    rank_cls = ray.remote(num_cpus=0)(_trainer_model.TrainerRank)
    ranks = spawn_trainer_ranks(rank_cls, WORLD)
    ray.get([r.setup.remote(TRAINER_SEED) for r in ranks])
    actor_cls = ray.remote(num_cpus=0)(golden_state.GoldenActor)
    actors = {name: [actor_cls.remote(s) for s in seeds] for name, seeds in ACTORS.items()}
    coord = CheckpointCoordinator(CheckpointConfig(folder=folder, keep_last=1))
    coord.set_trainer(ranks)
    for name, handles in actors.items():
        coord.register(name, handles)
    ray.get([r.train.remote(1) for r in ranks])
    assert (await coord.save(1, extra={"golden": True, "policy_version": 1})).committed
    ray.get([r.train.remote(STEP - 1) for r in ranks])
    assert (await coord.save(STEP, extra=EXTRA)).committed
    coord.close()
    assert layout.committed_steps(folder) == [STEP], layout.all_steps(folder)
    summaries = ray.get([r.summary.remote() for r in ranks])
    rank_probes = ray.get([r.probe.remote() for r in ranks])
    actor_probes = {n: ray.get([h.probe.remote() for h in hs]) for n, hs in actors.items()}
    return {
        "format_version": layout.FORMAT_VERSION,
        "state_version": 2,
        "step": STEP,
        "extra": EXTRA,
        "trainer": trainer_expectation(summaries, rank_probes),
        "actors": {
            name: {"seeds": seeds, "probe": golden_state.digest(actor_probes[name])}
            for name, seeds in ACTORS.items()
        },
    }


def check_coverage() -> None:
    """The golden state must cover every dtype the serializer stores today."""
    missing = set(_TORCH_BLOB_DTYPES) - set(golden_state.V2_TORCH_DTYPES)
    if missing:
        sys.exit(f"golden_state does not cover the tensor dtypes {sorted(missing)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / "tests" / "golden"))
    parser.add_argument("--force", action="store_true", help="replace an existing folder")
    args = parser.parse_args()
    check_coverage()
    dest = Path(args.out) / f"v{layout.FORMAT_VERSION}"
    if dest.exists() and not args.force:
        sys.exit(f"{dest} exists: golden folders are frozen (pass --force to replace it)")
    tmp = Path(tempfile.mkdtemp(prefix="golden-"))
    folder = tmp / dest.name
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        ray.cloudpickle.register_pickle_by_value(_trainer_model)
        ray.cloudpickle.register_pickle_by_value(golden_state)
        expected = asyncio.run(write(str(folder)))
    finally:
        ray.shutdown()
    for name in (layout.LEASE, f"{layout.LEASE}.mutex"):  # a reader takes its own lease
        (folder / name).unlink(missing_ok=True)
    left = sorted(p.name for p in folder.iterdir())
    assert left == [layout.step_name(STEP)], f"unexpected files in the golden folder: {left}"
    (folder / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")
    if dest.exists():
        shutil.rmtree(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(str(folder), dest)
    shutil.rmtree(tmp)
    du = subprocess.run(["du", "-sh", str(dest)], capture_output=True, text=True).stdout.strip()
    print(f"wrote {dest} ({du.split()[0] if du else '?'})")


if __name__ == "__main__":
    main()

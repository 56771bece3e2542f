"""apps/grpo resumed on other shapes: 2 trainer ranks and 2 dataset replicas -> 1 and 1 -> 2
and 2, each change at a checkpoint in the middle of an epoch, with the loader's worker count
changed too. Every prompt is still served exactly once per epoch over the whole run, training
goes on (the reward keeps rising), and each start logs what changed.

Three real `python -m apps.grpo.main` processes share one run_dir; each trains to its `steps`
and commits there, and the next resumes from that step with the new shape.
"""

from __future__ import annotations

import json
import os

from apps.grpo import chaos

CONFIG = os.path.join(os.path.dirname(__file__), "..", "configs", "grpo_test.yaml")
SIZE, BATCH = 24, 4  # grpo_test.yaml: an epoch is 6 steps
COMMON = ["trainer.lr=5e-3"]  # learns visibly within 36 steps
SHAPES = [  # (steps, world size, dataset replicas, loader workers)
    (10, 2, 2, 1),  # stops 4 steps into epoch 2
    (21, 1, 1, 0),  # stops 3 steps into epoch 4
    (36, 2, 2, 1),
]


def test_resume_across_shapes_serves_every_prompt_once_per_epoch(tmp_path):
    run_dir = str(tmp_path / "run")
    previous = None
    for n, (steps, world, replicas, workers) in enumerate(SHAPES):
        shape = [f"trainer.world_size={world}", f"dataset.replicas={replicas}"]
        overrides = [*COMMON, f"steps={steps}", *shape, f"dataset.num_workers={workers}"]
        job = chaos.Job(CONFIG, run_dir, overrides, {}, str(tmp_path / f"start{n}.log"))
        assert job.wait(timeout=600) == 0, open(job.log).read()[-3000:]
        log = open(job.log).read()
        if previous is None:
            assert job.resumed_from() == 0
        else:
            assert job.resumed_from() == previous[0]
            for line in diagnosis(previous, (steps, world, replicas, workers)):
                assert line in log, f"{line!r} not logged:\n{log[-3000:]}"
        previous = (steps, world, replicas, workers)

    records = [json.loads(line) for line in open(os.path.join(run_dir, chaos.METRICS))]
    assert [r["step"] for r in records] == list(range(1, 37))
    served = [i for r in records for i in r["rollout_prompt_ids"]]
    epoch = SIZE // BATCH * BATCH
    for start in range(0, len(served), epoch):  # six whole epochs, each a permutation
        assert sorted(served[start : start + epoch]) == list(range(SIZE)), start // epoch
    rewards = [r["reward_mean"] for r in records]
    first, last = sum(rewards[:8]) / 8, sum(rewards[-8:]) / 8
    assert last > first, (first, last, rewards)


def diagnosis(old: tuple, new: tuple) -> list[str]:
    """The lines a resume from shape `old` into shape `new` must log."""
    _, world0, replicas0, workers0 = old
    _, world1, replicas1, workers1 = new
    return [
        f"trainer: trainer ranks changed: checkpoint={world0}, current={world1}",
        f"dataset: replicas changed: checkpoint={replicas0}, current={replicas1}; resharded by "
        "DatasetActor.reshard_states",
        f"dataset num_workers changed: checkpoint={workers0}, current={workers1}",
    ]

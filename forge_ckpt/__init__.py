"""forge_ckpt: one atomic checkpoint step for a distributed RL job on Ray.

The trainer's DCP shards (through TorchTitan's CheckpointManager) and every registered actor's
state go into one `step-N/` folder, made visible by a commit marker written last.
"""

__version__ = "0.1.0"

from typing import Any  # noqa: E402

from .actors import reshard  # noqa: E402  (ready-made resharding rules)
from .actors.checkpointable import Checkpointable  # noqa: E402
from .actors.immutable import Immutable, immutable  # noqa: E402
from .actors.reshard import ReshardRule  # noqa: E402
from .actors.weights import WeightVersions  # noqa: E402
from .config import CheckpointConfig  # noqa: E402
from .coordination.coordinator import CheckpointCoordinator  # noqa: E402
from .coordination.remote_errors import describe as describe_failure  # noqa: E402
from .coordination.remote_errors import is_lost  # noqa: E402
from .coordination.results import LoadResult, SaveResult  # noqa: E402
from .errors import (  # noqa: E402
    CheckpointCorruptError,
    CheckpointError,
    CheckpointLeaseCorruptError,
    CheckpointLockedError,
    CheckpointMismatchError,
    CheckpointSaveError,
    CheckpointSignatureError,
    InvalidNameError,
    NotSerializableError,
)
from .steps.transfer import CopyResult, copy_step  # noqa: E402
from .storage import StorageError  # noqa: E402

__all__ = [
    "CheckpointConfig",
    "CheckpointCoordinator",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointLeaseCorruptError",
    "CheckpointLockedError",
    "CheckpointMismatchError",
    "CheckpointSaveError",
    "CheckpointSignatureError",
    "Checkpointable",
    "CopyResult",
    "Immutable",
    "InvalidNameError",
    "LoadResult",
    "NotSerializableError",
    "ReshardRule",
    "SaveResult",
    "StorageError",
    "TrainerCheckpointer",
    "TrainerMixin",
    "WeightVersions",
    "committed_steps",
    "copy_step",
    "describe_failure",
    "immutable",
    "is_lost",
    "pending_steps",
    "reshard",
    "spawn_trainer_ranks",
]


def committed_steps(folder: str, storage_options: dict[str, Any] | None = None) -> list[int]:
    """The committed steps of a checkpoint folder (local path or `s3://`), oldest first: what
    `load()` would choose from, without opening the folder for writing."""
    from .steps import layout
    from .storage import open_storage

    return layout.committed_steps(open_storage(folder, storage_options))


def __getattr__(name: str):
    # The trainer integration imports torchtitan (seconds); only pay for it when used.
    if name == "TrainerCheckpointer":
        from .trainer import checkpointer as trainer

        return trainer.TrainerCheckpointer
    if name in ("TrainerMixin", "spawn_trainer_ranks"):
        from .trainer import ranks as trainer_actor

        return getattr(trainer_actor, name)
    raise AttributeError(name)


def pending_steps(folder: str, storage_options: dict[str, Any] | None = None) -> list[int]:
    """Step folders without a commit marker: a save in flight, or a crashed save's leftover
    (removed when the next job opens the folder). Never loaded."""
    from .steps import layout
    from .storage import open_storage

    store = open_storage(folder, storage_options)
    return sorted(set(layout.all_steps(store)) - set(layout.marked_steps(store)))

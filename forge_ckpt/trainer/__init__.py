"""Trainer integration: TorchTitan's `CheckpointManager` state written as DCP shards to an
explicit `step-N` path (`checkpointer`), the trainer rank as a Ray actor (`ranks`), and the
asynchronous snapshot into reused host buffers (`staging`)."""

"""Coordination: the driver-side `CheckpointCoordinator` and its collaborators (which step
numbers a save may take, the all-or-nothing load, calls under the lease, calls on many
actors at once), the records it returns and emits, and the runtime it runs on."""

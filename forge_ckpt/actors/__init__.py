"""Actor integration: the `Checkpointable` mixin for Ray actors, every RNG stream of a
process, weights stored once by version, resharding N saved replica states into M, and
state parts a snapshot references instead of copying."""

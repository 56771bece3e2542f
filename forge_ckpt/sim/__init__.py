"""A deterministic simulation of the checkpoint protocol: the real coordinator, commit, lease,
retention, rollback and storage code, run on virtual time against simulated stores and
actors, with seeded faults, and invariants checked as it goes (docs/protocol.md)."""

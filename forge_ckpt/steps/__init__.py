"""A checkpoint folder on storage: the step layout (manifest, COMMIT marker), the commit and
retention, rollback branches, the lease that makes a job the folder's one writer, signatures,
and copying a committed step between folders."""

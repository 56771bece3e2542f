"""The trainer's shards as standard PyTorch DCP: a storage writer/reader over forge_ckpt's
storage seam, a reader that places each item straight into its tensor, and the allowlisted
unpickling of DCP's `.metadata`."""

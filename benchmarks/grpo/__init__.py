"""The GRPO app's checkpoint cost: step time with a save every step per variant
(`python -m benchmarks.grpo.overhead`) and the trainer's share of a save
(`python -m benchmarks.grpo.save`)."""

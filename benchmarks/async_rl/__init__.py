"""`python -m benchmarks.async_rl`: the no-drain cut of asynchronous RL against draining.

Generators of the GRPO app's async mode (`apps/grpo/generator.py`) decode long, varied
completions (a larger policy's decode cost is modelled by `--token-cost-ms` per token). In the
same run, with the same generators, a checkpoint is taken mid-generation over and over in two
ways, alternating:

- **cut** (forge_ckpt): `coord.save()` at once; the generators snapshot between two tokens and
  keep decoding. The loop's stall is the save call (sync mode: until the COMMIT is durable).
- **drain**: wait until every in-flight generation has finished, then `coord.save()`. The loop's
  stall is the wait plus the save.

Then a cut step is loaded into fresh generators (as a resumed job would): the tokens they decode
to finish the requests are counted against what the requests still lacked at the cut (0
regenerated), against the discard approach (every in-flight token thrown away and decoded again).
Writes docs/benchmarks_async_rl.json and the "async_rl" section of docs/benchmarks.md.
"""

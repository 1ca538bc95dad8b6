"""The device side of a step: the model runner, per-request device state, step inputs, CUDA graphs, sampling,
verification and the proposer interface it drafts through."""

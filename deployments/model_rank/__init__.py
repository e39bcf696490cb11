"""The forward pass, shared by the Scheduler's engine and its rank actors: runner, keyed sampler, models,
layers, tensor-parallel rank actors and the MLX rank."""

"""The MLX model rank: the torch model's structure and weights, computed with MLX (Metal on a Mac).

The checkpoint is read by the torch loader (one mapping of names, shards, fused experts and the MTP layer),
then each torch module is mirrored by an MLX one holding the same tensors as MLX arrays, and the torch copy
is released tensor by tensor. The step contract, the host layout of a step and the keyed draw are shared
with the torch rank: only the forward pass and the paged KV arrays are MLX's.
"""

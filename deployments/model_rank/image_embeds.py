"""A rank's image embeddings: each image encoded once by the vision tower, kept until its placeholders are in.

The planner sends an image's patches with the first step that reaches it; the rank encodes it, writes the
rows each step covers over their placeholder rows' input embeddings (a chunk may start or end mid-image),
and drops the embeddings once the step holding its last placeholder ran, or when the plan names it (its
sequence ended or was preempted first: a recomputation sends the patches again).
"""

from collections.abc import Callable

import numpy as np
import torch

from deployments.messages.step import StepPlan
from deployments.model_rank.step_rows import ImageRows

Encoder = Callable[[torch.Tensor, tuple[int, int, int]], torch.Tensor]  # patches, grid -> [tokens, H]


class ImageEmbeddings:
    def __init__(self, encode: Encoder, device: torch.device) -> None:
        self.encode = encode
        self.device = device
        self.held: dict[str, torch.Tensor] = {}  # StepImage key -> [placeholders, H]

    def prepare(self, plan: StepPlan) -> None:
        """Before a step: drop what the plan names, encode the images whose patches it brings."""
        for key in plan.drop_images:
            self.held.pop(key, None)
        for seq in plan.seqs:
            for image in seq.images:
                if image.pixel_values is not None:
                    patches = torch.from_numpy(np.ascontiguousarray(image.pixel_values)).to(self.device)
                    self.held[image.key] = self.encode(patches, image.patch_grid)
                elif image.key not in self.held:
                    raise RuntimeError(f"image {image.key} has neither patches nor embeddings on this rank")

    def gather(self, rows: list[ImageRows]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The flat rows [N] the step's images replace and their embeddings [N, H] (None: no image rows)."""
        if not rows:
            return None
        index = torch.cat([torch.arange(r.row, r.row + r.count) for r in rows]).to(self.device)
        embeds = torch.cat([self.held[r.key][r.first : r.first + r.count] for r in rows])
        return index, embeds

    def finish(self, plan: StepPlan) -> None:
        """After a step: drop the images whose last placeholder it computed."""
        for seq in plan.seqs:
            done = seq.num_computed + len(seq.new_token_ids)
            for image in seq.images:
                if image.end <= done:
                    self.held.pop(image.key, None)

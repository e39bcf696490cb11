"""The MLX model runner: the torch runner's interface (deployments/model_rank/runner.py) over MLX arrays.

The step's host layout and the keyed draw are the torch runner's own code: logits leave MLX as float32
rows and are drawn by `sampler.sample_rows`, so one seed, position and logits give one token on both.
"""

from pathlib import Path

import mlx.core as mx
import numpy as np
import torch

from deployments.messages.replies import PromptLogprobRow
from deployments.messages.step import ZERO_STATE, StepOutput, StepPlan
from deployments.model_rank.forward_batch import LayerCacheSpec, LayerStateSpec, ParallelContext
from deployments.model_rank.image_embeds import ImageEmbeddings
from deployments.model_rank.mlx_rank.arrays import MX_NAMES, TORCH_TO_MX, as_bytes, from_bytes, from_torch, to_torch
from deployments.model_rank.mlx_rank.batch import MlxBatch
from deployments.model_rank.mlx_rank.mirror import attention_modules, mirror_model
from deployments.model_rank.mlx_rank.mtp import MlxMtpOps
from deployments.model_rank.mlx_rank.vision import MlxVisionTower
from deployments.model_rank.models import load_model
from deployments.model_rank.mtp_drafts import MtpDrafter
from deployments.model_rank.runner import RunnerInfo
from deployments.model_rank.sampler import sample_rows
from deployments.model_rank.step_rows import prompt_logprob_rows, step_rows


def mlx_device_name() -> str:
    """'gpu' (Metal) where MLX has one, else 'cpu'."""
    return "gpu" if mx.metal.is_available() else "cpu"


class MlxRunner:
    def __init__(self, model_dir: str | Path, dtype: str, mtp: bool = False, vision: bool = False) -> None:
        """`mtp`: draft with the checkpoint's MTP layer, if it has one; `vision`: run its vision tower."""
        mx.set_default_device(mx.gpu if mlx_device_name() == "gpu" else mx.cpu)
        torch_model = load_model(
            model_dir, dtype=dtype, device="cpu", parallel=ParallelContext(), pack=False, vision=vision
        )
        tower = getattr(torch_model, "visual", None)
        self.vision = None if tower is None else MlxVisionTower(tower)
        self.images = ImageEmbeddings(self._encode_image, torch.device("cpu"))
        self.config = torch_model.config
        self.mtp_on = mtp and self.config.has_mtp
        # The main layers' specs, then the MTP layer's: the order of the caches (and of a stored block's bytes).
        self.specs: list[LayerCacheSpec] = torch_model.kv_cache_specs() + (
            torch_model.mtp_kv_cache_specs() if self.mtp_on else []
        )
        self.state_specs: list[LayerStateSpec] = torch_model.state_specs()  # hybrids: one per recurrent layer
        self.weight_bytes = torch_model.weight_bytes()
        self.weights_format = torch_model.weights_format
        self.dtype = TORCH_TO_MX[self.config.dtype]
        mirrored = mirror_model(torch_model, self.mtp_on)  # frees the torch tensors as it copies them
        del torch_model
        self.model, self.mtp = mirrored.decoder, mirrored.mtp
        self.attentions, self.recurrents = mirrored.attentions, mirrored.recurrents  # in the specs' orders
        if len(self.attentions) != len(self.specs) or len(self.recurrents) != len(self.state_specs):
            raise RuntimeError("the MLX mirror's attention and recurrent layers do not match the model's specs")
        self.mtp_attentions = attention_modules(self.mtp.layers) if self.mtp is not None else []
        self.block_size = 0
        self.num_blocks = 0
        self.drafter: MtpDrafter | None = None

    def info(self) -> RunnerInfo:
        cfg = self.config
        itemsize = torch.empty((), dtype=cfg.dtype).element_size()
        return RunnerInfo(
            model_type=cfg.model_type,
            dtype=MX_NAMES[self.dtype],
            device=f"mlx-{mlx_device_name()}",
            vocab_size=cfg.vocab_size,
            max_position_embeddings=cfg.max_position_embeddings,
            weight_bytes=self.weight_bytes,
            weights_format=self.weights_format,
            kv_bytes_per_token=sum(s.elements_per_token() for s in self.specs) * itemsize,
            index_bytes_per_token=sum(s.index_dim for s in self.specs) * itemsize,
            eos_token_ids=list(cfg.eos_token_ids),
            device_name=mx.device_info().get("device_name", mlx_device_name()),
            threads=1,
            mtp=self.mtp_on,
            backend="mlx",
            state_bytes_per_slot=sum(s.bytes_per_slot(cfg.dtype) for s in self.state_specs),
            vision=cfg.vision,
            image_token_id=cfg.image_token_id,
            spatial_merge_size=cfg.spatial_merge_size,
        )

    def _encode_image(self, patches: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """The MLX tower's embeddings of one image, kept as a torch tensor by `ImageEmbeddings`."""
        assert self.vision is not None, "images reach a rank only when its tower is loaded"
        return to_torch(self.vision(from_torch(patches), grid))

    def allocate_kv(self, num_blocks: int, block_size: int, num_state_slots: int = 0) -> None:
        """The paged KV arrays, and a hybrid model's state slots (zeroed)."""
        for mixer, spec in zip(self.recurrents, self.state_specs):
            pools = (
                mx.zeros((num_state_slots, *spec.conv_shape), self.dtype),
                mx.zeros((num_state_slots, *spec.recurrent_shape), mx.float32),
            )
            mx.eval(pools)
            mixer.bind_state(*pools)
        slots = num_blocks * block_size
        for attn, spec in zip(self.attentions, self.specs):
            if spec.kind == "latent":
                arrays = [mx.zeros((slots, spec.latent_dim), self.dtype)]
            else:
                v_dim = spec.v_head_dim or spec.head_dim
                arrays = [
                    mx.zeros((slots, spec.num_kv_heads, spec.head_dim), self.dtype),
                    mx.zeros((slots, spec.num_kv_heads, v_dim), self.dtype),
                ]
            mx.eval(arrays)
            attn.cache.arrays = arrays
        self.num_blocks, self.block_size = num_blocks, block_size
        if self.mtp is not None:
            self.drafter = MtpDrafter(MlxMtpOps(self.mtp, block_size, self._mtp_caches), block_size)

    def _block_slots(self, block_ids: list[int]) -> mx.array:
        ids = np.asarray(block_ids, dtype=np.int64)
        return mx.array((ids[:, None] * self.block_size + np.arange(self.block_size)).reshape(-1), mx.int32)

    def read_block_rows(self, block_ids: list[int]) -> np.ndarray:
        """The KV rows of these blocks as bytes: [n, block_bytes], every cache array's block in order."""
        slots = self._block_slots(block_ids)
        parts = [as_bytes(a[slots].reshape(len(block_ids), -1)) for a in self._current_caches()]
        return np.concatenate(parts, axis=1)

    def write_block_rows(self, block_ids: list[int], rows: np.ndarray) -> None:
        """Copy rows made by `read_block_rows` (here or on another run, either backend) into these blocks."""
        slots = self._block_slots(block_ids)
        start = 0
        for attn in self.attentions:
            cache = attn.cache
            for index, array in enumerate(cache.arrays):
                row_shape = array.shape[1:]
                width = int(np.prod(row_shape)) * array.itemsize * self.block_size
                part = from_bytes(
                    rows[:, start : start + width], array.dtype, (len(block_ids) * self.block_size, *row_shape)
                )
                cache.write(index, part, slots)
                start += width
        mx.eval(self._current_caches())

    def read_state_slots(self, slots: list[int]) -> np.ndarray:
        """A hybrid model's states in these slots as bytes: [n, state_bytes_per_slot], every recurrent layer's
        conv history then recurrent state, in layer order (the torch rank's layout)."""
        index = mx.array(slots, mx.int32)
        return np.concatenate([as_bytes(pool[index]) for pool in self._current_pools()], axis=1)

    def write_state_slots(self, slots: list[int], rows: np.ndarray) -> None:
        """Copy rows made by `read_state_slots` (here or on another run, either backend) into these slots."""
        index, start = mx.array(slots, mx.int32), 0
        for pool in self._current_pools():
            width = int(np.prod(pool.shape[1:])) * pool.itemsize
            pool[index] = from_bytes(rows[:, start : start + width], pool.dtype, (len(slots), *pool.shape[1:]))
            start += width
        mx.eval(self._current_pools())

    def _current_caches(self) -> list[mx.array]:
        """Every layer's cache arrays as they are now (writes replace an array's contents in place)."""
        return [a for attn in self.attentions for a in attn.cache.arrays]

    def _mtp_caches(self) -> list[mx.array]:
        """The MTP layer's cache arrays as they are now."""
        return [a for attn in self.mtp_attentions for a in attn.cache.arrays]

    def _current_pools(self) -> list[mx.array]:
        """Every recurrent layer's state pools as they are now."""
        return [a for mixer in self.recurrents for a in mixer.pools()]

    def copy_states(self, copies: list[tuple[int, int]]) -> None:
        """Before a step: each (source, destination) slot copy in every recurrent layer (ZERO_STATE: zeroed)."""
        for source, destination in copies:
            for mixer in self.recurrents:
                mixer.copy_slot(None if source == ZERO_STATE else source, destination)

    def execute(self, plan: StepPlan) -> StepOutput:
        rows = step_rows(plan, self.block_size)
        self.copy_states(rows.state_copies)
        self.images.prepare(plan)
        batch = MlxBatch.from_rows(rows, self.block_size)
        images = self.images.gather(rows.image_rows)
        if images is not None:
            batch.image_rows, batch.image_embeds = mx.array(images[0].numpy(), mx.int32), from_torch(images[1])
        hidden = self.model(batch)  # [T, H]
        self.images.finish(plan)
        drawn = None
        if rows.logits_rows:
            drawn = self.model.logits(hidden[mx.array(rows.logits_rows, mx.int32)])  # [R, V] float32
        evaluated = [hidden, *([drawn] if drawn is not None else [])]
        mx.eval([*evaluated, *self._current_caches(), *self._current_pools()])
        output = StepOutput(prompt_rows=self._prompt_rows(plan, hidden))
        if drawn is not None:
            output.draws = sample_rows(to_torch(drawn), [d for s in plan.seqs for d in s.draws])
        if self.drafter is not None and any(s.mtp for s in plan.seqs):
            output.proposals = self.drafter.run(plan, rows, hidden, output.draws)
            output.mtp = self.drafter.work
            mx.eval(self._current_caches())  # the last chained pass's cache rows
        return output

    def _prompt_rows(self, plan: StepPlan, hidden: mx.array) -> dict[int, list[PromptLogprobRow]]:
        return prompt_logprob_rows(
            plan, lambda first, count: to_torch(self.model.logits(hidden[first : first + count]))
        )

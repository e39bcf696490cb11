"""The model runner: turns a StepPlan into tensors, runs the forward pass and draws the keyed tokens.

One runner per rank. At tensor-parallel size 1 it lives inside the Scheduler replica; above that each
ModelRank actor holds one and every rank runs the same plan.
"""

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from deployments.messages.step import ZERO_STATE, StepOutput, StepPlan
from deployments.model_rank.forward_batch import ForwardBatch, ParallelContext
from deployments.model_rank.host_reads import HostReads
from deployments.model_rank.image_embeds import ImageEmbeddings
from deployments.model_rank.models import CausalLM, load_model
from deployments.model_rank.mtp_drafts import MtpDrafter
from deployments.model_rank.pocket_ops import PocketOps, row_spans
from deployments.model_rank.sampler import prepare_draws, start_draws
from deployments.model_rank.step_rows import StepRows, pending_prompt_rows, step_rows


@dataclass
class RunnerInfo:
    """What the scheduler needs to know about the loaded model (returned by every rank)."""

    model_type: str
    dtype: str
    device: str
    vocab_size: int
    max_position_embeddings: int
    weight_bytes: int
    kv_bytes_per_token: int  # on this rank, all layers together
    eos_token_ids: list[int]
    device_name: str
    threads: int = 1  # intra-op threads the forward pass computes with on this rank
    mtp: bool = False  # the rank drafts with the checkpoint's MTP layer (its cache is in kv_bytes_per_token)
    backend: str = "torch"  # "torch" or "mlx": what computes the forward pass
    state_bytes_per_slot: int = 0  # hybrid models: one sequence's recurrent states on this rank (0: none)
    # The rank runs a vision tower: the placeholder id images expand to, patches per placeholder side.
    vision: bool = False
    image_token_id: int | None = None
    spatial_merge_size: int = 0
    hidden_size: int = 0
    num_layers: int = 0


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for, but torch sees no CUDA device")
    return torch.device(device)


class ModelRunner:
    def __init__(
        self,
        model_dir: str | Path,
        dtype: str,
        device: str,
        parallel: ParallelContext,
        mtp: bool = False,
        vision: bool = False,
        pocket_neurons: int = 0,
    ) -> None:
        """`mtp`: draft with the checkpoint's MTP layer, if it has one; `vision`: load its vision tower;
        `pocket_neurons`: living weights' pocket beside the last layer's MLP (docs/slide.md), 0: none."""
        self.device = resolve_device(device)
        if self.device.type == "cuda" and parallel.is_parallel:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.model: CausalLM = load_model(model_dir, dtype=dtype, device=self.device, parallel=parallel, vision=vision)
        self.images = ImageEmbeddings(self.model.encode_image, self.device)
        self.mtp_on = mtp and self.model.config.has_mtp
        self.mtp_specs = self.model.mtp_kv_cache_specs() if self.mtp_on else []
        self.specs = self.model.kv_cache_specs()
        self.state_specs = self.model.state_specs()
        self.block_size = 0
        self.num_blocks = 0
        self.state_pools: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.drafter: MtpDrafter | None = None
        self.slide = None if not pocket_neurons else PocketOps(self.model, pocket_neurons, self.device)

    def info(self) -> RunnerInfo:
        cfg = self.model.config
        itemsize = torch.empty((), dtype=cfg.dtype).element_size()
        name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        return RunnerInfo(
            model_type=cfg.model_type,
            dtype=str(cfg.dtype).removeprefix("torch."),
            device=self.device.type,
            vocab_size=cfg.vocab_size,
            max_position_embeddings=cfg.max_position_embeddings,
            weight_bytes=self.model.weight_bytes(),
            kv_bytes_per_token=sum(s.elements_per_token() for s in [*self.specs, *self.mtp_specs]) * itemsize,
            eos_token_ids=list(cfg.eos_token_ids),
            device_name=name,
            threads=torch.get_num_threads(),
            mtp=self.mtp_on,
            state_bytes_per_slot=sum(s.bytes_per_slot(cfg.dtype) for s in self.state_specs),
            vision=cfg.vision,
            image_token_id=cfg.image_token_id,
            spatial_merge_size=cfg.spatial_merge_size,
            hidden_size=cfg.hidden_size,
            num_layers=cfg.num_hidden_layers,
        )

    def allocate_kv(self, num_blocks: int, block_size: int, num_state_slots: int = 0) -> None:
        """The paged KV pool, and a hybrid model's state slots (zeroed)."""
        dtype = self.model.config.dtype
        if self.state_specs:
            self.state_pools = [s.allocate(num_state_slots, dtype, self.device) for s in self.state_specs]
            self.model.bind_state_pools(self.state_pools)
        caches = [spec.allocate(num_blocks, block_size, dtype, self.device) for spec in self.specs]
        self.model.bind_kv_caches(caches)
        if self.mtp_on:
            # Rows a step never wrote (a prefix adopted before MTP saw it) only make poorer drafts.
            mtp_caches = [s.allocate(num_blocks, block_size, dtype, self.device) for s in self.mtp_specs]
            self.model.bind_mtp_kv_caches(mtp_caches)  # type: ignore[operator]
            caches = [*caches, *mtp_caches]
            self.drafter = MtpDrafter(TorchMtpOps(self, self.model.mtp), block_size)  # type: ignore[arg-type]
        self.caches = [tensor for cache in caches for tensor in cache]  # every layer's tensors, in order
        self.num_blocks, self.block_size = num_blocks, block_size

    def read_block_rows(self, block_ids: list[int]) -> np.ndarray:
        """The KV rows of these blocks as bytes: [n, block_bytes], every cache tensor's block in order."""
        return self._read_rows(self.caches, block_ids)

    def write_block_rows(self, block_ids: list[int], rows: np.ndarray) -> None:
        """Copy rows made by `read_block_rows` (here or on another run) into these blocks."""
        self._write_rows(self.caches, block_ids, rows)

    def read_state_slots(self, slots: list[int]) -> np.ndarray:
        """A hybrid model's states in these slots as bytes: [n, state_bytes_per_slot], every recurrent
        layer's conv history then recurrent state, in layer order."""
        return self._read_rows([t for pool in self.state_pools for t in pool], slots)

    def write_state_slots(self, slots: list[int], rows: np.ndarray) -> None:
        """Copy rows made by `read_state_slots` (here or on another run) into these slots."""
        self._write_rows([t for pool in self.state_pools for t in pool], slots, rows)

    def _read_rows(self, tensors: list[torch.Tensor], rows: list[int]) -> np.ndarray:
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        parts = [t.index_select(0, index).reshape(len(rows), -1).view(torch.uint8) for t in tensors]
        return torch.cat(parts, dim=1).cpu().numpy()

    def _write_rows(self, tensors: list[torch.Tensor], rows: list[int], data: np.ndarray) -> None:
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        flat = torch.from_numpy(np.require(data, requirements=["C", "W"])).to(self.device).reshape(len(rows), -1)
        start = 0
        for t in tensors:
            width = t[0].numel() * t.element_size()
            part = flat[:, start : start + width].contiguous().view(t.dtype).reshape(len(rows), *t.shape[1:])
            t.index_copy_(0, index, part)
            start += width

    def forward_batch(self, rows: StepRows) -> ForwardBatch:
        as_long = lambda values: torch.tensor(values, dtype=torch.long, device=self.device)  # noqa: E731
        images = self.images.gather(rows.image_rows)
        return ForwardBatch(
            input_ids=as_long(rows.input_ids),
            positions=as_long(rows.positions),
            query_lens=rows.query_lens,
            context_lens=rows.context_lens,
            block_tables=rows.block_tables,
            slot_mapping=as_long(rows.slots),
            logits_indices=as_long(rows.logits_rows),
            block_size=self.block_size,
            state_slots=rows.state_slots,
            state_captures=rows.state_captures,
            mrope_positions=as_long(rows.mrope_positions) if rows.mrope_positions else None,
            image_rows=None if images is None else images[0],
            image_embeds=None if images is None else images[1],
        )

    def pocket_call(self, op: str, *args: object) -> object:
        """A living-weights operation (pocket_ops.py)."""
        if self.slide is None:
            raise ValueError("this rank holds no pocket: the server runs without slide")
        return self.slide.call(op, *args)

    def copy_states(self, copies: list[tuple[int, int]]) -> None:
        """Before a step: each (source, destination) slot copy in every recurrent layer (ZERO_STATE: zeroed)."""
        for source, destination in copies:
            for pool in self.state_pools:
                for tensor in pool:
                    if source == ZERO_STATE:
                        tensor[destination].zero_()
                    else:
                        tensor[destination].copy_(tensor[source])

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepOutput:
        """Run one step: the drawn row (token, logprobs) of each sequence whose step ends at its last token,
        and the prompt rows of sequences that asked for them."""
        rows = step_rows(plan, self.block_size)
        self.copy_states(rows.state_copies)
        self.images.prepare(plan)
        if self.slide is not None:
            self.slide.pocket.spans = row_spans(plan)
        batch = self.forward_batch(rows)
        hidden = self.model.forward(batch)  # [T, H]
        self.images.finish(plan)
        reads = HostReads()  # the step's one read back from the device: tokens and the figures asked for
        prompt_rows = pending_prompt_rows(plan, self._logits_of(hidden), reads)
        draws = [d for s in plan.seqs for d in s.draws]
        drawn = None
        if draws:
            logits = self.model.compute_logits(hidden[batch.logits_indices])  # [R, V] float32
            drawn = start_draws(logits.float(), prepare_draws(draws, logits.device), reads)
        reads.fetch()
        output = StepOutput(prompt_rows=prompt_rows.rows(), draws=[] if drawn is None else drawn.results())
        if self.drafter is not None and any(s.mtp for s in plan.seqs):
            output.proposals = self.drafter.run(plan, rows, hidden, output.draws)
            output.mtp = self.drafter.work
        return output

    def _logits_of(self, hidden: torch.Tensor) -> Callable[[int, int], torch.Tensor]:
        def logits_of(first: int, count: int) -> torch.Tensor:
            return self.model.compute_logits(hidden[first : first + count]).float()  # [n, V], on the device

        return logits_of


class TorchMtpOps:
    """The torch MTP layer's part in drafting (deployments/model_rank/mtp_drafts.py)."""

    def __init__(self, runner: ModelRunner, mtp: torch.nn.Module) -> None:
        self.runner, self.mtp = runner, mtp

    def batch(self, rows: StepRows) -> ForwardBatch:
        return self.runner.forward_batch(rows)

    def take(self, array: torch.Tensor, rows: list[int]) -> torch.Tensor:
        return array[torch.tensor(rows, dtype=torch.long, device=array.device)]

    def residual(self, hidden: torch.Tensor, next_ids: list[int], batch: ForwardBatch) -> torch.Tensor:
        ids = torch.tensor(next_ids, dtype=torch.long, device=hidden.device)
        return self.mtp.residual(hidden, ids, batch)  # [R, H]

    def greedy(self, residual: torch.Tensor) -> list[int]:
        return self.mtp.greedy_drafts(residual).tolist()

    def settle(self, array: torch.Tensor) -> None:
        if self.runner.device.type == "cuda":
            torch.cuda.synchronize(self.runner.device)

"""The model runner: turns a StepPlan into tensors, runs the forward pass and draws the keyed tokens.

One runner per rank. At tensor-parallel size 1 it lives inside the Scheduler replica; above that each
ModelRank actor holds one and every rank runs the same plan. A step's tensors are built on the device
before the layers (device_batch.py); on CUDA, decode steps replay graphs captured at startup
(decode_graphs.py), and the step's one host read is the sampled ids (docs/engine.md, The step on a GPU).
"""

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from deployments.messages.slide import PocketCall
from deployments.messages.step import ZERO_STATE, StepOutput, StepPlan
from deployments.model_rank.decode_graphs import Capture, CudaGraphCapture, DecodeGraphs
from deployments.model_rank.device_batch import DeviceBatches, Sink, run_forward
from deployments.model_rank.forward_batch import ForwardBatch, LayerCacheSpec, ParallelContext
from deployments.model_rank.host_reads import HostReads
from deployments.model_rank.image_embeds import ImageEmbeddings
from deployments.model_rank.models import CausalLM, load_model
from deployments.model_rank.mtp_drafts import MtpDrafter
from deployments.model_rank.pocket_ops import PocketOps, row_spans
from deployments.model_rank.sampler import prepare_draws, start_draws
from deployments.model_rank.step_rows import StepRows, pending_prompt_rows, step_rows
from deployments.model_rank.warm_up import warm_kernels
from kernels.paged_meta import ALL_ROWS, DECODE_MAX_QUERY, round_row_len


@dataclass
class RunnerInfo:
    """What the scheduler needs to know about the loaded model (returned by every rank)."""

    model_type: str
    dtype: str
    device: str
    vocab_size: int
    max_position_embeddings: int
    weight_bytes: int
    weights_format: str  # a dtype, or a GGUF's block types and whether they are kept (models/__init__.py)
    kv_bytes_per_token: int  # on this rank, all layers together
    eos_token_ids: list[int]
    device_name: str
    threads: int = 1  # intra-op threads the forward pass computes with on this rank
    mtp: bool = False  # the rank drafts with the checkpoint's MTP layer (its cache is in kv_bytes_per_token)
    backend: str = "torch"  # "torch" or "mlx": what computes the forward pass
    state_bytes_per_slot: int = 0  # hybrid models: one sequence's recurrent states on this rank (0: none)
    index_bytes_per_token: int = 0  # of kv_bytes_per_token: DSA indexers' keys (GLM-5.3 families)
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
        cuda_graphs: bool = True,
    ) -> None:
        """`mtp`: draft with the checkpoint's MTP layer, if it has one; `vision`: load its vision tower;
        `pocket_neurons`: living weights' pocket beside the last layer's MLP (docs/slide.md), 0: none;
        `cuda_graphs`: replay decode steps as CUDA graphs on a CUDA device."""
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
        self.cuda_graphs = cuda_graphs
        self.graphs: DecodeGraphs | None = None

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
            weights_format=self.model.weights_format,
            kv_bytes_per_token=sum(s.elements_per_token() for s in [*self.specs, *self.mtp_specs]) * itemsize,
            index_bytes_per_token=sum(s.index_dim for s in [*self.specs, *self.mtp_specs]) * itemsize,
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
        """The paged KV pool, and a hybrid model's state slots (zeroed), each with one more block and slot
        than asked: the sink, where padding and warm-up rows write (the engine never hands it out)."""
        dtype = self.model.config.dtype
        self.sink = Sink(block=num_blocks, slot=num_state_slots if self.state_specs else -1)
        if self.state_specs:
            self.state_pools = [s.allocate(num_state_slots + 1, dtype, self.device) for s in self.state_specs]
            self.model.bind_state_pools(self.state_pools)
        caches = [spec.allocate(num_blocks + 1, block_size, dtype, self.device) for spec in self.specs]
        self.model.bind_kv_caches(caches)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.batches = self.device_batches(self.specs)
        if self.mtp_on:
            # Rows a step never wrote (a prefix adopted before MTP saw it) only make poorer drafts.
            mtp_caches = [s.allocate(num_blocks + 1, block_size, dtype, self.device) for s in self.mtp_specs]
            self.model.bind_mtp_kv_caches(mtp_caches)  # type: ignore[operator]
            caches = [*caches, *mtp_caches]
            self.drafter = MtpDrafter(TorchMtpOps(self, self.model.mtp), block_size)  # type: ignore[arg-type]
        self.caches = [tensor for cache in caches for tensor in cache]  # every layer's tensors, in order

    def device_batches(self, specs: list[LayerCacheSpec]) -> DeviceBatches:
        """A builder of step batches for layers with these caches: its tables fit the longest sequence."""
        limits = tuple(sorted({ALL_ROWS if spec.kind == "latent" else DECODE_MAX_QUERY for spec in specs}))
        longest = -(-self.model.config.max_position_embeddings // self.block_size) + 1
        return DeviceBatches(self.device, self.block_size, limits, min(self.num_blocks, longest), self.sink)

    @torch.inference_mode()
    def warm_up(self, lanes: int, capture: Capture | None = None) -> None:
        """Before the first request: on CUDA, compile every kernel for the shapes steps take and capture the
        decode graphs for up to `lanes` sequences (with `cuda_graphs`, and not with a pocket, whose rows
        change per step). `capture` runs the graphs' bookkeeping elsewhere (EagerReplay: tests on CPU)."""
        if capture is None:
            if self.device.type != "cuda":
                return
            warm_kernels(self, lanes)
            if not self.cuda_graphs or self.slide is not None:
                return
            capture = CudaGraphCapture()
        longest_row = round_row_len(self.batches.tables.width * self.block_size)
        static = self.batches.static_step(lanes, bool(self.state_specs), longest_row)
        reset = self._reset_sink if self.state_specs else None
        self.graphs = DecodeGraphs(self.model.forward, self.batches, lanes, static, capture, reset)

    def _reset_sink(self) -> None:
        for pool in self.state_pools:
            for tensor in pool:
                tensor[self.sink.slot].zero_()

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
        """The step's batch on the device (device_batch.py), with its image rows' embeddings."""
        batch = self.batches.build(rows)
        images = self.images.gather(rows.image_rows)
        if images is not None:
            batch.image_rows, batch.image_embeds = images
        return batch

    def forward(self, rows: StepRows) -> tuple[ForwardBatch, torch.Tensor]:
        """The step's batch and its hidden states [T, H] (a graph's [bucket, H] for a graph step: the rows
        past the step's are padding)."""
        if self.graphs is not None and self.slide is None and self.graphs.holds(rows):
            return self.graphs.run(rows)
        batch = self.forward_batch(rows)
        return batch, run_forward(self.model.forward, batch)

    def pocket_call(self, call: PocketCall[Any]) -> object:
        """A living-weights operation (pocket_ops.py)."""
        if self.slide is None:
            raise ValueError("this rank holds no pocket: the server runs without slide")
        return self.slide.answer(call)

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
        batch, hidden = self.forward(rows)  # [T, H]
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
    """The torch MTP layer's part in drafting (deployments/model_rank/mtp_drafts.py): nothing here reads the
    device until `read`; passes are timed by CUDA events on a GPU (the host clock on CPU, where every op
    has finished when it returns)."""

    def __init__(self, runner: ModelRunner, mtp: torch.nn.Module) -> None:
        self.runner, self.mtp = runner, mtp
        self.batches = runner.device_batches(runner.mtp_specs)  # its own tables: the drafts' rows differ
        self.on_cuda = runner.device.type == "cuda"

    def batch(self, rows: StepRows) -> ForwardBatch:
        return self.batches.build(rows)

    def ids(self, values: list[int]) -> torch.Tensor:
        return self.batches.longs.send([values])[0]

    def take(self, array: torch.Tensor, rows: list[int]) -> torch.Tensor:
        return array.index_select(0, self.ids(rows))

    def residual(self, hidden: torch.Tensor, next_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return self.mtp.residual(hidden, next_ids, batch)  # [R, H]

    def greedy(self, residual: torch.Tensor) -> torch.Tensor:
        return self.mtp.greedy_drafts(residual)  # [R], on the device

    def read(self, arrays: list[torch.Tensor]) -> list[list[int]]:
        values = torch.cat(arrays).tolist()  # the drafter's one host read
        bounds = np.cumsum([0, *(int(array.shape[0]) for array in arrays)])
        return [values[start:end] for start, end in zip(bounds[:-1], bounds[1:])]

    def mark(self, after: torch.Tensor | None) -> object:
        if not self.on_cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: Any, end: Any) -> float:
        if not self.on_cuda:
            return end - start
        end.synchronize()  # already done once the drafts were read
        return start.elapsed_time(end) / 1000

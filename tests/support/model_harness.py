"""A small test-side driver for `CausalLM`: allocates paged caches (and a hybrid model's state slots) from
the model's specs, hands out blocks sequentially, and builds `ForwardBatch`es for one or several sequences
(whole, chunked or decoding); each sequence gets a zeroed state slot of its own."""

from dataclasses import dataclass, field

import torch

from deployments.model_rank.forward_batch import ForwardBatch, LayerCacheSpec
from deployments.model_rank.models import CausalLM


@dataclass
class Sequence:
    tokens: list[int] = field(default_factory=list)  # tokens already in the cache
    blocks: list[int] = field(default_factory=list)
    slot: int = 0  # its recurrent layers' state slot (hybrid models)


class PagedHarness:
    def __init__(self, model: CausalLM, block_size: int = 16, num_blocks: int = 128, num_slots: int = 16) -> None:
        self.model = model
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.next_block = 0
        self.seqs: dict[int, Sequence] = {}
        model.bind_kv_caches(self.allocate(model.kv_cache_specs()))
        device = next(model.parameters()).device
        self.state_pools = [s.allocate(num_slots, model.config.dtype, device) for s in model.state_specs()]
        model.bind_state_pools(self.state_pools)

    def allocate(self, specs: list[LayerCacheSpec]) -> list[tuple[torch.Tensor, ...]]:
        device = next(self.model.parameters()).device
        return [s.allocate(self.num_blocks, self.block_size, self.model.config.dtype, device) for s in specs]

    def _blocks_for(self, seq: Sequence, total: int) -> None:
        while len(seq.blocks) * self.block_size < total:
            if self.next_block >= self.num_blocks:
                raise RuntimeError("harness ran out of cache blocks")
            seq.blocks.append(self.next_block)
            self.next_block += 1

    def batch(
        self,
        chunks: list[tuple[int, list[int]]],
        all_logits: bool = False,
        captures: list[list[tuple[int, int]]] | None = None,
    ) -> ForwardBatch:
        """One step: for each (sequence id, new tokens), in order. Logits rows: each chunk's last token.
        `captures`: per chunk, the (row offset, slot) pairs whose slot gets the states after that row."""
        ids, positions, slots, rows = [], [], [], []
        query_lens, context_lens, tables = [], [], []
        for seq_id, new in chunks:
            seq = self.seqs.setdefault(seq_id, Sequence(slot=len(self.seqs)))
            start = len(seq.tokens)
            self._blocks_for(seq, start + len(new))
            for offset, token in enumerate(new):
                pos = start + offset
                ids.append(token)
                positions.append(pos)
                slots.append(seq.blocks[pos // self.block_size] * self.block_size + pos % self.block_size)
            rows.extend(range(len(ids) - len(new), len(ids)) if all_logits else [len(ids) - 1])
            seq.tokens.extend(new)
            query_lens.append(len(new))
            context_lens.append(len(seq.tokens))
            tables.append(list(seq.blocks))
        states = [self.seqs[seq_id].slot for seq_id, _ in chunks] if self.state_pools else []
        return ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.long),
            positions=torch.tensor(positions, dtype=torch.long),
            query_lens=query_lens,
            context_lens=context_lens,
            block_tables=tables,
            slot_mapping=torch.tensor(slots, dtype=torch.long),
            logits_indices=torch.tensor(rows, dtype=torch.long),
            block_size=self.block_size,
            state_slots=states,
            state_captures=captures or [],
        )

    def step(
        self,
        chunks: list[tuple[int, list[int]]],
        all_logits: bool = False,
        captures: list[list[tuple[int, int]]] | None = None,
    ) -> torch.Tensor:
        """Run one forward; returns logits [R, V] for the rows `batch` selects."""
        batch = self.batch(chunks, all_logits, captures)
        hidden = self.model(batch)
        return self.model.compute_logits(hidden[batch.logits_indices])

    def resume(self, seq_id: int, source_id: int, length: int, slot: int) -> None:
        """Start `seq_id` as the first `length` tokens of `source_id` (a whole number of its blocks, shared)
        with its recurrent states in `slot`, as a prefix-cache hit restores a captured snapshot."""
        if length % self.block_size:
            raise ValueError(f"a resumed prefix covers whole blocks of {self.block_size} tokens, not {length}")
        source = self.seqs[source_id]
        blocks = source.blocks[: length // self.block_size]
        self.seqs[seq_id] = Sequence(tokens=source.tokens[:length], blocks=list(blocks), slot=slot)

    def copy_state(self, source: int, destination: int) -> None:
        """Copy one slot's states into another in every recurrent layer, as the runner copies a snapshot into
        a running slot before a step."""
        for pool in self.state_pools:
            for tensor in pool:
                tensor[destination].copy_(tensor[source])

    def prefill(self, seq_id: int, prompt: list[int], chunk: int | None = None) -> torch.Tensor:
        """Feed a prompt whole or in chunks; returns the last token's logits [V]."""
        size = chunk or len(prompt)
        logits = None
        for start in range(0, len(prompt), size):
            logits = self.step([(seq_id, prompt[start : start + size])])
        assert logits is not None
        return logits[0]

    def generate(self, seq_id: int, prompt: list[int], max_new_tokens: int, chunk: int | None = None) -> list[int]:
        """Greedy continuation: chunked or whole prefill, then one cached decode step per token."""
        logits = self.prefill(seq_id, prompt, chunk)
        out = [int(logits.argmax())]
        while len(out) < max_new_tokens:
            out.append(int(self.step([(seq_id, [out[-1]])])[0].argmax()))
        return out


def resumed_from_capture(model: CausalLM, prompt: list[int]) -> torch.Tensor:
    """Logits of every row of prompt[16:], resumed from the states captured after row 15 of a prefill that
    ran beside another sequence, copied to a fresh slot as a prefix-cache hit restores a snapshot."""
    harness = PagedHarness(model)
    harness.step([(1, prompt[::-1][:9]), (0, prompt)], captures=[[], [(15, 13)]])
    harness.copy_state(13, 12)
    harness.resume(2, source_id=0, length=16, slot=12)
    return harness.step([(2, prompt[16:])], all_logits=True)


def tp_worker(
    rank: int, world: int, init_file: str, checkpoints: list[str], prompt: list[int], max_new: int, out: str
) -> None:
    """One tensor-parallel rank (spawned by the TP tests): per checkpoint, every prompt row's logits, a greedy
    continuation and, for hybrid models, the rows after a resume from captured states (else None)."""
    import torch.distributed as dist

    from deployments.model_rank.forward_batch import ParallelContext
    from deployments.model_rank.models import load_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        results = {}
        for checkpoint in checkpoints:
            model = load_model(checkpoint, dtype="float32", parallel=ParallelContext(tp_rank=rank, tp_size=world))
            logits = PagedHarness(model).step([(0, prompt)], all_logits=True)
            resumed = resumed_from_capture(model, prompt) if model.state_specs() else None
            results[checkpoint] = (logits, PagedHarness(model).generate(0, prompt, max_new), resumed)
        if rank == 0:
            torch.save(results, out)
    finally:
        dist.destroy_process_group()

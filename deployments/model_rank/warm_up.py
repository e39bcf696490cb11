"""Compiling every Triton kernel before the first request (docs/engine.md, The step on a GPU).

Triton compiles a kernel the first time it is launched with a new specialisation: a new constexpr, or an
integer argument that becomes 1 or divisible by 16 (or stops being), or a pointer that stops being 16-byte
aligned. Step tensors are aligned and the attention layout fixes its strides (kernels/paged_meta.py), so
what is left to vary is the token and sequence counts a step passes: the warm-up runs one step of each
class (1 token; a multiple of 16; neither; odd and even, for counts multiplied by the experts per token),
decode rounds of every graph bucket, verify-sized rows and prefill chunks, with every row over the sink.
"""

from typing import Protocol

import torch

from deployments.model_rank.decode_graphs import buckets_for
from deployments.model_rank.device_batch import DeviceBatches, Sink, run_forward
from deployments.model_rank.models import CausalLM
from deployments.model_rank.mtp_drafts import MtpDrafter
from deployments.model_rank.step_rows import StepRows


class Warmed(Protocol):
    """What the warm-up runs: a runner's model, its batch builder, sink and drafter (runner.py)."""

    model: CausalLM
    batches: DeviceBatches
    sink: Sink
    block_size: int
    drafter: MtpDrafter | None
    state_pools: list[tuple[torch.Tensor, torch.Tensor]]


# Query lengths of one sequence each (rows up to 16 tokens, the prefill kernel past them), and a decode row
# beside a prefill chunk: token counts in every specialisation class.
WARM_STEPS: tuple[tuple[int, ...], ...] = ((2,), (3,), (8,), (16,), (17,), (32,), (33,), (1, 17), (4, 4, 4))


def sink_rows(query_lens: tuple[int, ...], sink: Sink, block_size: int) -> StepRows:
    """A step of fresh sequences whose every row writes and reads the sink (tables of the sink repeated)."""
    rows = StepRows([], [], [], [], [], [], [])
    for count in query_lens:
        first = len(rows.input_ids)
        rows.input_ids.extend([0] * count)
        rows.positions.extend(range(count))
        rows.slots.extend(sink.block * block_size + position % block_size for position in range(count))
        rows.logits_rows.append(first + count - 1)
        rows.query_lens.append(count)
        rows.context_lens.append(count)
        rows.block_tables.append([sink.block] * -(-count // block_size))
        if sink.slot >= 0:
            rows.state_slots.append(sink.slot)
            rows.state_captures.append([])
    return rows


@torch.inference_mode()
def warm_kernels(runner: Warmed, lanes: int) -> None:
    """Run every warm-up shape once (the trunk, its logits, and the MTP layer where it drafts)."""
    shapes = [*(tuple([1] * size) for size in buckets_for(lanes)), *WARM_STEPS]
    for query_lens in shapes:
        rows = sink_rows(query_lens, runner.sink, runner.block_size)
        batch = runner.batches.build(rows)
        hidden = run_forward(runner.model.forward, batch)
        runner.model.compute_logits(hidden[batch.logits_indices])
        if runner.drafter is not None:
            ops = runner.drafter.ops
            residual = ops.residual(hidden, ops.ids(rows.input_ids), ops.batch(rows))
            ops.greedy(residual)
    for pool in runner.state_pools:
        for tensor in pool:
            tensor[runner.sink.slot].zero_()

"""Token embedding and lm_head, replicated on every rank (vocab-parallel would add a gather per step)."""

import torch
import torch.nn.functional as F
from torch import nn

from deployments.model_rank.layers.linear import invariant_linear
from deployments.model_rank.layers.parallel import default_loader
from deployments.model_rank.layers.quantized import compute_dtype, qtype_of
from kernels import cpu_gemm, quant_gemm


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)
        self.weight.weight_loader = default_loader

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        qtype = qtype_of(self.weight)
        if qtype is not None:  # a GGUF table kept as blocks: its rows dequantized as gguf-py does
            return quant_gemm.rows(self.weight, qtype, input_ids).to(compute_dtype(self.weight))  # [T, H]
        if cpu_gemm.is_packed(self.weight):  # tied to a packed lm_head: read rows out of the pack
            return cpu_gemm.rows(self.weight, input_ids)  # [T, H]
        return F.embedding(input_ids, self.weight)  # [T, H]


class LMHead(nn.Module):
    """Projects final hidden states to vocabulary logits; `tied_to` shares the embedding's weight."""

    def __init__(self, vocab_size: int, hidden_size: int, tied_to: VocabEmbedding | None = None) -> None:
        super().__init__()
        self.tied = tied_to is not None
        if tied_to is not None:
            self.weight = tied_to.weight
        else:
            self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)
            self.weight.weight_loader = default_loader

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return invariant_linear(hidden, self.weight).float()  # [R, V] float32

"""A tiny causal transformer over bytes: small enough to train a few hundred steps on 2 CPU cores in seconds."""

from __future__ import annotations

import torch
from torch import nn

VOCAB = 256
HEADS = 4  # attention heads: the model width must be a multiple of it


class TinyCausalLM(nn.Module):
    """Token + position embeddings, `layers` pre-norm transformer blocks with a causal mask, a byte head."""

    def __init__(self, context: int, d_model: int, layers: int, heads: int = HEADS, dropout: float = 0.1) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d_model)
        self.position = nn.Parameter(torch.zeros(context, d_model))
        block = nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, dropout, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, VOCAB)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(context), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits of the next byte at every position of `tokens` (batch, time)."""
        n = tokens.shape[1]
        h = self.embed(tokens) + self.position[:n]
        h = self.blocks(h, mask=self.mask[:n, :n], is_causal=True)
        return self.head(self.norm(h))

"""A small GPT-2-style decoder (nanoGPT-like), the default paft workload.

Character-level Tiny Shakespeare, ~0.8M parameters by default, so that 4 CPU worker
processes sharing 2 cores make the validation loss fall clearly within minutes:

    paft train --workload gpt --world-size 4
    torchrun --nproc-per-node 2 -m paft.train --workload gpt

Architecture: learned token + position embeddings; ``n_layer`` pre-LayerNorm blocks
(``x + attn(ln(x))``, ``x + mlp(ln(x))``); causal self-attention through
``F.scaled_dot_product_attention(is_causal=True)``; a 4x GELU MLP; a final LayerNorm
and an ``lm_head`` whose weight *is* the token embedding (weight tying). Weights are
initialized normal(0, 0.02), biases zero, and the two residual output projections of
each block get std ``0.02 / sqrt(2 * n_layer)`` (GPT-2) so the residual stream's
variance does not grow with depth.

Note on tying: ``parameters()`` yields the shared tensor once, but ``state_dict()``
lists it under both ``tok_emb.weight`` and ``lm_head.weight``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from paft.values import require_positive_ints

__all__ = ["GPTConfig", "GPT"]


@dataclass
class GPTConfig:
    """Size and regularization of :class:`GPT`."""

    vocab_size: int = 65
    """Number of token ids; must cover the dataset's vocabulary (65 for Tiny Shakespeare)."""
    block_size: int = 64
    """Maximum sequence length (size of the position-embedding table)."""
    n_layer: int = 4
    """Number of transformer blocks."""
    n_head: int = 4
    """Attention heads per block; must divide ``n_embd``."""
    n_embd: int = 128
    """Width of the residual stream."""
    dropout: float = 0.0
    """Dropout on embeddings, attention probabilities and residual branches; 0 disables it."""
    bias: bool = True
    """Biases in the Linear layers and LayerNorms (GPT-2 has them)."""

    def __post_init__(self) -> None:
        require_positive_ints(self, ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"))
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout!r}")

    @property
    def parameter_count(self) -> int:
        """``sum(p.numel() for p in GPT(self).parameters())``, without building it (a
        size far beyond memory is refused at once). Per block: the four matrices
        (qkv 3C^2, proj C^2, fc 4C^2, proj 4C^2) and two LayerNorm weights, with biases
        11C more (qkv 3C, proj C, fc 4C, proj C, two LayerNorms 2C); the head is the
        token embedding (tied), counted once."""
        c, bias = self.n_embd, int(self.bias)
        block = 12 * c * c + 2 * c + 11 * c * bias
        return (self.vocab_size + self.block_size) * c + self.n_layer * block + c * (1 + bias)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        # (B, T, C) -> (B, n_head, T, head_dim)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """``forward(idx: (B, T) int64) -> logits (B, T, vocab_size)``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        blocks = [Block(cfg) for _ in range(cfg.n_layer)]  # typed: the init below reaches into them
        self.blocks = nn.ModuleList(blocks)
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.tok_emb.weight  # weight tying
        self.apply(self._init_weights)
        resid_std = 0.02 / math.sqrt(2 * cfg.n_layer)
        for block in blocks:
            nn.init.normal_(block.attn.proj.weight, mean=0.0, std=resid_std)
            nn.init.normal_(block.mlp.proj.weight, mean=0.0, std=resid_std)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        if T > self.cfg.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.cfg.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))

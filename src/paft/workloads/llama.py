"""A small LLaMA-2-style decoder: a second, architecturally different language model.

Same data and size class as :mod:`paft.workloads.gpt` (Tiny Shakespeare characters,
~0.8M parameters by default), so the two can be swapped in any experiment:

    paft train --workload llama --world-size 4
    torchrun --nproc-per-node 2 -m paft.train --workload llama

What differs from GPT-2: RMSNorm instead of LayerNorm; rotary position embeddings
(RoPE) on queries and keys instead of a learned position table; a SwiGLU MLP
(``w2(silu(w1 x) * w3 x)``) whose hidden width is ``int(8/3 * n_embd)`` rounded up to a
multiple of ``multiple_of``; no biases anywhere; an untied output head.

RoPE's cos/sin tables are computed once on the CPU and kept per device in a plain
attribute, not as buffers: DDP broadcasts buffers before every forward
(``broadcast_buffers``), so a table corrupted on rank 0 would become every rank's,
unseen (the state fingerprints leave buffers out: under DDP they may legitimately differ).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from paft.values import require_positive_ints

__all__ = ["LlamaConfig", "Llama", "RMSNorm"]


@dataclass
class LlamaConfig:
    """Size and regularization of :class:`Llama`."""

    vocab_size: int = 65
    """Number of token ids; must cover the dataset's vocabulary (65 for Tiny Shakespeare)."""
    block_size: int = 64
    """Maximum sequence length (length of the precomputed RoPE tables)."""
    n_layer: int = 4
    """Number of transformer blocks."""
    n_head: int = 4
    """Attention heads per block; must divide ``n_embd`` into an even head size (RoPE)."""
    n_embd: int = 128
    """Width of the residual stream."""
    multiple_of: int = 32
    """The SwiGLU hidden width is rounded up to a multiple of this."""
    norm_eps: float = 1e-5
    """Epsilon inside RMSNorm, in (0, 1)."""
    rope_theta: float = 10000.0
    """Base of the rotary embedding frequencies."""
    dropout: float = 0.0
    """Dropout on the token embeddings, attention probabilities and residual branches;
    0 disables it."""

    def __post_init__(self) -> None:
        require_positive_ints(self, ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "multiple_of"))
        if self.n_embd % self.n_head != 0 or (self.n_embd // self.n_head) % 2 != 0:
            raise ValueError(
                f"n_head ({self.n_head}) must divide n_embd ({self.n_embd}) into an even head size"
            )
        # Both are used in float32: 1e-50 is 0 there (RMSNorm divides by zero; RoPE's
        # frequencies are infinite, and every output NaN from step 0). An epsilon of 1 or
        # more outweighs the activations' mean square (about 4e-4 at initialization): the
        # norm scales them down by its square root instead of normalizing, and at 1e20
        # and beyond whole gradients are 0 in float32 (1e30: 24 of 39 tensors trained nothing).
        if not (0 < self.norm_eps < 1 and _float32(self.norm_eps) > 0):
            raise ValueError(f"norm_eps must be in (0, 1) and not 0 in float32 (RMSNorm's epsilon: at 1 and "
                             f"beyond it scales the activations down instead of normalizing them), "
                             f"got {self.norm_eps!r}")
        if not (self.rope_theta > 0 and self._rope_angles_finite()):
            raise ValueError(f"rope_theta must be > 0, finite in float32, and keep the RoPE angles finite up to "
                             f"block_size {self.block_size}, got {self.rope_theta!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout!r}")

    def _rope_angles_finite(self) -> bool:
        """Whether :func:`rope_tables`' angles are finite, from the fastest frequency alone
        (1 at theta >= 1; 1 / theta ** ((d - 2) / d) below) at the last position."""
        theta = _float32(self.rope_theta)
        if not 0 < theta < math.inf:
            return False
        d = self.n_embd // self.n_head
        fastest = max(1.0, _float32(1.0 / theta ** ((d - 2) / d)))
        return _float32(fastest * (self.block_size - 1)) < math.inf

    @property
    def ffn_hidden(self) -> int:
        """SwiGLU hidden width: 2/3 of the usual 4x (same parameter count), truncated, then
        rounded up to a multiple of ``multiple_of``."""
        hidden = 2 * 4 * self.n_embd // 3  # integers: a --model n_embd of hundreds of digits overflows a float
        return self.multiple_of * -(-hidden // self.multiple_of)

    @property
    def parameter_count(self) -> int:
        """``sum(p.numel() for p in Llama(self).parameters())``, without building it (a
        size far beyond memory is refused at once): per block the four attention
        matrices, the three SwiGLU ones and two RMSNorm weights; the untied embedding
        and head, and the final RMSNorm. (The RoPE tables are buffers.)"""
        c = self.n_embd
        block = 4 * c * c + 3 * c * self.ffn_hidden + 2 * c
        return 2 * self.vocab_size * c + self.n_layer * block + c


class RMSNorm(nn.Module):
    """``x / rms(x) * weight`` (no mean subtraction, no bias), normalized in at least
    float32 and cast back before the weight, as LLaMA's ``_norm(x.float()).type_as(x)``:
    in float16 an activation of 256 or more squares to inf, and the whole row came out 0."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = x.to(torch.promote_types(x.dtype, torch.float32))  # float32 and float64 unchanged
        return (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def _float32(x: float) -> float:
    """``x`` as float32 holds it (0 below its range, inf above)."""
    try:
        return float(torch.tensor(x, dtype=torch.float32))
    except OverflowError:  # an int beyond float64
        return math.inf


def rope_tables(head_dim: int, length: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape ``(length, head_dim)`` for the rotate-half RoPE form."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(length, dtype=torch.float32), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)  # pair dim i with dim i + head_dim/2
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each (x[i], x[i + d/2]) pair of ``x: (B, H, T, d)`` by its position's angle,
    in the float32 tables' precision, back in ``x``'s dtype (LLaMA's ``type_as``): in a
    bfloat16 or float16 model the rotated queries and keys then stay of the values' dtype,
    as attention needs (a float32 model's bits are unchanged)."""
    x1, x2 = x.chunk(2, dim=-1)
    return (x * cos + torch.cat((-x2, x1), dim=-1) * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.wq = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.wk = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.wv = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.wo = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = (w(x).view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        return self.resid_drop(self.wo(y.transpose(1, 2).contiguous().view(B, T, C)))


class SwiGLU(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.n_embd, cfg.ffn_hidden, bias=False)  # gate
        self.w3 = nn.Linear(cfg.n_embd, cfg.ffn_hidden, bias=False)  # up
        self.w2 = nn.Linear(cfg.ffn_hidden, cfg.n_embd, bias=False)  # down
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.w2(F.silu(self.w1(x)) * self.w3(x)))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    """``forward(idx: (B, T) int64) -> logits (B, T, vocab_size)``."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        blocks = [Block(cfg) for _ in range(cfg.n_layer)]  # typed: the init below reaches into them
        self.blocks = nn.ModuleList(blocks)
        self.norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)  # untied
        # device -> (cos, sin) for block_size positions: derived from the config, so no
        # state (not in state_dict(), not a buffer DDP broadcasts); computed on the CPU and
        # copied, the same bits on every device.
        self._rope: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        # Same scheme as GPT-2: N(0, 0.02), residual output projections scaled by depth.
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
        resid_std = 0.02 / math.sqrt(2 * cfg.n_layer)
        for block in blocks:
            nn.init.normal_(block.attn.wo.weight, mean=0.0, std=resid_std)
            nn.init.normal_(block.mlp.w2.weight, mean=0.0, std=resid_std)

    def _rope_tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        tables = self._rope.get(device)
        if tables is None:
            cfg = self.cfg
            cos, sin = rope_tables(cfg.n_embd // cfg.n_head, cfg.block_size, cfg.rope_theta)
            tables = self._rope[device] = (cos.to(device), sin.to(device))
        return tables

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        if T > self.cfg.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.cfg.block_size}")
        cos, sin = self._rope_tables(idx.device)
        cos, sin = cos[:T], sin[:T]
        x = self.drop(self.tok_emb(idx))
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.lm_head(self.norm(x))

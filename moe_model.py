"""A toy decoder-only Mixture-of-Experts transformer, in plain PyTorch.

Small enough to train on a laptop CPU, but with the parts that matter for RL on MoE models:
a router that picks top-k experts per token, gate weights renormalised over the chosen experts,
a load-balancing auxiliary loss, and the hooks Routing Replay needs: every forward pass returns the
experts the router chose in every layer, and can be given recorded experts to use instead.

    model = MoETransformer(MoEConfig(vocab_size=16))
    logits, routing, aux_loss = model(tokens)                 # routing: [n_layers, B, S, top_k]
    logits, _, _ = model(tokens, routing=routing)             # replay those experts
    hidden, routing, aux_loss = model.trunk(tokens)           # the same without the vocabulary head
    save(model, "folder"); model = load("folder")             # config.json and model.safetensors

n_experts=1 gives the dense equivalent (one SwiGLU feed-forward per layer).
"""
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch.utils.checkpoint import checkpoint


@dataclass
class MoEConfig:
    vocab_size: int
    max_seq_len: int = 64
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_experts: int = 8
    top_k: int = 2
    expert_hidden: int = 128
    rope_base: float = 10000.0


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate(x, cos, sin):
    """Rotary position embedding: rotate channel pairs (first half, second half) by position angles."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.out = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x, cos, sin, cache, layer):
        B, S, D = x.shape
        q, k, v = self.qkv(x).view(B, S, 3, self.n_heads, D // self.n_heads).permute(2, 0, 3, 1, 4)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        if cache is not None:  # KV cache: keys and values of earlier positions are reused, not recomputed
            if cache[layer] is not None:
                k = torch.cat([cache[layer][0], k], dim=2)
                v = torch.cat([cache[layer][1], v], dim=2)
            cache[layer] = (k, v)
        # Causal mask for a whole sequence; a single new token may attend to everything cached.
        y = F.scaled_dot_product_attention(q, k, v, is_causal=S > 1)
        return self.out(y.transpose(1, 2).reshape(B, S, D))


class MoE(nn.Module):
    """Linear router -> softmax -> top-k experts; gates renormalised over the chosen k; SwiGLU experts."""

    def __init__(self, cfg):
        super().__init__()
        self.n_experts, self.top_k = cfg.n_experts, min(cfg.top_k, cfg.n_experts)
        self.router = nn.Linear(cfg.d_model, cfg.n_experts, bias=False)
        h, d, E = cfg.expert_hidden, cfg.d_model, cfg.n_experts
        self.w_gate = nn.Parameter(torch.randn(E, d, h) * d**-0.5)
        self.w_up = nn.Parameter(torch.randn(E, d, h) * d**-0.5)
        self.w_down = nn.Parameter(torch.randn(E, h, d) * h**-0.5)

    def forward(self, x, replay=None):
        """x [N, d]; replay [N, k] expert indices to use instead of the router's choice.
        Returns the output [N, d], the router's own top-k choice [N, k] and the load-balancing loss."""
        probs = F.softmax(self.router(x).float(), dim=-1)              # [N, E]
        chosen = probs.topk(self.top_k, dim=-1).indices                # [N, k], what the router picks now
        experts = chosen if replay is None else replay
        # Gates from the *current* router over the experts used, so under replay the router still learns.
        gates = probs.gather(1, experts)
        gates = (gates / gates.sum(-1, keepdim=True)).to(x.dtype)      # [N, k]

        # Run each expert only on its own tokens, then scatter back (much faster than running every
        # expert on every token and masking). One sort and one host sync for the whole layer.
        flat_expert = experts.flatten()                                # [N*k]
        order = flat_expert.argsort()
        token = order // self.top_k                                    # token of each (token, slot) pair
        counts = torch.bincount(flat_expert, minlength=self.n_experts).tolist()
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            idx, tok = order[start:start + n], token[start:start + n]
            xe = x[tok]
            ye = (F.silu(xe @ self.w_gate[e]) * (xe @ self.w_up[e])) @ self.w_down[e]
            out.index_add_(0, tok, ye * gates.flatten()[idx, None])
            start += n

        # Switch-Transformer load-balancing loss: E * sum_e (share of slots sent to e) * (mean prob of e).
        share = torch.bincount(chosen.flatten(), minlength=self.n_experts).to(probs.dtype) / chosen.numel()
        aux_loss = self.n_experts * (share * probs.mean(0)).sum()
        return out, chosen, aux_loss


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.norm1, self.attn = RMSNorm(cfg.d_model), Attention(cfg)
        self.norm2, self.moe = RMSNorm(cfg.d_model), MoE(cfg)

    def forward(self, x, cos, sin, cache, layer, replay):
        x = x + self.attn(self.norm1(x), cos, sin, cache, layer)
        B, S, D = x.shape
        y, chosen, aux_loss = self.moe(self.norm2(x).reshape(B * S, D), replay)
        return x + y.view(B, S, D), chosen.view(B, S, -1), aux_loss


class MoETransformer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.gradient_checkpointing = False  # True: in training mode, blocks are recomputed in the backward
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        nn.init.normal_(self.embed.weight, std=0.02)
        for name, p in self.named_parameters():
            if name.endswith(("qkv.weight", "out.weight", "router.weight", "head.weight")):
                nn.init.normal_(p, std=0.02)
        half = cfg.d_model // cfg.n_heads // 2
        self.register_buffer("inv_freq", cfg.rope_base ** (-torch.arange(half) / half), persistent=False)

    def forward(self, tokens, cache=None, routing=None):
        """tokens [B, S]. cache: a list with one entry per layer (start with [None] * n_layers); it is
        filled in place and new tokens are placed after what it holds. routing [n_layers, B, S, k]:
        experts to replay. Returns logits [B, S, V], the router's choice [n_layers, B, S, k] and the
        mean load-balancing loss over layers."""
        hidden, chosen, aux_loss = self.trunk(tokens, cache, routing)
        return self.head(hidden), chosen, aux_loss

    def trunk(self, tokens, cache=None, routing=None):
        """Everything but the vocabulary head: the final normalised hidden states [B, S, d_model]."""
        B, S = tokens.shape
        start = 0 if cache is None or cache[0] is None else cache[0][0].shape[2]
        if start > 0 and S > 1:  # SDPA's causal mask would be aligned to the wrong corner
            raise ValueError("with a filled KV cache, feed one token at a time")
        if start + S > self.cfg.max_seq_len:
            raise ValueError(f"sequence of {start + S} tokens is longer than max_seq_len {self.cfg.max_seq_len}")
        angles = torch.arange(start, start + S, device=tokens.device)[:, None] * self.inv_freq  # [S, half]
        cos, sin = angles.cos().to(self.embed.weight.dtype), angles.sin().to(self.embed.weight.dtype)
        x = self.embed(tokens)
        chosen, aux = [], []
        recompute = self.gradient_checkpointing and self.training and torch.is_grad_enabled() and cache is None
        for i, block in enumerate(self.blocks):
            replay = None if routing is None else routing[i].reshape(B * S, -1)
            if recompute:  # keep only the block's input; the backward runs the block again
                x, c, a = checkpoint(block, x, cos, sin, cache, i, replay, use_reentrant=False)
            else:
                x, c, a = block(x, cos, sin, cache, i, replay)
            chosen.append(c)
            aux.append(a)
        return self.norm(x), torch.stack(chosen), torch.stack(aux).mean()


def save(model, folder):
    """The model as a folder: its MoEConfig in config.json, its weights in model.safetensors (data only,
    never code, as in Hugging Face's folders)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(dataclasses.asdict(model.cfg), indent=2) + "\n")
    save_file(model.state_dict(), folder / "model.safetensors")


def load(folder):
    """The model save(model, folder) wrote, on the CPU in eval mode (runs write theirs to DIR/model)."""
    folder = Path(folder)
    model = MoETransformer(MoEConfig(**json.loads((folder / "config.json").read_text())))
    model.load_state_dict(load_file(folder / "model.safetensors"))
    return model.eval()

"""The seed document's design in PyTorch, shaped like an mtp_jax config: the peer that
`experiments/bench_train.py --peer` times against the JAX train step.

Trunk: transformers' LlamaModel (pre-norm blocks, RoPE, grouped-query attention, SwiGLU) with
the config's sizes, its final norm moved after the heads. Heads: seed 000's ParallelMTPModule:
head 1 is the trunk itself, heads 2..n are RMSNorm -> Linear(d, 2d) -> SiLU -> Linear(2d, d)
plus a residual; every head goes through the one final norm and one shared unembedding (tied
to the embedding, as mtp_jax ties it). Loss: the seed's `compute_mtp_loss` (logits of all heads
stacked, per-head cross-entropy on the shifted targets, summed with weights). Optimiser: AdamW
with mtp_jax's hyper-parameters, global-norm clipping and decay on matrices only. This is the
JAX `projection` head kind (configs/projection.py), so the two frameworks run the same model.
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaModel


class SeedMTP(nn.Module):
  """Llama trunk + seed 000's projection heads sharing one unembedding."""

  def __init__(self, m):
    super().__init__()
    self.n_future = m.n_future
    cfg = LlamaConfig(
        vocab_size=m.vocab_size, hidden_size=m.d_model, intermediate_size=m.d_ff,
        num_hidden_layers=m.n_layers, num_attention_heads=m.n_heads,
        num_key_value_heads=m.n_kv_heads, max_position_embeddings=m.max_len,
        rms_norm_eps=m.norm_eps, rope_theta=m.rope_theta, tie_word_embeddings=True,
        attention_bias=False, mlp_bias=False)
    cfg._attn_implementation = "sdpa"  # torch's fused CPU attention
    self.trunk = LlamaModel(cfg)
    self.norm = self.trunk.norm  # shared by every head, applied after the projections
    self.trunk.norm = nn.Identity()
    d = m.d_model
    self.mtp_projections = nn.ModuleList([
        nn.Sequential(nn.RMSNorm(d, eps=m.norm_eps), nn.Linear(d, 2 * d, bias=False), nn.SiLU(),
                      nn.Linear(2 * d, d, bias=False))
        for _ in range(m.n_future - 1)])

  def forward(self, tokens_BxS):
    z_BxSxD = self.trunk(input_ids=tokens_BxS).last_hidden_state
    unembed_VxD = self.trunk.embed_tokens.weight
    logits = [F.linear(self.norm(z_BxSxD), unembed_VxD)]
    for proj in self.mtp_projections:
      logits.append(F.linear(self.norm(proj(z_BxSxD) + z_BxSxD), unembed_VxD))
    return torch.stack(logits, dim=1)  # [B, n, S, V], as the seed returns it


def compute_mtp_loss(logits_BxNxSxV, targets_BxS, loss_weights):
  """The seed's loss: head k at t against x_{t+k+1}, the last k+1 positions dropped."""
  _, n, _, V = logits_BxNxSxV.shape
  total = 0.0
  for k in range(n):
    shift = k + 1
    valid = logits_BxNxSxV[:, k, :-shift, :].reshape(-1, V)
    total = total + loss_weights[k] * F.cross_entropy(valid, targets_BxS[:, shift:].reshape(-1))
  return total


def make_peer(config, seed: int = 0):
  """(step, tokens): `step()` runs one AdamW train step on a fixed random batch, returns loss."""
  torch.manual_seed(seed)
  torch.set_num_threads(os.cpu_count() or 1)
  m, o = config.model, config.optim
  model = SeedMTP(m)
  decay = [p for name, p in model.named_parameters() if p.ndim == 2 and "embed" not in name]
  rest = [p for name, p in model.named_parameters() if not (p.ndim == 2 and "embed" not in name)]
  opt = torch.optim.AdamW([{"params": decay, "weight_decay": o.weight_decay},
                           {"params": rest, "weight_decay": 0.0}],
                          lr=o.lr, betas=(o.b1, o.b2), eps=o.eps)
  g = torch.Generator().manual_seed(seed)
  tokens = torch.randint(0, 256, (config.train.batch_size, config.data.seq_len), generator=g)
  weights = [1.0] * m.n_future

  def step():
    opt.zero_grad(set_to_none=True)
    loss = compute_mtp_loss(model(tokens), tokens, weights)
    loss.backward()
    if o.grad_clip > 0:
      torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
    opt.step()
    return float(loss.detach())

  n_params = sum(p.numel() for p in model.parameters())
  return step, tokens.numel(), n_params

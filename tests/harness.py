"""Shared test machinery: small models, random batches, and the torch AdamW reference fed our gradients."""

from __future__ import annotations

import torch
from torch import nn

from deep_optimizer_states import DeepOptimizerStates

SCHEDULES = ["cpu", "gpu", 1, 2, 3, 7, "auto"]


def tiny_llama(dtype=torch.float32, device="cpu", tie: bool = False, seed: int = 0) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, max_position_embeddings=64,
                      tie_word_embeddings=tie)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).to(device=device, dtype=dtype)


def mlp(dtype=torch.float32, device="cpu", seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 96), nn.GELU(), nn.LayerNorm(96), nn.Linear(96, 96), nn.GELU(),
                         nn.Linear(96, 8)).to(device=device, dtype=dtype)


def loss_of(model: nn.Module, gen: torch.Generator) -> torch.Tensor:
    """A fresh random batch (from ``gen``) and the model's loss on it."""
    device = next(model.parameters()).device
    if isinstance(model, nn.Sequential):
        x = torch.randn(16, 32, generator=gen).to(device=device, dtype=next(model.parameters()).dtype)
        y = torch.randn(16, 8, generator=gen).to(device)
        return (model(x).float() - y).pow(2).mean()
    ids = torch.randint(0, 128, (2, 16), generator=gen).to(device)
    return model(input_ids=ids, labels=ids).loss


class Reference:
    """torch.optim.AdamW (fused) on fp32 master copies, with the same param groups, fed our gradients."""

    def __init__(self, opt: DeepOptimizerStates, cls=torch.optim.AdamW, scheduler=None) -> None:
        self.ours = opt
        self.masters = {}
        groups = []
        for g in opt.param_groups:
            ms = []
            for p in g["params"]:
                m = opt.state[p]["master"].detach().clone().to(p.device).requires_grad_(True)
                self.masters[p] = m
                ms.append(m)
            groups.append({**{k: v for k, v in g.items() if k not in ("params", "initial_lr")}, "params": ms})
        self.opt = cls(groups, fused=True)
        self.scheduler = scheduler(self.opt) if scheduler else None

    def step(self, max_norm: float | None = None, unscale: float = 1.0) -> torch.Tensor | None:
        """Take our current gradients (as fp32, unscaled), optionally clip, and step. Returns the norm."""
        for p, m in self.masters.items():
            m.grad = p.grad.detach().to(torch.float32, copy=True).to(m.device) * unscale
        norm = torch.nn.utils.clip_grad_norm_(list(self.masters.values()), max_norm) if max_norm else None
        self.opt.step()
        if self.scheduler:
            self.scheduler.step()
        return norm

    def assert_matches(self, rtol: float = 1e-6) -> None:
        """Our fp32 masters equal the reference within ``rtol`` (relative L2), params are masters rounded."""
        for p, ref in self.masters.items():
            master = self.ours.state[p]["master"]
            ref_host = ref.detach().to(master.device)
            err = ((master - ref_host).norm() / ref_host.norm().clamp_min(1e-30)).item()
            assert err < rtol, f"param {tuple(p.shape)}: relative error {err:.3e} >= {rtol}"
            assert torch.equal(p.detach().cpu(), master.to(p.dtype).cpu()), "param is not its master rounded"


def train_and_compare(model: nn.Module, opt: DeepOptimizerStates, steps: int = 30, seed: int = 1,
                      micro_batches: int = 1, max_norm: float | None = None, scheduler=None,
                      ref_cls=torch.optim.AdamW, rtol: float = 1e-6) -> Reference:
    """Train ``steps`` steps with ours and the reference in lockstep, checking after every step."""
    ref = Reference(opt, ref_cls, scheduler)
    ours_sched = scheduler(opt) if scheduler else None
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        for _ in range(micro_batches):
            (loss_of(model, gen) / micro_batches).backward()
        ref_norm = ref.step(max_norm)
        if max_norm:
            ours_norm = opt.clip_grad_norm_(max_norm)
            torch.testing.assert_close(ours_norm.cpu(), ref_norm.cpu(), rtol=1e-6, atol=0)
        opt.step()
        if ours_sched:
            ours_sched.step()
        ref.assert_matches(rtol)
    return ref

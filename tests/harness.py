"""Shared test machinery: small models, random batches, and lockstep training against the reference."""

from __future__ import annotations

import shutil

import pytest

import torch
from torch import nn

from deep_optimizer_states import DeepOptimizerStates
from deep_optimizer_states.reference import ReferenceAdamW

# the bf16 CPU path's kernel is built at first use (core/cpu_adamw.py)
needs_compiler = pytest.mark.skipif(shutil.which("c++") is None or shutil.which("ninja") is None,
                                    reason="the bf16 kernel is built with a C++ compiler and ninja")

SCHEDULES = ["cpu", "gpu", 1, 2, 3, 7, "auto"]


def total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of ``grads`` as one vector, as torch's clip_grad_norm_ measures it: get_total_norm (torch >=
    2.6), or on torch 2.5 the same steps inside clip_grad_norm_ (per device and dtype, one foreach norm each)."""
    if hasattr(torch.nn.utils, "get_total_norm"):
        return torch.nn.utils.get_total_norm(grads)
    from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype

    if not grads:
        return torch.tensor(0.0)
    groups = _group_tensors_by_device_and_dtype([list(grads)])
    norms = [n for [group], _ in groups.values() for n in torch._foreach_norm(group, 2.0)]
    return torch.linalg.vector_norm(torch.stack([n.to(grads[0].device) for n in norms]), 2.0)


def skip_unless_trainer_resumes() -> None:
    """Skip where the Hugging Face Trainer cannot resume any checkpoint: transformers >= 4.50 refuses torch.load
    (the RNG states, optimizer.pt) on torch < 2.6 (CVE-2025-32434), whatever the optimizer."""
    from transformers.utils import import_utils

    check = getattr(import_utils, "check_torch_load_is_safe", None)
    try:
        if check is not None:
            check()
    except ValueError as e:
        pytest.skip(f"transformers refuses to resume on this torch: {str(e).splitlines()[0]}")


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


def steps_beside(model: nn.Module, opt: DeepOptimizerStates, ref: ReferenceAdamW, gen: torch.Generator,
                 steps: int) -> None:
    """``steps`` steps of ours and of the reference (fed the same gradients) on fresh batches from ``gen``."""
    for _ in range(steps):
        opt.zero_grad()
        loss_of(model, gen).backward()
        ref.step()
        opt.step()


def train_and_compare(model: nn.Module, opt: DeepOptimizerStates, steps: int = 30, seed: int = 1,
                      micro_batches: int = 1, max_norm: float | None = None, scheduler=None,
                      ref_cls=None, rtol: float = 1e-6) -> ReferenceAdamW:
    """Train ``steps`` steps with ours and the reference in lockstep, checking after every step."""
    ref = ReferenceAdamW(opt, ref_cls, scheduler)
    ours_sched = scheduler(opt) if scheduler else None
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        for _ in range(micro_batches):
            (loss_of(model, gen) / micro_batches).backward()
        ref_norm = ref.step(max_norm or opt.max_grad_norm)
        if max_norm:  # clip through the method; else through the constructor's max_grad_norm, if any
            torch.testing.assert_close(opt.clip_grad_norm_(max_norm).cpu(), ref_norm.cpu(), rtol=1e-6, atol=0)
        opt.step()
        if ref_norm is not None:
            torch.testing.assert_close(opt.last_grad_norm.cpu(), ref_norm.cpu(), rtol=1e-6, atol=0)
        if ours_sched:
            ours_sched.step()
        ref.assert_matches(rtol)
    return ref


class TokenData(torch.utils.data.Dataset):
    """A small in-memory dataset of random token ids (vocab 128) with labels, for the Trainer tests."""

    def __init__(self, n: int = 24, seq: int = 16, seed: int = 11) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, 128, (n, seq), generator=gen)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of every named param, to compare runs."""
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_same_params(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], exact: bool = True,
                       rtol: float = 1e-6) -> None:
    """Same names, and equal values: bit for bit, or within ``rtol`` when not ``exact``."""
    assert a.keys() == b.keys()
    for n in a:
        if exact:
            assert torch.equal(a[n], b[n]), f"{n}: max diff {(a[n] - b[n]).abs().max().item():.3e}"
        else:
            torch.testing.assert_close(a[n], b[n], rtol=rtol, atol=rtol * 1e-2, msg=lambda m: f"{n}: {m}")


def without_stand_down(monkeypatch) -> None:
    """Updates run ahead (``speculate``) never stand down (``optimizer.STAND_DOWN`` off), so a step that clips
    undoes them: the path taken where the norm passes the clip only after they started."""
    from deep_optimizer_states import optimizer as optimizer_module

    monkeypatch.setattr(optimizer_module, "STAND_DOWN", False)

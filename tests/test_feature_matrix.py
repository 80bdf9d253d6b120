"""Random combinations of the optimizer's features, with random user actions between steps (a seeded fuzzer).

Each example draws a model (tiny Llama fp32 or bf16, tied or not, activation checkpointing or not, or the MLP in
fp32, bf16 or fp16 with loss scaling; one param group or two; sometimes a param frozen before the optimizer is
built), AdamW or Adam, a tiny ``subgroup_size`` (subgroups straddle params), a schedule ("cpu", "gpu", 2, 3,
"auto", "offload" or a random placement per subgroup set after construction) and a random valid combination of
``stream_grads``, ``overlap``, ``prefetch`` (True / "release"), ``speculate`` (True or a count),
``max_grad_norm`` (None, small so that it clips, large so that it never does), ``nonfinite`` and, with a C++
compiler and bf16 params, ``bf16_cpu_path``; and the run-ahead's module flags ``optimizer.STAND_DOWN`` (True,
"forecast", False) and ``SIT_OUT_AFTER_CLIP``. It then trains 4-8 steps, and between them and between backward
and step does what users do: accumulation over 2-3 micro-batches (their losses may differ), every kind of
zero_grad (or none), params that get no gradient (a loss on an early layer's output, ``inputs_embeds`` instead
of the embedding, a param frozen for a step, ``p.grad = None``), a NaN or an inf in the loss, in one param's
gradient or written into a gradient, a new lr / weight decay / betas / eps, ``opt.clip_grad_norm_``,
state_dict() taken and loaded back (the current one or an earlier one), weights edited in place, through
``.data``, loaded into the model (other weights, or the same), writes into ``opt.state`` (moments, master,
step count), a new schedule, ``opt.synchronize()``, ``release_gpu_memory()``, reads of ``opt.state`` /
``opt.master``, evaluation forwards under no_grad (a larger batch too), a second step on the same gradients, a
step without gradients, gradients dropped after backward (and computed again).

The twin is the same model trained by the same optimizer class with none of those features (synchronous,
gathered gradients, ``schedule="cpu"``, sometimes one subgroup per group): the path the other tests hold to
torch's AdamW. The same actions are applied to both, and every observation is compared bit for bit (NaN equal
to NaN): the loss of every forward (training and evaluation), the params, masters, exp_avg, exp_avg_sq and
step counts where the plan snapshots them and at the end, every state_dict taken, every gradient norm, the
skipped steps. For fp32 models a third twin trains with torch's own fused AdamW (``TorchTwin``: the same
actions, ours' documented semantics where torch has none: skipped inf/nan steps, clipping at the step) and is
held bit for bit to the plain twin. The run with features goes first, to its end, and in part of the
examples every AdamW call of its engine sleeps (``slow_adam``), so that with ``overlap`` its next forward
meets the update still running (real races, on the update's own thread).

Default: a fixed list of seeds (a CI-sized run), with the seeds whose examples met the bugs this test found
in its first long hunt (forty-eighth session; each fixed, with a test of its own: a zero gradient for the
params whose gradients left under ``stream_grads`` at ``opt.zero_grad(set_to_none=False)``, gradients changed
after ``opt.clip_grad_norm_`` measured again, ``opt.state`` reads taking a weight edit, a master taken from the
param superseding an earlier load's recheck mark, and a clear error for a
param read inside a reentrant checkpoint segment and elsewhere under ``stream_grads``). ``DOS_FUZZ_EXAMPLES=N``
runs N seeds from ``DOS_FUZZ_START`` (default 1000), ``DOS_FUZZ_SEEDS=3,17`` those seeds, for long hunts.
What ``stream_grads`` documents it cannot do is not drawn with it: a gradient changed after backward (refused),
``model.zero_grad(set_to_none=False)`` (``opt.zero_grad`` is drawn instead), a second step on the same
gradients (warned), a param read inside a reentrant checkpoint segment and outside it (refused).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import os
import random
import shutil
import time
import warnings
from typing import Any

import pytest
import torch
from torch import nn

from deep_optimizer_states import DeepOptimizerStates, Placement
from deep_optimizer_states import optimizer as optimizer_module
from deep_optimizer_states.core import engine
from deep_optimizer_states.tools.models import checkpoint_activations
from tests.harness import mlp, tiny_llama, total_norm

HAS_COMPILER = shutil.which("c++") is not None and shutil.which("ninja") is not None
UNLIMITED = 10**15
FILL_BYTES = 12  # slots filled ahead: p, m, v in fp32
# ---- the configuration of one example ----------------------------------------------------------------------
@dataclasses.dataclass
class Config:
    seed: int
    model: str  # llama, llama_tied, mlp
    dtype: torch.dtype
    groups: bool  # two param groups (matrices; vectors without decay and a smaller lr)
    subgroup_size: int
    ref_subgroup_size: int
    schedule: Any  # "cpu", "gpu", 2, 3, "auto", "offload" or "list" (random placements set after construction)
    stream_grads: bool
    overlap: bool
    prefetch: Any  # False, True, "release"
    room: int  # bytes the planner gives the slots filled ahead (no budget on the CPU: set by the test)
    speculate: Any  # False, True or a count
    max_grad_norm: float | None
    nonfinite: str
    bf16_cpu_path: bool
    lr: float
    weight_decay: float
    slow: float  # seconds each AdamW call of the engine sleeps in the run with features (0: not slowed)
    steps: list[dict]
    adamw: bool = True  # False: classic Adam (L2 decay)
    frozen: int | None = None  # a param with requires_grad=False when the optimizer is built (never trained)
    checkpointing: str | None = None  # Llama: activation checkpointing, "reentrant" or "plain"
    stand_down: Any = True  # optimizer.STAND_DOWN: True, "forecast" or False
    sit_out: bool = True  # optimizer.SIT_OUT_AFTER_CLIP

    def kwargs(self) -> dict:
        return dict(stream_grads=self.stream_grads, overlap=self.overlap, prefetch=self.prefetch,
                    speculate=self.speculate, bf16_cpu_path=self.bf16_cpu_path)

    def short(self) -> str:
        return (f"seed={self.seed} model={self.model}/{str(self.dtype)[6:]} groups={self.groups} "
                f"sg={self.subgroup_size}/{self.ref_subgroup_size} schedule={self.schedule} "
                f"stream={self.stream_grads} overlap={self.overlap} prefetch={self.prefetch} room={self.room} "
                f"speculate={self.speculate} clip={self.max_grad_norm} nonfinite={self.nonfinite} "
                f"bf16_cpu={self.bf16_cpu_path} slow={self.slow} adamw={self.adamw} lr={self.lr} "
                f"wd={self.weight_decay} "
                f"frozen={self.frozen} checkpointing={self.checkpointing} stand_down={self.stand_down} "
                f"sit_out={self.sit_out}")


BEFORE = ["sync", "eval", "eval_big", "lr", "sd_save", "sd_load", "sd_load_earlier", "edit_inplace", "edit_load",
          "edit_data", "edit_data_copy", "same_load", "schedule", "snapshot", "noop_step", "read_state", "release",
          "step_write", "double_step", "state_inplace", "master_write"]
AFTER = ["read_state", "master", "lr", "sd_save", "sd_load", "sd_load_earlier", "edit_inplace", "edit_load",
         "edit_data", "same_load", "schedule", "clip_method", "sync", "discard", "state_write", "step_write",
         "grad_nan", "grad_none", "drop", "state_inplace", "master_write", "hyper"]


def draw(seed: int) -> Config:
    rng = random.Random(seed)
    model = rng.choice(["llama", "llama", "llama_tied", "mlp", "mlp"])
    dtype = rng.choice([torch.float32, torch.float32, torch.bfloat16, torch.bfloat16, torch.float16])
    if dtype == torch.float16 and model != "mlp":  # fp16 matmuls are slow on the CPU: fp16 on the MLP only
        dtype = torch.bfloat16
    sizes = [600, 1500, 3000, 7000, 12000] if model.startswith("llama") else [150, 400, 1000, 2500]
    stream = rng.random() < 0.6
    overlap = rng.random() < 0.5
    prefetch = rng.choice([False, True, "release"]) if stream else False
    speculate = rng.choice([False, True, 1, 3]) if stream and dtype != torch.float16 else False  # no loss scaling
    clip = rng.choice([None, None, 1e-3, 0.3, 1e6])
    steps = []
    for k in range(rng.randint(4, 8)):
        zero = rng.choice(["opt_none", "opt_none", "opt_zeros", "model_none", "model_zeros"]
                          + ([] if stream or k == 0 else ["none"]))
        micro = rng.choice([1, 1, 2, 3])
        variant = rng.choice(["full"] * 4 + ["early", "embeds" if model.startswith("llama") else "twice", "freeze"])
        nan = None
        if rng.random() < 0.15:
            nan = (rng.choice(["loss_nan", "loss_inf", "param_nan"]), rng.randrange(micro), rng.randrange(1000))
        before = [a for a in BEFORE if rng.random() < 0.1] if k else []
        after = [a for a in AFTER if rng.random() < 0.08]
        if stream:  # a gradient changed after backward is refused with stream_grads (documented): not drawn
            after = [a for a in after if a not in ("grad_nan", "grad_none")]
            before = [a for a in before if a != "double_step"]  # the streamed gradients are gone: warned
        if dtype == torch.float16:  # a second step on the same scaled gradients is refused (scale_loss again)
            before = [a for a in before if a != "double_step"]
        rng.shuffle(before)
        rng.shuffle(after)
        steps.append(dict(zero=zero, micro=micro, variant=variant, nan=nan, before=before, after=after,
                          snapshot=rng.random() < 0.3, pick=rng.randrange(1000), lr=rng.choice([1e-3, 5e-3, 2e-2]),
                          schedule=rng.choice(["cpu", "gpu", 2, 3, "auto", "offload", "list"]), clip=rng.choice(
                              [1e-3, 0.5, 1e6]),
                          # the non-final micro-batches' own losses (None: the step's): gradients that only
                          # they give are never final under stream_grads, and are gathered at the step
                          mixed=[rng.choice([None, None, "full", "early"]) for _ in range(micro - 1)]))
    if stream:  # model.zero_grad(set_to_none=False) cannot give the gradients that left zeros again: opt's can
        for sp in steps:
            sp["zero"] = "opt_zeros" if sp["zero"] == "model_zeros" else sp["zero"]
    checkpointing = rng.choice([None, None, None, "plain", "reentrant"]) if model.startswith("llama") else None
    if stream and checkpointing == "reentrant":  # the NaN term reads a param inside a reentrant checkpointed
        for sp in steps:  # layer and outside it: refused under stream_grads (its own test), not drawn
            if sp["nan"] is not None and sp["nan"][0] == "param_nan":
                sp["nan"] = ("loss_nan", *sp["nan"][1:])
    config = Config(
        seed=seed, model=model, dtype=dtype, groups=rng.random() < 0.4, subgroup_size=rng.choice(sizes),
        ref_subgroup_size=rng.choice([None, 25_000_000]) or 0, schedule=rng.choice(
            ["cpu", "gpu", 2, 3, "auto", "offload", "list", "list"]),
        stream_grads=stream, overlap=overlap, prefetch=prefetch,
        room=rng.choice([UNLIMITED, FILL_BYTES * 1500, FILL_BYTES * 6000]), speculate=speculate, max_grad_norm=clip,
        nonfinite=rng.choice(["skip", "skip", "skip", "raise"]),
        bf16_cpu_path=HAS_COMPILER and dtype == torch.bfloat16 and rng.random() < 0.5,
        lr=rng.choice([1e-3, 1e-2]), weight_decay=rng.choice([0.0, 0.1]), slow=rng.choice([0.0, 0.0, 0.0005, 0.002]),
        steps=steps, adamw=rng.random() < 0.85, frozen=rng.randrange(100) if rng.random() < 0.15 else None,
        checkpointing=checkpointing)
    # drawn last, so the draws above (and the seeds found before) stay as they were
    return dataclasses.replace(config, stand_down=rng.choice([True, True, "forecast", False]),
                               sit_out=rng.random() < 0.6)


# ---- building ---------------------------------------------------------------------------------------------
def make_model(cfg: Config) -> nn.Module:
    if cfg.model == "mlp":
        model = mlp(cfg.dtype, seed=cfg.seed % 7)
    else:
        model = tiny_llama(cfg.dtype, tie=cfg.model == "llama_tied", seed=cfg.seed % 7)
        if cfg.checkpointing:
            checkpoint_activations(model, reentrant=cfg.checkpointing == "reentrant")
            model.train()
    if cfg.frozen is not None:
        params = list(model.parameters())
        params[cfg.frozen % len(params)].requires_grad_(False)
    return model


def param_groups(model: nn.Module, cfg: Config):
    named = list(model.named_parameters())
    if not cfg.groups:
        return model, {}
    groups = [{"params": [(n, p) for n, p in named if p.ndim >= 2]},
              {"params": [(n, p) for n, p in named if p.ndim < 2], "weight_decay": 0.0, "lr": cfg.lr / 2}]
    return groups, {"model": model}


def random_placements(count: int, seed: int) -> list[Placement]:
    rng = random.Random(seed)
    return [rng.choice([Placement.CPU, Placement.STAGED, Placement.RESIDENT]) for _ in range(count)]


def set_schedule(opt: DeepOptimizerStates, schedule, seed: int) -> None:
    opt.schedule = random_placements(len(opt.layout.subgroups), seed) if schedule == "list" else schedule


def build(model: nn.Module, cfg: Config, features: bool) -> DeepOptimizerStates:
    params, extra = param_groups(model, cfg)
    if not features:
        return DeepOptimizerStates(params, lr=cfg.lr, weight_decay=cfg.weight_decay, adamw=cfg.adamw, schedule="cpu",
                                   subgroup_size=cfg.ref_subgroup_size or cfg.subgroup_size,
                                   max_grad_norm=cfg.max_grad_norm, nonfinite=cfg.nonfinite, **extra)
    opt = DeepOptimizerStates(params, lr=cfg.lr, weight_decay=cfg.weight_decay, adamw=cfg.adamw,
                              schedule="cpu" if cfg.schedule == "list" else cfg.schedule,
                              subgroup_size=cfg.subgroup_size, max_grad_norm=cfg.max_grad_norm,
                              nonfinite=cfg.nonfinite, **cfg.kwargs(), **extra)
    if cfg.schedule == "list":
        set_schedule(opt, "list", cfg.seed)
    if cfg.prefetch:  # no GPU budget here: the test gives the slots filled ahead their room
        opt.planner.room_ahead = lambda resident_bytes, ahead_bytes, room=cfg.room: max(0, room - ahead_bytes)
    return opt


class TorchTwin:
    """torch's own fused AdamW (or Adam) behind the calls a trajectory makes of ours, for fp32 models: the
    steps ours skips (inf/nan gradients) skipped, clipping by torch.nn.utils.clip_grad_norm_ right before the
    step, or, if ``clip_grad_norm_`` was called since the last step, by its max_norm and the norm it measured
    then (as ours: only that one; a gradient set to None since is not stepped), the gradients put back after
    it (ours clips what it reads, not the params' .grad), the masters loaded by load_state_dict shown until
    the next step. The optimizer-only calls (schedule, synchronize, release) do nothing."""

    def __init__(self, model: nn.Module, cfg: Config) -> None:
        params, _ = param_groups(model, cfg)
        groups = list(model.parameters()) if params is model else [
            {**g, "params": [p for _, p in g["params"]]} for g in params]
        cls = torch.optim.AdamW if cfg.adamw else torch.optim.Adam
        self.opt = cls(groups, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=True)
        self.max_grad_norm, self.nonfinite = cfg.max_grad_norm, cfg.nonfinite
        self.skipped_steps, self.last_grad_norm, self._clip = 0, None, None
        self._loaded: dict[int, torch.Tensor] = {}
        self.layout = type("L", (), {"where": {id(p): None for p in model.parameters() if p.requires_grad},
                                     "subgroups": [None]})()

    state = property(lambda self: self.opt.state)  # load_state_dict replaces both
    param_groups = property(lambda self: self.opt.param_groups)

    def _with_grads(self) -> list[torch.Tensor]:
        return [p for g in self.opt.param_groups for p in g["params"] if p.grad is not None]

    def step(self) -> None:
        self._loaded = {}  # every step() settles the masters loaded (ours: take_edits, also with no gradient)
        params, clip, self._clip = self._with_grads(), self._clip, None
        if not params:
            return
        if not all(bool(torch.isfinite(p.grad).all()) for p in params):
            if self.nonfinite == "raise":
                raise FloatingPointError("inf/nan gradients")
            self.skipped_steps += 1
            return
        clip = clip if clip is not None else (self.max_grad_norm, None)
        grads = [p.grad.clone() for p in params] if clip[0] is not None else None
        if clip[1] is not None:  # clip_grad_norm_'s: by the norm it measured then, as torch (gradients set to
            coef = torch.clamp(clip[0] / (clip[1] + 1e-6), max=1.0)  # None since are not stepped)
            torch._foreach_mul_([p.grad for p in params], coef)
        elif clip[0] is not None:  # ours clips the gradients it reads, not the params' .grad: put them back after
            torch.nn.utils.clip_grad_norm_(params, clip[0])
        self.opt.step()
        if grads is not None:
            for p, g in zip(params, grads):
                p.grad.copy_(g)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        norm = total_norm([p.grad for p in self._with_grads()])
        self._clip = (max_norm, norm)  # applied in step, as ours
        return norm

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._clip = None
        self.opt.zero_grad(set_to_none)

    def master(self, p: torch.Tensor) -> torch.Tensor:
        return self._loaded.get(id(p), p.detach())

    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.opt.param_groups for p in g["params"]]

    def state_dict(self) -> dict:
        """Also what ours keeps in its own: the skipped steps, and the masters (for fp32 params the params, or
        the masters loaded since the last step)."""
        masters = {i: self.master(p).clone() for i, p in enumerate(self._params()) if self.opt.state.get(p)}
        return {**self.opt.state_dict(), "skipped": self.skipped_steps, "masters": masters}

    def load_state_dict(self, sd: dict) -> None:
        """As ours: until the next step, master(p) is the loaded master; that step trains from the param (for
        fp32 params, keeping the loaded master when the param holds it is the same)."""
        sd = dict(sd)
        self.skipped_steps, masters = sd.pop("skipped"), sd.pop("masters")
        self.opt.load_state_dict(sd)
        params = self._params()
        self._loaded = {id(params[i]): m.clone() for i, m in masters.items()}

    def write_master(self, p: torch.Tensor, value: torch.Tensor) -> None:
        with torch.no_grad():
            p.copy_(value)
        self._loaded.pop(id(p), None)

    def accumulating(self):
        return contextlib.nullcontext()

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def synchronize(self) -> None:
        pass

    release_gpu_memory = close = synchronize


def _torch_comparable(label: str) -> bool:
    """Observations torch's optimizer has too (not its state_dict's layout, nor ours' norm bookkeeping)."""
    return not any(word in label for word in (" sd", "sd_save", " norm", "clip_method"))


# ---- the losses -------------------------------------------------------------------------------------------
def batch(cfg: Config, step: int, micro: int, dtype: torch.dtype, big: bool = False) -> dict:
    gen = torch.Generator().manual_seed(cfg.seed * 1009 + step * 31 + micro)
    rows = 2 if big else 1
    if cfg.model == "mlp":
        return {"x": torch.randn(16 * rows, 32, generator=gen).to(dtype), "y": torch.randn(16 * rows, 8, generator=gen),
                "x2": torch.randn(16, 32, generator=gen).to(dtype)}
    return {"ids": torch.randint(0, 128, (2 * rows, 16), generator=gen),
            "embeds": (torch.randn(2, 16, 64, generator=gen) * 0.5).to(dtype)}


def loss_of(model: nn.Module, cfg: Config, data: dict, variant: str) -> torch.Tensor:
    """``variant``: full; early (the loss of an early layer's output: the later params get no gradient);
    embeds (Llama: inputs_embeds, the embedding gets none); twice (the MLP called on two batches)."""
    if cfg.model == "mlp":
        if variant == "early":
            seen = []
            handle = model[2].register_forward_hook(lambda m, a, out: seen.append(out))
            try:
                model(data["x"])
            finally:
                handle.remove()
            return seen[0].float().pow(2).mean()
        loss = (model(data["x"]).float() - data["y"]).pow(2).mean()
        if variant == "twice":
            loss = loss + model(data["x2"]).float().pow(2).mean() * 0.5
        return loss
    if variant == "early":
        out = model(input_ids=data["ids"], output_hidden_states=True)
        return out.hidden_states[1].float().pow(2).mean()
    if variant == "embeds":
        return model(inputs_embeds=data["embeds"], labels=data["ids"]).loss
    return model(input_ids=data["ids"], labels=data["ids"]).loss


# ---- one trajectory ---------------------------------------------------------------------------------------
class Recorder:
    def __init__(self) -> None:
        self.obs: list[tuple[str, Any]] = []

    def add(self, label: str, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            value = value.detach().to("cpu", copy=True)
        self.obs.append((label, value))


def snapshot(rec: Recorder, model: nn.Module, opt: DeepOptimizerStates, where: str) -> None:
    opt.synchronize()
    for name, p in model.named_parameters():
        rec.add(f"{where} param {name}", p)
        if id(p) not in opt.layout.where:  # frozen when the optimizer was built: no master, no state
            continue
        rec.add(f"{where} master {name}", opt.master(p))
        has = p in opt.state and bool(opt.state[p])
        rec.add(f"{where} has_state {name}", has)
        if has:
            st = opt.state[p]
            for key in ("step", "exp_avg", "exp_avg_sq"):
                rec.add(f"{where} {key} {name}", st[key])
    rec.add(f"{where} skipped", opt.skipped_steps)


def record_sd(rec: Recorder, sd: dict, where: str) -> None:
    for i in sorted(sd["state"]):
        for key in sorted(sd["state"][i]):
            rec.add(f"{where} sd[{i}][{key}]", sd["state"][i][key])
    for gi, g in enumerate(sd["param_groups"]):
        rec.add(f"{where} sd group {gi}", {k: v for k, v in g.items() if k not in ("params", "param_names")})


def perturbed(model: nn.Module, seed: int) -> dict:
    """The model's state_dict with about half of the tensors replaced by seeded noise (the same for both twins,
    whatever their weights), a quarter scaled."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in model.state_dict().items():
        r = rng.random()
        if r < 0.5:
            out[k] = (torch.randn(v.shape, generator=gen) * 0.05).to(v.dtype)
        elif r < 0.75:
            out[k] = v * 0.75
        else:
            out[k] = v.clone()
    return out


def trajectory(cfg: Config, model: nn.Module, opt: DeepOptimizerStates, features: bool) -> Recorder:
    rec = Recorder()
    params = [p for p in model.parameters() if p.requires_grad]  # not one frozen when the optimizer was built
    saved: list[dict] = []

    def pick(n: int, salt: int) -> torch.Tensor:
        return params[(n + salt) % len(params)]

    def act(action: str, k: int, sp: dict, phase: str) -> None:
        tag = f"step {k} {phase} {action}"
        if action == "sync":
            opt.synchronize()
        elif action in ("eval", "eval_big"):
            with torch.no_grad():
                rec.add(tag, loss_of(model, cfg, batch(cfg, 10_000 + k, 0, cfg.dtype, action == "eval_big"), "full"))
        elif action == "release":
            opt.release_gpu_memory()
        elif action in ("edit_data", "edit_data_copy"):
            opt.synchronize()  # documented: before editing params outside a forward (overlap)
            p = pick(sp["pick"], 4)
            with torch.no_grad():
                if action == "edit_data":
                    p.data = p.data * 0.5  # a new tensor behind the param
                else:
                    p.data.copy_(p.data * 0.5)  # through .data: no version counter moves; the norm does
        elif action == "step_write":
            p = pick(sp["pick"], 6)
            if p in opt.state and opt.state[p]:
                opt.state[p]["step"] = torch.tensor(float(opt.state[p]["step"]) + 2)
        elif action == "grad_nan":
            opt.synchronize()
            p = pick(sp["pick"], 7)
            if p.grad is not None:
                with torch.no_grad():
                    p.grad.view(-1)[0] = float("nan")
        elif action == "double_step":  # the same gradients again (torch steps again)
            try:
                opt.step()
                rec.add(tag, None)
            except FloatingPointError as err:
                rec.add(tag, type(err).__name__)
        elif action == "state_inplace":
            p = pick(sp["pick"], 9)
            if p in opt.state and opt.state[p]:
                opt.state[p]["exp_avg"].mul_(0.5)  # read (made current), then written in place
        elif action == "master_write":
            p = pick(sp["pick"], 10)
            if p in opt.state and opt.state[p]:
                if isinstance(opt, TorchTwin):  # fp32: the param follows the master written
                    opt.write_master(p, opt.master(p) * 0.75)
                else:
                    opt.state[p]["master"] = opt.state[p]["master"] * 0.75
        elif action == "drop":
            opt.zero_grad()
        elif action == "hyper":
            g = opt.param_groups[sp["pick"] % len(opt.param_groups)]
            g["betas"] = (0.8, 0.99)
            g["eps"] = 1e-6
        elif action == "grad_none":
            p = pick(sp["pick"], 8)
            p.grad = None
        elif action == "lr":
            for g in opt.param_groups:
                g["lr"] = sp["lr"] * (0.5 if g is not opt.param_groups[0] else 1.0)
            opt.param_groups[-1]["weight_decay"] = 0.05
        elif action == "sd_save":
            sd = opt.state_dict()
            record_sd(rec, sd, tag)
            saved.append(copy.deepcopy(sd))
        elif action == "sd_load":
            sd = copy.deepcopy(opt.state_dict())
            opt.load_state_dict(sd)
        elif action == "sd_load_earlier":
            if saved:
                opt.load_state_dict(copy.deepcopy(saved[sp["pick"] % len(saved)]))
        elif action == "edit_inplace":
            opt.synchronize()  # documented: before editing params outside a forward (overlap)
            with torch.no_grad():
                for j in range(0, len(params), 3):
                    pick(sp["pick"], j).mul_(0.75)
        elif action == "edit_load":
            model.load_state_dict(perturbed(model, cfg.seed * 7 + k))
        elif action == "same_load":
            model.load_state_dict({n: v.clone() for n, v in model.state_dict().items()})
        elif action == "schedule":
            if features and not isinstance(opt, TorchTwin):
                set_schedule(opt, sp["schedule"], cfg.seed * 13 + k)
        elif action == "snapshot":
            snapshot(rec, model, opt, tag)
        elif action == "noop_step":
            opt.zero_grad()
            opt.step()
        elif action == "read_state":
            p = pick(sp["pick"], 1)
            if p in opt.state and opt.state[p]:
                rec.add(tag, opt.state[p]["exp_avg"])
                rec.add(tag, opt.state[p]["step"])
        elif action == "state_write":
            p = pick(sp["pick"], 2)
            if p in opt.state and opt.state[p]:
                opt.state[p]["exp_avg"] = opt.state[p]["exp_avg"] * 0.5
        elif action == "master":
            p = pick(sp["pick"], 3)
            rec.add(tag, opt.master(p))
        elif action == "clip_method":
            rec.add(tag, opt.clip_grad_norm_(sp["clip"]))
        elif action == "discard":
            opt.zero_grad()
            loss = loss_of(model, cfg, batch(cfg, 20_000 + k, 0, cfg.dtype), "full")
            rec.add(tag, loss)
            opt.scale_loss(loss).backward()
        else:
            raise AssertionError(action)

    for k, sp in enumerate(cfg.steps):
        for action in sp["before"]:
            act(action, k, sp, "before")
        zero = sp["zero"]
        if zero == "opt_none":
            opt.zero_grad()
        elif zero == "opt_zeros":
            opt.zero_grad(set_to_none=False)
        elif zero == "model_none":
            model.zero_grad()
        elif zero == "model_zeros":
            opt.synchronize()  # documented: before changing gradients in place (overlap)
            model.zero_grad(set_to_none=False)
        frozen = pick(sp["pick"], 5) if sp["variant"] == "freeze" else None
        if frozen is not None:
            frozen.requires_grad_(False)  # for this step only
        try:
            for m in range(sp["micro"]):
                variant = sp["mixed"][m] if m < sp["micro"] - 1 and sp["mixed"][m] else sp["variant"]
                loss = loss_of(model, cfg, batch(cfg, k, m, cfg.dtype), "full" if frozen is not None else variant)
                if sp["nan"] is not None and sp["nan"][1] == m:
                    kind, _, which = sp["nan"]
                    if kind == "loss_nan":
                        loss = loss * float("nan")
                    elif kind == "loss_inf":
                        loss = loss * float("inf")
                    else:
                        loss = loss + pick(which, 0).float().sum() * float("nan")
                rec.add(f"step {k} micro {m} loss", loss)
                with opt.accumulating() if m < sp["micro"] - 1 else contextlib.nullcontext():
                    opt.scale_loss(loss / sp["micro"]).backward()  # scaled for fp16 params only
        finally:
            if frozen is not None:
                frozen.requires_grad_(True)
        for action in sp["after"]:
            act(action, k, sp, "after")
        try:
            opt.step()
            rec.add(f"step {k} raised", None)
        except FloatingPointError as err:
            rec.add(f"step {k} raised", type(err).__name__)
        rec.add(f"step {k} skipped", opt.skipped_steps)
        rec.add(f"step {k} norm", opt.last_grad_norm)
        if sp["snapshot"]:
            snapshot(rec, model, opt, f"step {k} after")
    snapshot(rec, model, opt, "end")
    return rec


@contextlib.contextmanager
def slowed(seconds: float):
    """Every AdamW call of the engine sleeps first: with overlap, the next forward runs ahead of the update."""
    if not seconds:
        yield
        return
    real = engine.adam_update

    def slow(*args, **kwargs):
        time.sleep(seconds)
        return real(*args, **kwargs)

    engine.adam_update = slow
    try:
        yield
    finally:
        engine.adam_update = real


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        if a.is_floating_point():
            return bool(((a == b) | (a.isnan() & b.isnan())).all())
        return torch.equal(a, b)
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    return a == b


def _describe(a: Any, b: Any) -> str:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and a.is_floating_point():
        d = (a.float() - b.float()).abs()
        return f"max |diff| {d.nan_to_num(float('inf')).max().item():.3e} at {int(d.nan_to_num(float('inf')).argmax())}"
    return f"{a!r} != {b!r}"


LAST_STATS: dict = {}  # what the run with features did (for the long runs' coverage counts)


def _stats(opt: DeepOptimizerStates) -> dict:
    out = {"subgroups": len(opt.layout.subgroups), "skipped": opt.skipped_steps,
           "resident_admitted": opt.residents.counters.admitted, "resident_evicted": opt.residents.counters.evicted}
    if opt.speculation is not None:
        out.update(spec_kept=opt.speculation.kept, spec_undone=opt.speculation.undone,
                   spec_called_off=opt.speculation.called_off)
    if opt.prefetch is not None:
        out["prefetched"] = opt.prefetch.filled
    if opt.grad_stream is not None:
        out["streamed"] = opt.grad_stream.sent
    return out


def run_example(seed: int) -> Config:
    return run_config(draw(seed))


def run_config(cfg: Config) -> Config:
    flags = optimizer_module.STAND_DOWN, optimizer_module.SIT_OUT_AFTER_CLIP
    optimizer_module.STAND_DOWN, optimizer_module.SIT_OUT_AFTER_CLIP = cfg.stand_down, cfg.sit_out
    try:
        return _run_config(cfg)
    finally:
        optimizer_module.STAND_DOWN, optimizer_module.SIT_OUT_AFTER_CLIP = flags


def _run_config(cfg: Config) -> Config:
    model = make_model(cfg)
    twin = copy.deepcopy(model)
    twin_at_start = copy.deepcopy(model)
    records = []
    for m, features in ((model, True), (twin, False)):
        opt = build(m, cfg, features)
        try:
            # the sleeps bounded to ~0.1 s per update (a CI-sized run); still far longer than each AdamW call
            slow = min(cfg.slow, 0.1 / len(opt.layout.subgroups)) if features else 0.0
            with warnings.catch_warnings(), slowed(slow):
                warnings.simplefilter("ignore")
                records.append(trajectory(cfg, m, opt, features))
            if features:
                LAST_STATS.clear()
                LAST_STATS.update(_stats(opt))
        finally:
            opt.close()
    _compare(cfg, records[0].obs, records[1].obs, "with features", "plain")
    if cfg.dtype == torch.float32:  # the plain optimizer against torch's own, under the same actions
        third = copy.deepcopy(twin_at_start)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            theirs = trajectory(cfg, third, TorchTwin(third, cfg), False)
        _compare(cfg, [o for o in records[1].obs if _torch_comparable(o[0])],
                 [o for o in theirs.obs if _torch_comparable(o[0])], "plain", "torch")
    return cfg


def _compare(cfg: Config, got: list, want: list, a_name: str, b_name: str) -> None:
    for i, ((la, a), (lb, b)) in enumerate(zip(got, want)):
        assert la == lb, f"{cfg.short()}\n{a_name} against {b_name}, observation {i}: {la!r} against {lb!r}"
        assert _same(a, b), (f"{cfg.short()}\n{a_name} against {b_name}, observation {i} ({la}) differs: "
                             f"{_describe(a, b)}\nsteps: {cfg.steps}")
    assert len(got) == len(want), f"{cfg.short()}\n{a_name} against {b_name}: {len(got)} against {len(want)}"


# ---- the seeds --------------------------------------------------------------------------------------------
DEFAULT_SEEDS = list(range(40))
FOUND = [45, 144, 362, 372, 700390, 25442]  # past the default list, examples that met a bug (fixed): the library's
# in the first hunt; 25442 the harness's, on torch 2.5 with transformers 4.57 (a frozen embedding, reentrant segments)


def _seeds() -> list[int]:
    if os.environ.get("DOS_FUZZ_SEEDS"):
        return [int(s) for s in os.environ["DOS_FUZZ_SEEDS"].split(",")]
    if os.environ.get("DOS_FUZZ_EXAMPLES"):
        start = int(os.environ.get("DOS_FUZZ_START", "1000"))
        return list(range(start, start + int(os.environ["DOS_FUZZ_EXAMPLES"])))
    return DEFAULT_SEEDS + FOUND


@pytest.mark.parametrize("seed", _seeds())
def test_random_feature_combinations_equal_the_plain_optimizer_bit_for_bit(seed):
    run_example(seed)

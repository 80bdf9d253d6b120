"""The systems under comparison, each set up the way its documentation recommends.

Every system trains the same Llama-style model (``deep_optimizer_states.tools.models.llama``, seed 0) with AdamW
(lr 1e-4, weight decay 0.01) in bf16 compute; the FSDP2 peer builds it on the meta device and draws its
shards from N(0, 0.02) as the model's own init does, with other draws (its losses start elsewhere). A
system is a ``Trainer``: forward (returns the loss), backward, step (including zero_grad), and ``extra()``
with what only it can tell (PCIe bytes, pinned host memory). Peers' packages (DeepSpeed, torchao) are
imported only when their system is asked for.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import random
from dataclasses import asdict, dataclass, field, replace
from typing import Callable

import torch

import deep_optimizer_states.core.engine as engine_module
import deep_optimizer_states.optimizer as optimizer_module
import deep_optimizer_states.planning.plan as plan_module
from deep_optimizer_states import DeepOptimizerStates
from deep_optimizer_states.core import cpu_adamw
from deep_optimizer_states.core.layout import HOST_BYTES_PER_ELEMENT
from deep_optimizer_states.core.schedule import Placement, spread
from deep_optimizer_states.tools.models import PRESETS, checkpoint_activations, llama, materialize

LR, WEIGHT_DECAY = 1e-4, 0.01
CLIP = 1.0  # max_grad_norm of the systems named *_clip (the Hugging Face Trainer's default)
# the loss's factor in a spike's backward (systems *_spikes; a power of 2 scales bf16 gradients exactly): the
# memorised batch's norm falls to 0.001-0.5 from its tenth step, so x8 spikes stayed under the clip (H100 call
# 168); x1024 clip (calls 169-170)
SPIKE = 1024.0
SPIKE_EVERY = 4  # a spike in every 4th backward: after each, one step paused and two that run updates ahead
# systems *_hover: each step's gradient norm aimed at a draw between these, log-uniform, about CLIP (a loss
# factor of a power of 2 from the last step's norm: within a factor of about 1.4 of the aim, as the norm moves)
HOVER_AIMS = (0.5, 2.0)
# systems *_fresh: the seed of the device generator that draws each step's batch (the same for ours and its
# reference, so both train on the same batches in the same order)
FRESH_SEED = 0


@dataclass
class Trainer:
    model: torch.nn.Module
    forward: Callable[[torch.Tensor], torch.Tensor]
    backward: Callable[[torch.Tensor], None]
    step: Callable[[], None]
    params: int
    extra: Callable[[], dict] = field(default=lambda: {})
    settings: str = ""
    optimizer: object = None  # ours: the DeepOptimizerStates (bench/trace_loop.py names its streams)
    # the global norm of the gradients the last step took (before clipping), a tensor; None where not measured
    grad_norm: Callable[[], torch.Tensor | None] = lambda: None


def _autocast(device: torch.device):
    return torch.autocast(device.type, dtype=torch.bfloat16)


def _plain(model: torch.nn.Module, opt: torch.optim.Optimizer, device: torch.device, settings: str) -> Trainer:
    """fp32 params on the device, bf16 autocast: how torch AdamW and torchao's offload are used."""
    def forward(ids):
        with _autocast(device):
            return model(input_ids=ids, labels=ids).loss

    def step():
        opt.step()
        opt.zero_grad()

    return Trainer(model, forward, lambda loss: loss.backward(), step, sum(p.numel() for p in model.parameters()),
                   settings=settings)


def ours(schedule: str | int, stream_grads: bool = False, overlap: bool = False, max_grad_norm: float | None = None,
         spare_cores: int = 0, checkpointing: bool = False,
         path_threads: int | None = None, prefetch: bool | str = False,
         speculate: bool | int = False, bf16_cpu_path: bool = False,
         subgroup_size: int | None = None,
         launch_share: float | None = None,
         staged_share: float | None = None,
         fill_cap: float | None = None,
         fills_within_backward: bool | None = None,
         flush_ahead_last: bool | None = None,
         sit_out: bool | None = None,
         stand_down: bool | str | None = None,
         kernel_defines: tuple[str, ...] = (),
         allocator: str | None = None) -> Callable[[str, torch.device, int], Trainer]:
    """Our optimizer; ``spare_cores`` leaves that many cores out of its CPU AdamW threads (for the training
    loop's own thread while an overlapped update runs); ``checkpointing`` turns on the model's activation
    checkpointing (transformers' non-reentrant one), for budgets below what forward and backward need;
    ``path_threads`` runs the CPU path's AdamW on that many threads after planning (the plan is unchanged:
    does a throttled CPU leave the staged copies more host memory bandwidth?); ``prefetch`` fills the staged
    subgroups' slots during backward ("release": each given back at its flush); ``speculate`` runs the CPU
    path's update ahead during backward;
    ``bf16_cpu_path`` sends the CPU path's gradients down and params up in bf16 (our kernel);
    ``subgroup_size``: elements per subgroup (the optimizer's default when None); ``launch_share``: the share
    of the CPU path's threads an update run ahead leaves to backward (``speculate.LAUNCH_SHARE`` when None;
    set for this process, which runs one system); ``staged_share``: that share of the subgroups staged, spread
    evenly, as a fixed schedule (the performance model does not choose: what another split gives); ``fill_cap``:
    ``plan.FILL_CAP`` for this process (``prefetch`` fills at most that many times what the link carries in
    the rest of the iteration; math.inf: as many as the memory holds, the library before 2026-12-02);
    ``fills_within_backward``: ``plan.FILLS_WITHIN_BACKWARD`` for this process (what the link carries in
    backward's span of final gradients, where shorter than the rest, bounds the fills);
    ``flush_ahead_last``: ``engine.FLUSH_AHEAD_LAST`` for this process
    (True: the flushes of the subgroups filled ahead after the slots', the default of calls 64-67);
    ``sit_out``: ``optimizer.SIT_OUT_AFTER_CLIP`` for this process (False: updates run ahead on the step after
    one that clipped too, standing down where the norm landed passes the clip's); ``stand_down``:
    ``optimizer.STAND_DOWN`` for this process (False: an update run ahead on a step that clips runs and is undone;
    "forecast": it stands down once the norm landed, over the last step's share by then, passes the clip's);
    ``kernel_defines``: the bf16 kernel built with these macros (``cpu_adamw.KERNEL_DEFINES``), in the same form
    (variant) as the library's; ``allocator``: torch's CUDA allocator settings for this process, in
    ``PYTORCH_CUDA_ALLOC_CONF``'s form (set before the model is built; no effect without a GPU)."""
    def build(preset: str, device: torch.device, batch: int) -> Trainer:
        if launch_share is not None:
            optimizer_module.LAUNCH_SHARE = launch_share
        if fill_cap is not None:
            plan_module.FILL_CAP = fill_cap
        if fills_within_backward is not None:
            plan_module.FILLS_WITHIN_BACKWARD = fills_within_backward
        if flush_ahead_last is not None:
            engine_module.FLUSH_AHEAD_LAST = flush_ahead_last
        if sit_out is not None:
            optimizer_module.SIT_OUT_AFTER_CLIP = sit_out
        if stand_down is not None:
            optimizer_module.STAND_DOWN = stand_down
        if allocator is not None and device.type == "cuda":
            torch.cuda.memory._set_allocator_settings(allocator)
        model = llama(preset, torch.bfloat16, device)
        if checkpointing:
            checkpoint_activations(model)
        threads = max(1, (os.cpu_count() or 1) - spare_cores) if spare_cores else None
        opt = DeepOptimizerStates(model, lr=LR, weight_decay=WEIGHT_DECAY, schedule=schedule,
                                  stream_grads=stream_grads, overlap=overlap, max_grad_norm=max_grad_norm,
                                  cpu_threads=threads, prefetch=prefetch, speculate=speculate,
                                  bf16_cpu_path=bf16_cpu_path,
                                  **({} if subgroup_size is None else {"subgroup_size": subgroup_size}))
        if path_threads:
            opt.engine.set_cpu_threads(path_threads)
        if kernel_defines and opt.engine.bf16_kernel is not None:
            opt.engine.bf16_kernel = cpu_adamw.Bf16GradAdam(cpu_adamw.build(kernel_defines),
                                                            opt.engine.bf16_kernel.variant)
        if staged_share is not None:
            count = len(opt.layout.subgroups)
            opt.schedule = tuple(spread(count, round(staged_share * count)))

        history = []  # per step: the plan's staged subgroups and predicted seconds, the last finished update and
        # where its time went (CPU AdamW, the staged window, each lane's busy seconds), and with `speculate` what
        # the updates run ahead came to by then (counts since the start: a step's own are the difference)
        norms = []  # per step: the global gradient norm, kept on the GPU (read at the end: no sync in the loop)

        def step():
            opt.step()
            norms.append(opt.last_grad_norm)
            opt.zero_grad()
            u, pred = opt.last_update, opt.plan.prediction
            history.append({"planned_staged": opt.placements.count(Placement.STAGED),
                            "predicted_s": None if pred is None else round(pred.seconds, 4),
                            "predicted_iteration_s": None if pred is None else round(pred.iteration_s, 4),
                            "rest_s": round(opt.planner.rest_s, 4),
                            "backward_s": None if opt.planner.backward_s is None else round(opt.planner.backward_s, 4),
                            "update_s": None if u is None else round(u.seconds, 4),
                            "staged": None if u is None else u.staged_subgroups,
                            "params_written_s": None if u is None or u.params_written_s is None
                            else round(u.params_written_s, 4),
                            "params_done_s": None if u is None or u.params_done_s is None
                            else round(u.params_done_s, 4),
                            "forward_wait_s": None if u is None or u.forward_wait_s is None
                            else round(u.forward_wait_s, 4),
                            "idle_tail_s": None if u is None or u.idle_tail_s is None else round(u.idle_tail_s, 4),
                            "prefetched": None if u is None else u.prefetched,
                            "speculated": None if u is None else u.speculated,
                            "cpu_adam_s": None if u is None else round(u.cpu_adam_seconds, 4),
                            "staged_window_s": None if u is None else round(u.staged_window_s, 4),
                            "lanes_busy_s": None if u is None else {k: round(v, 4) for k, v in u.lane_seconds.items()},
                            **({} if opt.speculation is None else {"run_ahead": run_ahead(opt.speculation)})})

        def extra() -> dict:
            opt.synchronize()  # with overlap, the last update may still run
            u = opt.last_update
            mem = opt.memory()
            info = {"pcie_h2d_GB": u.h2d_bytes / 1e9, "pcie_d2h_GB": u.d2h_bytes / 1e9,
                    "pinned_host_GB": opt.layout.numel * HOST_BYTES_PER_ELEMENT / 1e9,
                    "staged_subgroups": u.staged_subgroups, "resident_subgroups": u.resident_subgroups,
                    "subgroups": len(opt.layout.subgroups), "update_s": u.seconds,
                    "resident_GB": mem["device_resident_bytes"] / 1e9, "admitted": mem["admitted"],
                    "evicted": mem["evicted"], "failed_admissions": mem["failed_admissions"],
                    "gpu_budget_GB": (mem["gpu_budget_bytes"] or 0) / 1e9,
                    "gpu_need_GB": (mem["gpu_need_bytes"] or 0) / 1e9,
                    "gpu_ours_at_need_GB": (mem["gpu_ours_at_need_bytes"] or 0) / 1e9, "history": history,
                    "refine_factors": opt.planner.factors, "params_written_s": u.params_written_s,
                    "forward_wait_s": u.forward_wait_s, "bf16_kernel": opt.engine.bf16_kernel is not None,
                    "grad_norms": [None if n is None else float(n) for n in norms]}
            if max_grad_norm is not None:  # the steps whose gradients the clip scaled (clip_coefficient below 1)
                info["clipped_steps"] = sum(n is not None and n + 1e-6 > max_grad_norm for n in info["grad_norms"])
            info["grad_norms"] = [None if n is None else round(n, 4) for n in info["grad_norms"]]
            if opt.speculation is not None:
                spec = opt.speculation
                info["run_ahead"] = run_ahead(spec)
            if opt.plan.prediction is not None:
                info["predicted_update_s"] = opt.plan.prediction.seconds
                # what the last plan was priced with: to compare with the update's telemetry after the run
                info["prediction"] = opt.plan.prediction.as_dict()
                info["window"] = asdict(opt.planner.window)
                info["rates"] = opt.planner.rates.as_dict()
            if device.type == "cuda" and u.resident_subgroups < len(opt.layout.subgroups):
                from deep_optimizer_states.planning.perfmodel import lower_bound

                info["update_lower_bound_s"] = lower_bound(opt.layout.numel, opt.planner.calibrated)[0]
            return info

        return Trainer(model, lambda ids: model(input_ids=ids, labels=ids).loss, lambda loss: loss.backward(),
                       step, sum(p.numel() for p in model.parameters()), extra,
                       f"DeepOptimizerStates(schedule={schedule!r}, stream_grads={stream_grads}, overlap={overlap}, "
                       f"max_grad_norm={max_grad_norm}, cpu_threads={threads}, prefetch={prefetch!r}, "
                       f"speculate={speculate}, bf16_cpu_path={bf16_cpu_path}"
                       + ("" if subgroup_size is None else f", subgroup_size={subgroup_size}") + "), "
                       + (f"CPU path AdamW on {path_threads} threads, " if path_threads else "")
                       + (f"fixed schedule: {staged_share:.0%} of the subgroups staged, " if staged_share else "")
                       + (f"fills ahead capped at {fill_cap} x what the rest carries, " if fill_cap is not None else "")
                       + ("fills ahead within what backward's span carries, " if plan_module.FILLS_WITHIN_BACKWARD
                          else "")
                       + "CPU path's params up by the copy engine, "
                       + ("flushes filled ahead last, " if engine_module.FLUSH_AHEAD_LAST
                          else "flushes in the update's order, ")
                       + ("slots filled ahead released at their flush, " if prefetch == "release" else "")
                       + "".join(f"the bf16 kernel {cpu_adamw.KERNEL_DEFINES[d]}, " for d in kernel_defines)
                       + (f"CUDA allocator {allocator}, " if allocator else "")
                       + ("updates run ahead after a clipped step too, " if optimizer_module.SIT_OUT_AFTER_CLIP is False
                          else "")
                       + ("updates run ahead never stand down, " if optimizer_module.STAND_DOWN is False else "")
                       + ("updates run ahead stand down by a forecast of the clip, "
                          if optimizer_module.STAND_DOWN == "forecast" else "")
                       + ("activation checkpointing, " if checkpointing else "") + "bf16 params, "
                       "fp32 masters on the host", optimizer=opt, grad_norm=lambda: opt.last_grad_norm)
    return build


def defaults(clip: bool = False, **variant) -> Callable[[str, torch.device, int], Trainer]:
    """The library's settings with every state on the host (README: ``schedule="offload"``, gradients streamed,
    the update overlapped, fills and updates run ahead during backward, the bf16 CPU path), clipped at ``CLIP``
    with ``clip``; ``variant``: what a variant of them changes (``ours``' other arguments)."""
    settings = dict(stream_grads=True, overlap=True, speculate=True, prefetch=True, bf16_cpu_path=True,
                    max_grad_norm=CLIP if clip else None)
    return ours("offload", **{**settings, **variant})


def gpu_adamw(preset: str, device: torch.device, batch: int) -> Trainer:
    model = llama(preset, torch.float32, device)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    return _plain(model, opt, device, "torch.optim.AdamW(fused=True), fp32 params on the GPU, bf16 autocast")


def run_ahead(spec) -> dict:
    """What the updates run ahead came to since the optimizer was built (``opt.speculation``'s counts)."""
    return {"kept": spec.kept, "undone": spec.undone, "called_off": spec.called_off, "stood_down": spec.stood_down}


def spiked(build: Callable[[str, torch.device, int], Trainer],
           every: int) -> Callable[[str, torch.device, int], Trainer]:
    """``build``'s system with the loss scaled by ``SPIKE`` on every ``every``-th backward (counted from the
    first, warm-up and synchronised phases included, so that ours and its reference spike on the same steps).
    Clipped at ``CLIP``, those steps clip after steps that did not once the memorised batch's norm is under
    it (from its ninth step): gradient spikes, the case where updates run ahead stand down."""
    def build_spiked(preset: str, device: torch.device, batch: int) -> Trainer:
        trainer, count = build(preset, device, batch), itertools.count(1)
        inner = trainer.backward

        def backward(loss: torch.Tensor) -> None:
            inner(loss * SPIKE if next(count) % every == 0 else loss)

        return replace(trainer, backward=backward,
                       settings=f"{trainer.settings}; the loss x{SPIKE:g} in one backward of every {every}")
    return build_spiked


def hovering(build: Callable[[str, torch.device, int], Trainer]) -> Callable[[str, torch.device, int], Trainer]:
    """``build``'s system (clipped) with each loss scaled so that the gradient norm hovers about the clip, as
    fine-tuning at ``max_grad_norm=1.0`` often has it: after each step the next loss's factor is the power of 2
    (exact on bf16 gradients) that would have taken this step's unscaled norm nearest the next aim, drawn
    log-uniform in ``HOVER_AIMS`` (seeded: ours and its reference draw the same, one draw a step); a norm that
    is not finite halves the factor. The factor is worked out on the device from the step's norm tensor, so
    the loop gains no sync; the row's ``hover_factors`` (read at the end) are those each backward took. Each
    system follows its own norms, so ours and its reference may round a factor apart where the aim falls
    between two powers of 2: their ``hover_factors`` say whether they did."""
    def build_hovering(preset: str, device: torch.device, batch: int) -> Trainer:
        trainer = build(preset, device, batch)
        factor, taken, draw = torch.ones((), device=device), [], random.Random(0)
        low, high = (math.log2(a) for a in HOVER_AIMS)
        inner_backward, inner_step, inner_extra = trainer.backward, trainer.step, trainer.extra

        def backward(loss: torch.Tensor) -> None:
            taken.append(factor)
            inner_backward(loss * factor)

        def step() -> None:
            nonlocal factor
            inner_step()
            norm = trainer.grad_norm()
            if norm is None:
                raise ValueError("a hovering system needs the norm of each step's gradients (Trainer.grad_norm): "
                                 "ours records it, the reference only when built with a clip")
            aim = 2.0 ** draw.uniform(low, high)
            with torch.no_grad():
                unscaled = norm.detach().float().to(device) / factor
                nxt = torch.exp2(torch.round(torch.log2(aim / unscaled)))
                ok = torch.isfinite(unscaled) & (unscaled > 0)
                factor = torch.where(ok, nxt, factor / 2).clamp(2.0 ** -24, 2.0 ** 24)

        def extra() -> dict:
            return {**inner_extra(), "hover_factors": [float(f) for f in taken]}

        return replace(trainer, backward=backward, step=step, extra=extra,
                       settings=f"{trainer.settings}; each loss x a power of 2 aiming the norm at "
                                f"{HOVER_AIMS[0]:g}-{HOVER_AIMS[1]:g}, about the clip")
    return build_hovering


def fresh_batches(build: Callable[[str, torch.device, int], Trainer]) -> Callable[[str, torch.device, int], Trainer]:
    """``build``'s system trained on a new batch every step: uniform random tokens of the given batch's shape,
    drawn on the device (no host copy, no sync in the loop) by a generator seeded with ``FRESH_SEED``, so ours
    and its reference draw the same batches. A loss the model cannot memorise keeps the gradient norm near one
    level; on the bench's one batch the loss vanishes within 13 steps and the norm falls and then jumps by
    orders of magnitude (H100 call 181), so a norm aimed from the last step's (``hovering``) lags it."""
    def build_fresh(preset: str, device: torch.device, batch: int) -> Trainer:
        trainer, vocab = build(preset, device, batch), PRESETS[preset][2]
        generator = torch.Generator(device=device).manual_seed(FRESH_SEED)
        inner = trainer.forward

        def forward(ids: torch.Tensor) -> torch.Tensor:
            return inner(torch.randint(0, vocab, ids.shape, device=ids.device, generator=generator))

        return replace(trainer, forward=forward,
                       settings=f"{trainer.settings}; a fresh batch of random tokens each step")
    return build_fresh


def gpu_adamw_bf16_masters(preset: str, device: torch.device, batch: int,
                           max_grad_norm: float | None = None) -> Trainer:
    """Our numerics without offloading: bf16 params and grads, fp32 masters and AdamW states on the GPU.
    The reference that the loss check holds ours to (fp32 params under autocast train differently); with
    ``max_grad_norm``, torch's clip_grad_norm_ on the fp32 grads first."""
    model = llama(preset, torch.bfloat16, device)
    params = list(model.parameters())
    masters = [p.detach().float() for p in params]
    opt = torch.optim.AdamW(masters, lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    norm = [None]

    @torch.no_grad()
    def step():
        for m, p in zip(masters, params):
            m.grad = p.grad.float()
        if max_grad_norm is not None:
            norm[0] = torch.nn.utils.clip_grad_norm_(masters, max_grad_norm, foreach=True)
        opt.step()
        for m, p in zip(masters, params):
            p.copy_(m)
            m.grad, p.grad = None, None

    return Trainer(model, lambda ids: model(input_ids=ids, labels=ids).loss, lambda loss: loss.backward(), step,
                   sum(p.numel() for p in params), settings="torch.optim.AdamW(fused=True) on fp32 master copies "
                   "on the GPU, bf16 params and grads (our numerics, no offload)"
                   + (f", clip_grad_norm_({max_grad_norm})" if max_grad_norm is not None else ""),
                   grad_norm=lambda: norm[0])


def torchao_offload(preset: str, device: torch.device, batch: int) -> Trainer:
    from torchao.optim import CPUOffloadOptimizer

    model = llama(preset, torch.float32, device)
    opt = CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    return _plain(model, opt, device, "torchao CPUOffloadOptimizer(AdamW, fused=True), fp32 params, bf16 autocast")


def fsdp2_offload_model(preset: str, device: torch.device) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """FSDP2 fully_shard per decoder layer and the root over the current process group, with
    CPUOffloadPolicy(pin_memory=True on a GPU), bf16 MixedPrecisionPolicy (fp32 reduce) and torch's fused CPU
    AdamW. Built as FSDP2's docs and torchtitan do for large models: on the meta device, sharded, then each
    rank's shards made on the host (pinned by FSDP2) and initialised; no rank ever holds the whole fp32
    model (built whole on every rank, the 10.6B model's host peak was 230 GB for two ranks, rows before
    2026-11-30's fourteenth session)."""
    from deep_optimizer_states.core.fsdp_api import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    model = llama(preset, torch.float32, "meta")
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    offload = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp, offload_policy=offload)
    fully_shard(model, mp_policy=mp, offload_policy=offload)
    materialize(model, "cpu")  # the shards on the host (FSDP2 pins them)
    model.model.rotary_emb.to(device)  # its buffers (no params) on the GPU, where the forward runs
    return model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)


def fsdp2_offload(preset: str, device: torch.device, batch: int) -> Trainer:
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29512")
    dist.init_process_group("nccl", rank=0, world_size=1)
    model, opt = fsdp2_offload_model(preset, device)
    trainer = _plain(model, opt, device, "FSDP2 fully_shard per layer, CPUOffloadPolicy(pin_memory=True), "
                     "bf16 MixedPrecisionPolicy, fused CPU AdamW")
    trainer.forward = lambda ids: model(input_ids=ids, labels=ids).loss
    return trainer


def deepspeed_zero3(ratio: float) -> Callable[[str, torch.device, int], Trainer]:
    """ZeRO-3 with offload_optimizer to the CPU; ratio < 1 is TwinFlow (that share of states on the CPU)."""
    def build(preset: str, device: torch.device, batch: int) -> Trainer:
        for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29511"), ("RANK", "0"),
                           ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
            os.environ.setdefault(key, value)
        import deepspeed

        config = {"train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
                  "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}},
                  "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True,
                                        "sub_group_size": 100_000_000,
                                        "offload_optimizer": {"device": "cpu", "pin_memory": True,
                                                              "ratio": ratio}},
                  "steps_per_print": 10**9, "wall_clock_breakdown": False}
        with deepspeed.zero.Init(config_dict_or_path=config):
            model = llama(preset, dtype=None, device=None)
        engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
        params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
        settings = (f"DeepSpeed ZeRO-3, offload_optimizer cpu (pin_memory, ratio {ratio}: that share of the "
                    "optimizer states on the CPU, the rest on the GPU), bf16, sub_group_size 1e8, overlap_comm, "
                    "contiguous_gradients")
        return Trainer(engine, lambda ids: engine(input_ids=ids, labels=ids).loss, engine.backward, engine.step,
                       params, settings=settings)
    return build


SYSTEMS: dict[str, Callable[[str, torch.device, int], Trainer]] = {
    "ours_auto": ours("auto"),
    "ours_auto_stream": ours("auto", stream_grads=True),
    "ours_auto_stream_ckpt": ours("auto", stream_grads=True, checkpointing=True),
    "ours_auto_overlap": ours("auto", overlap=True),
    "ours_offload": ours("offload"),
    "ours_offload_overlap": ours("offload", stream_grads=True, overlap=True),
    "ours_offload_clip": ours("offload", max_grad_norm=CLIP),
    "ours_offload_overlap_clip": ours("offload", stream_grads=True, overlap=True, max_grad_norm=CLIP),
    "ours_offload_overlap_prefetch": ours("offload", stream_grads=True, overlap=True, prefetch=True),
    "ours_offload_overlap_clip_prefetch": ours("offload", stream_grads=True, overlap=True, max_grad_norm=CLIP,
                                               prefetch=True),
    "ours_offload_overlap_spec": ours("offload", stream_grads=True, overlap=True, speculate=True),
    "ours_offload_overlap_clip_spec": ours("offload", stream_grads=True, overlap=True, max_grad_norm=CLIP,
                                           speculate=True),
    "ours_offload_overlap_gathered": ours("offload", overlap=True),  # gradients sent at the update, clip on the GPU
    "ours_offload_overlap_clip_gathered": ours("offload", overlap=True, max_grad_norm=CLIP),
    "ours_offload_overlap_bf16": ours("offload", overlap=True, bf16_cpu_path=True),
    "ours_offload_overlap_clip_bf16": ours("offload", overlap=True, max_grad_norm=CLIP, bf16_cpu_path=True),
    "ours_offload_overlap_stream_bf16": ours("offload", stream_grads=True, overlap=True, bf16_cpu_path=True),
    "ours_offload_overlap_stream_clip_bf16": ours("offload", stream_grads=True, overlap=True, max_grad_norm=CLIP,
                                                  bf16_cpu_path=True),
    "ours_offload_overlap_spec_bf16": ours("offload", stream_grads=True, overlap=True, speculate=True,
                                           bf16_cpu_path=True),
    # both halves of the update begun during backward: the CPU path's AdamW and the staged states' way in
    "ours_offload_overlap_spec_prefetch": ours("offload", stream_grads=True, overlap=True, speculate=True,
                                               prefetch=True),
    "ours_offload_overlap_spec_prefetch_bf16": defaults(),
    # fills ahead bounded by the memory alone (the library before 2026-12-02), against the default bound of what
    # the link carries in the rest of the iteration (5.2B, H200 call 46: 95 subgroups filled, a 138 GB peak)
    "ours_offload_overlap_spec_prefetch_bf16_uncapped": defaults(fill_cap=math.inf),
    "ours_offload_overlap_clip_spec_prefetch_bf16_uncapped": defaults(clip=True, fill_cap=math.inf),
    # twice what the link carries in the least rest (calls 51-52: the capped updates wrote their last param
    # 0.19-0.22 s after they began against 0.15-0.16 s uncapped, so the least rest looked conservative at 1.36B)
    "ours_offload_overlap_spec_prefetch_bf16_cap2": defaults(fill_cap=2.0),
    "ours_offload_overlap_clip_spec_prefetch_bf16_cap2": defaults(clip=True, fill_cap=2.0),
    # fills during backward sized by three quarters of the learnt rest: in calls 71-75 the slow 1.36B runs had
    # learnt a longer rest and planned more fills (overlap.md, calls 71-75). Call 76: x1.08 slower than the
    # defaults in the median of 4 rounds (faster in 1), its peak 22-25 GB against their 29-32 GB
    "ours_offload_overlap_spec_prefetch_bf16_cap075": defaults(fill_cap=0.75),
    # the defaults with the bf16 kernel's rounded params written by plain stores (the kernel before H200 call 95,
    # whose streaming stores made the kernel x1.08 faster beside the PCIe copies): what the change gives the
    # iteration, in rounds on one machine (calls 95-99 could not separate it from a faster host)
    "ours_offload_overlap_spec_prefetch_bf16_plainstores": defaults(kernel_defines=("DOS_PLAIN_STORES",)),
    "ours_offload_overlap_clip_spec_prefetch_bf16_plainstores": defaults(clip=True,
                                                                         kernel_defines=("DOS_PLAIN_STORES",)),
    # the defaults with the bf16 kernel giving each of its threads a fixed share of its blocks (the kernel before
    # H200 calls 119-124, whose paired rounds, as `_dynamic`, found the kernel handing out chunks as threads come
    # free x0.969 over 16 rounds, faster in 11; with a second host's 4, calls 125, x0.987 over 20, faster in 12):
    # to time the change again on other hosts
    "ours_offload_overlap_spec_prefetch_bf16_fixedshares": defaults(kernel_defines=("DOS_FIXED_SHARES",)),
    "ours_offload_overlap_clip_spec_prefetch_bf16_fixedshares": defaults(clip=True,
                                                                         kernel_defines=("DOS_FIXED_SHARES",)),
    # the defaults with the CUDA caching allocator's expandable segments: the subgroups filled during backward (a
    # fresh 16 B/element slot each then, 12 B since calls 146-150, from the stream forward's activations also take
    # blocks from) go with backward's host seconds at 1.36B within each set of rows since call 84 (overlap.md calls
    # 119-124; the cause may run the other way). Timed in H200 calls 128-129, where the defaults' rows counted 19-34
    # new segments in each timed loop: x1.042 in the median of 7 paired rounds, faster in 3; not kept
    "ours_offload_overlap_spec_prefetch_bf16_expandable": defaults(allocator="expandable_segments:True"),
    # the defaults with blocks over 256 MB never split by the CUDA caching allocator: a 400 MB slot freed after an
    # update (16 B x 25M elements at 1.36B; 300 MB at 12 B since calls 146-150) then stays whole for the next fill,
    # instead of being split by the next forward's activations, which would send the fill to the driver for a new
    # segment (the defaults' 19-34 new segments per timed loop, calls 125-129); to pair with the defaults over a long
    # timed loop
    "ours_offload_overlap_spec_prefetch_bf16_maxsplit": defaults(allocator="max_split_size_mb:256"),
    # the defaults with each slot filled ahead released at its flush (prefetch="release"), not at the
    # update's end, which is during the next forward: at 1.36B the peak went with the need measured over forward
    # and backward (r = 0.96-0.98 over calls 119-129's runs, 19-29 GB), which the last update's fills, 8-20
    # slots of 400 MB held into that forward, may swell. Calls 131 and 137 (6 rounds against the defaults, two
    # machines): peak 44.35 -> 28.47 and 45.14 -> 28.87 GB, the iteration x1.069, faster in 1 of 6
    "ours_offload_overlap_spec_prefetch_bf16_release": defaults(prefetch="release"),
    "ours_offload_overlap_clip_spec_prefetch_bf16_release": defaults(clip=True, prefetch="release"),
    # the defaults with the fills during backward bounded by what the link carries in backward's span of final
    # gradients where shorter than the learnt rest (plan.FILLS_WITHIN_BACKWARD): in the synchronised phases the
    # rest rose from 0.105-0.149 to 0.35-0.49 s with the fills, and the plan from 24 to 39-40 of 55 staged, while
    # a loop free from its first step learnt 0.08-0.16 s (calls 142-145). The defaults since calls 146-150, where
    # these names ran beside the defaults of then; `_restfills`: the fills sized by the learnt rest alone (before)
    "ours_offload_overlap_spec_prefetch_bf16_bwdfills": defaults(fills_within_backward=True),
    "ours_offload_overlap_clip_spec_prefetch_bf16_bwdfills": defaults(clip=True, fills_within_backward=True),
    "ours_offload_overlap_spec_prefetch_bf16_restfills": defaults(fills_within_backward=False),
    # clipped, with updates run ahead on the step after a clipped one too (optimizer.SIT_OUT_AFTER_CLIP off):
    # since the updates ahead stand down once the norm landed passes the clip's, a step that clips costs those
    # that started before; the default sits such steps out. The timed loop from the third step has 5 steps the
    # clip scales (norms over 1.0 for the first 8) and 2 after them that the default runs nothing ahead in
    # (overlap.md calls 159-162). Calls 163-164 (one H100): 43-54 updates undone, means 0.441 and 0.410 s against
    # the default's 0.374 s; not the default
    "ours_offload_overlap_clip_spec_prefetch_bf16_nositout": defaults(clip=True, sit_out=False),
    # clipped, with gradient spikes (the loss x1024 in every 4th backward): from the ninth step each spike clips
    # after steps that did not, with updates run ahead that stand down once the norm landed passes the clip's
    # (the default) or, `_nostanddown`, run and are undone (the library before the fifty-third session); the
    # loss check against `gpu_adamw_bf16_masters_clip_spikes`. H100 calls 169-170 (one machine, 2 pairs): the
    # spikes' steps 0.298-0.349 s standing down (71 stood down) against 0.511-0.573 s undone (80 undone)
    "ours_offload_overlap_clip_spec_prefetch_bf16_spikes": spiked(defaults(clip=True), SPIKE_EVERY),
    "ours_offload_overlap_clip_spec_prefetch_bf16_spikes_nostanddown": spiked(defaults(clip=True, stand_down=False),
                                                                              SPIKE_EVERY),
    # clipped, updates run ahead on every step (no pause after a clip), standing down once the norm landed, over
    # the share of the last step's norm landed by then, passes the clip's (optimizer.STAND_DOWN = "forecast"):
    # a lasting clip stands every one down from the first, the step after a spike runs them. H100 calls 172-173
    # (4 rounds, 2 machines): the two walls after each spike 0.003-0.060 s shorter, the iteration not told apart
    # from the default's; not the default
    "ours_offload_overlap_clip_spec_prefetch_bf16_forecast": defaults(clip=True, stand_down="forecast", sit_out=False),
    "ours_offload_overlap_clip_spec_prefetch_bf16_spikes_forecast": spiked(
        defaults(clip=True, stand_down="forecast", sit_out=False), SPIKE_EVERY),
    # clipped, the norm hovering about the clip (`hovering`: the loss scaled step by step), as fine-tuning at
    # max_grad_norm=1.0 often has it: the default pauses after each clip and undoes what ran ahead before the
    # norm landed passed it; the forecast runs ahead on every step, and a forecast of the clip is likeliest
    # wrong where the norm keeps near it. Loss check against
    # `gpu_adamw_bf16_masters_clip_hover`
    "ours_offload_overlap_clip_spec_prefetch_bf16_hover": hovering(defaults(clip=True)),
    "ours_offload_overlap_clip_spec_prefetch_bf16_hover_forecast": hovering(
        defaults(clip=True, stand_down="forecast", sit_out=False)),
    # H100 call 181: on the bench's one batch the clip scaled only 3-5 of 24 timed steps (the loss vanishes and
    # the norm runs away from its aim); with a fresh batch each step the norm keeps near its level (not run on a
    # GPU yet). Loss check against `gpu_adamw_bf16_masters_clip_hover_fresh`
    "ours_offload_overlap_clip_spec_prefetch_bf16_hover_fresh": hovering(fresh_batches(defaults(clip=True))),
    "ours_offload_overlap_clip_spec_prefetch_bf16_hover_fresh_forecast": hovering(fresh_batches(
        defaults(clip=True, stand_down="forecast", sit_out=False))),
    # the defaults with the model's activation checkpointing (transformers' non-reentrant one), for budgets below
    # what forward and backward need without it: at a 16 GB budget (DeepSpeed ZeRO-3 offload's peak at 1.36B is
    # 14.7 GB) the defaults ran out of memory at 1.36B (H200 call 150), the need they learnt at the whole device
    # 18.2-19.7 GB
    "ours_offload_overlap_spec_prefetch_bf16_ckpt": defaults(checkpointing=True),
    # every flush in the update's order (the library before H200 call 64, and the defaults of calls 68-70). The
    # defaults since call 70 (the flushes filled ahead last, the CPU path's params up by the copy engine) ran as
    # `_ce` in call 64; the rows named `_mapped` (calls 63-73) took those params up through a kernel reading the
    # host memory's mapping, taken out after call 73 (slower in 10 of 15 pairs: overlap.md)
    "ours_offload_overlap_spec_prefetch_bf16_ce_inorder": defaults(flush_ahead_last=False),
    "ours_offload_overlap_clip_spec_prefetch_bf16_ce_inorder": defaults(clip=True, flush_ahead_last=False),
    "ours_offload_overlap_stream_clip_prefetch_bf16_ce_inorder": ours("offload", stream_grads=True, overlap=True,
                                                                      max_grad_norm=CLIP, prefetch=True,
                                                                      bf16_cpu_path=True,
                                                                      flush_ahead_last=False),
    # the defaults with a global norm computed every step that never clips (max_grad_norm=1e9): the unclipped
    # trajectory on the clipped code path. Clipped at 1.0 the 1.36B run came out faster than unclipped in 13 of 20
    # same-call pairs (calls 44-84): is it the code path or the (converged) trajectory? Call 85: slower than the
    # defaults in 2 of 2 rounds (0.295 / 0.318 against 0.283 / 0.305 s), so not the norm's code
    "ours_offload_overlap_normed_spec_prefetch_bf16": ours("offload", stream_grads=True, overlap=True,
                                                           max_grad_norm=1e9, speculate=True, prefetch=True,
                                                           bf16_cpu_path=True),
    # 32 spares instead of 16 (12 B per element each, pageable): whether the spares or the CPU limit what
    # runs ahead (H200 call 16: about 12 kept and 4 called off of 16 per step)
    "ours_offload_overlap_spec32_bf16": ours("offload", stream_grads=True, overlap=True, speculate=32,
                                             bf16_cpu_path=True),
    # half the default subgroup (12.5M elements): a shorter pipeline fill and drain around each lane, finer
    # run-ahead, against more per-subgroup launches (1.36B, H200 call 19: the update took 0.034 s more than
    # its busiest lane)
    "ours_offload_overlap_spec_bf16_sg12": ours("offload", stream_grads=True, overlap=True, speculate=True,
                                                bf16_cpu_path=True, subgroup_size=12_500_000),
    "ours_offload_overlap_spec_prefetch_bf16_sg12": defaults(subgroup_size=12_500_000),
    "ours_offload_overlap_clip_gathered_sg12": ours("offload", overlap=True, max_grad_norm=CLIP,
                                                    subgroup_size=12_500_000),
    # a quarter of the threads (4 of 16 cores) left to backward while an update runs ahead, against the
    # default one (H200 call 25 ran the default at a quarter and this twin, then named _launch1, at 1/16)
    "ours_offload_overlap_spec_bf16_launch4": ours("offload", stream_grads=True, overlap=True, speculate=True,
                                                   bf16_cpu_path=True, launch_share=0.25),
    # fixed shares of the subgroups staged, with and without prefetch (1.36B has 55 subgroups; "offload"
    # staged 22-27 of them in calls 24-28, before the model priced the fills during backward)
    "ours_offload_overlap_spec_prefetch_bf16_s50": defaults(staged_share=0.5),
    # 26 and 30 of 55 at 1.36B: the two splits the model settled on in calls 105-108 (one machine, 0.294-0.307 s
    # against 0.301-0.334 s), fixed, to pair in rounds: does the split make the difference, or the run? The run:
    # the fixed 26 won both rounds on machine F, one of two on G (calls 110, 113)
    "ours_offload_overlap_spec_prefetch_bf16_s47": defaults(staged_share=0.47),
    "ours_offload_overlap_spec_prefetch_bf16_s55": defaults(staged_share=0.55),
    # 22 of 55: fewer still, where call 110's rounds pointed (26 faster than 29 and 30 in both on machine F);
    # call 113 on machine G: the model's split the best median of the three (overlap.md, calls 109-115)
    "ours_offload_overlap_spec_prefetch_bf16_s40": defaults(staged_share=0.4),
    "ours_offload_overlap_spec_prefetch_bf16_s60": defaults(staged_share=0.6),
    "ours_offload_overlap_spec_prefetch_bf16_s70": defaults(staged_share=0.7),
    "ours_offload_overlap_stream_clip_prefetch_bf16_s50": ours("offload", stream_grads=True, overlap=True,
                                                               max_grad_norm=CLIP, prefetch=True, bf16_cpu_path=True,
                                                               staged_share=0.5),
    "ours_offload_overlap_stream_clip_prefetch_bf16": ours("offload", stream_grads=True, overlap=True,
                                                           max_grad_norm=CLIP, prefetch=True, bf16_cpu_path=True),
    "ours_offload_overlap_stream_clip_prefetch_bf16_s60": ours("offload", stream_grads=True, overlap=True,
                                                               max_grad_norm=CLIP, prefetch=True, bf16_cpu_path=True,
                                                               staged_share=0.6),
    # the same split as a user would ask for it: schedule=2 stages every other subgroup (28 of 55 at 1.36B)
    "ours_k2_overlap_spec_prefetch_bf16": ours(2, stream_grads=True, overlap=True, speculate=True, prefetch=True,
                                               bf16_cpu_path=True),
    # clipped, with the CPU path's update run ahead: kept on the steps the norm stays under max_grad_norm
    "ours_offload_overlap_clip_spec_prefetch_bf16": defaults(clip=True),
    "ours_k2_overlap_stream_clip_prefetch_bf16": ours(2, stream_grads=True, overlap=True, max_grad_norm=CLIP,
                                                      prefetch=True, bf16_cpu_path=True),
    "ours_offload_overlap_spec_bf16_s50": ours("offload", stream_grads=True, overlap=True, speculate=True,
                                               bf16_cpu_path=True, staged_share=0.5),
    "ours_offload_overlap_spec_bf16_s40": ours("offload", stream_grads=True, overlap=True, speculate=True,
                                               bf16_cpu_path=True, staged_share=0.4),
    "ours_offload_overlap_t8": ours("offload", stream_grads=True, overlap=True, path_threads=8),
    "ours_offload_overlap_t4": ours("offload", stream_grads=True, overlap=True, path_threads=4),
    "ours_offload_overlap_spare": ours("offload", stream_grads=True, overlap=True, spare_cores=1),
    "ours_offload_overlap_clip_spare": ours("offload", stream_grads=True, overlap=True, max_grad_norm=CLIP,
                                            spare_cores=1),
    "ours_cpu": ours("cpu"),
    "ours_gpu": ours("gpu"),
    "deepspeed_zero3_offload": deepspeed_zero3(1.0),
    "twinflow_0.25": deepspeed_zero3(0.25),
    "twinflow_0.5": deepspeed_zero3(0.5),
    "twinflow_0.75": deepspeed_zero3(0.75),
    "torchao_offload": torchao_offload,
    "fsdp2_offload": fsdp2_offload,
    "gpu_adamw": gpu_adamw,
    "gpu_adamw_bf16_masters": gpu_adamw_bf16_masters,
    "gpu_adamw_bf16_masters_clip": functools.partial(gpu_adamw_bf16_masters, max_grad_norm=CLIP),
    "gpu_adamw_bf16_masters_clip_spikes": spiked(functools.partial(gpu_adamw_bf16_masters, max_grad_norm=CLIP),
                                                 SPIKE_EVERY),
    "gpu_adamw_bf16_masters_clip_hover": hovering(functools.partial(gpu_adamw_bf16_masters, max_grad_norm=CLIP)),
    "gpu_adamw_bf16_masters_clip_hover_fresh": hovering(fresh_batches(
        functools.partial(gpu_adamw_bf16_masters, max_grad_norm=CLIP))),
}
OURS = "ours_auto"
REFERENCE = "gpu_adamw_bf16_masters"  # the loss check's reference: the same numerics as ours

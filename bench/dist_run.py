"""Time one data-parallel system on every rank of one host; rank 0 prints one ``RESULT {json}`` line.

    torchrun --standalone --nproc_per_node 2 -m bench.dist_run --system ours --model 5.2b

Systems, each with every optimizer state on the host:
  ours            FSDP2 fully_shard per decoder layer and the root, bf16 sharded params and grads on the GPU,
                  DeepOptimizerStates(schedule="offload") over each rank's shards (fp32 states pinned on the
                  host; the calibrated model splits them between the CPU and staging)
  ours_auto       the same with schedule="auto": states that fit in the GPU memory stay resident there
  ours_stream     "ours" with stream_grads=True: the CPU path's gradient shards go to the host during backward
  ours_overlap    "ours_stream" with overlap=True: the update runs on beside the next forward's all-gathers
  ours_prefetch   "ours_overlap" with prefetch=True: staged subgroups' states come in during backward
  ours_spec       "ours_overlap" with speculate=True: the CPU path's update runs ahead during backward
  ours_bf16       "ours" with overlap=True and bf16_cpu_path=True: gradients sent at the update, the CPU
                  path's in bf16, its params up in bf16 (our kernel)
  ours_overlap_bf16  "ours_overlap" with bf16_cpu_path=True: the CPU path's gradients streamed in bf16
  ours_spec_prefetch  "ours_overlap" with speculate=True and prefetch=True: both halves begun in backward
  ours_spec_bf16  "ours_spec" with bf16_cpu_path=True (the best single-H200 system at 5.2B)
  ours_spec32     "ours_spec" with speculate=32 spares (at 10.6B all 16 default ones were kept every step)
  fsdp2_offload   FSDP2 fully_shard + CPUOffloadPolicy(pin_memory=True), bf16 MixedPrecisionPolicy (fp32
                  reduce), torch's fused CPU AdamW
  deepspeed       DeepSpeed ZeRO-3 with offload_optimizer cpu (pin_memory), bf16, overlap_comm
Ours and the FSDP2 peer build the model on the meta device and draw each rank's shards the same way
(``tools/models.py`` ``materialize``, seed 0), so they start from the same weights and their losses can be
compared step by step (rows before 2026-11-30's fourteenth session started from different draws).
Every rank trains its own micro-batch (4 x 1024 by default). Phases are timed with a device synchronize and a
barrier around each (inside the time), so a phase ends when the slowest rank ends it; then as many
iterations run as a training loop runs them (only the loss read synchronises): ``iter_s`` is the slowest
rank's median wall time of those, ``iter_mean_s`` the slowest rank's mean (an update left running past
``step()`` would hide in a synchronize outside the timers). Aggregate update throughput: the model's params over the engine's own update time
(ours; the rows before 2026-11-30's third session used the step phase) or the step phase (peers). Under
speculate the engine's time leaves out the CPU work done during backward: ours' rows keep rank 0's elements
of it per step (``updates_speculated_elements``, since the seventeenth session) and the staged subgroups of
each update (``updates_staged``, since the eighteenth: the plan's moves).
Thread counts: torchrun sets OMP_NUM_THREADS=1; the peers are given what their docs recommend (set
OMP_NUM_THREADS to cores / local ranks when launching), ours sets its own (cores / local ranks).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from bench.free_loop import free_running
from bench.run_system import RESULT, _host_peak_gb, _is_oom, batch
from deep_optimizer_states.tools.models import PRESETS, llama, materialize

LR, WEIGHT_DECAY = 1e-4, 0.01


STAGING_SLOTS = 2  # --slots


def _ours(preset: str, device: torch.device, micro_batch: int, schedule: str = "offload", stream: bool = False,
          overlap: bool = False, prefetch: bool = False, speculate: bool | int = False, bf16: bool = False):
    from deep_optimizer_states.core.fsdp_api import fully_shard

    from deep_optimizer_states import DeepOptimizerStates, Placement

    model = llama(preset, torch.bfloat16, "meta")  # as the FSDP2 peer: the same model, made shard by shard
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    materialize(model, device)
    opt = DeepOptimizerStates(model, lr=LR, weight_decay=WEIGHT_DECAY, schedule=schedule, staging_slots=STAGING_SLOTS,
                              stream_grads=stream, overlap=overlap, prefetch=prefetch, speculate=speculate,
                              bf16_cpu_path=bf16)

    def extra() -> dict:
        opt.synchronize()
        u, plan = opt.last_update, opt.plan
        return {"update_s": u.seconds, "staged_subgroups": u.staged_subgroups, "subgroups": len(opt.layout.subgroups),
                "resident_subgroups": plan.placements.count(Placement.RESIDENT),
                "predicted_update_s": plan.prediction and round(plan.prediction.seconds, 4),
                "rates": opt.planner.known_rates() and opt.planner.known_rates().as_dict(),
                "pinned_host_GB_per_rank": opt.layout.bytes()["host"] / 1e9, "cpu_threads": torch.get_num_threads(),
                "staging_slots": opt.plan.slots, "prefetched": u.prefetched, "speculated": u.speculated,
                "bf16_kernel": opt.engine.bf16_kernel is not None,
                "run_ahead": None if opt.speculation is None else {
                    "kept": opt.speculation.kept, "undone": opt.speculation.undone,
                    "called_off": opt.speculation.called_off}}

    where = "fp32 states pinned on the host" if schedule == "offload" else "fp32 states resident where they fit"
    settings = ("FSDP2 fully_shard per layer + root, bf16 sharded params/grads on the GPU, "
                f"DeepOptimizerStates(schedule={schedule!r}, stream_grads={stream}, overlap={overlap}, "
                f"prefetch={prefetch}, speculate={speculate}, bf16_cpu_path={bf16}) over each rank's shards, {where}")
    return model, lambda ids: model(input_ids=ids, labels=ids).loss, lambda loss: loss.backward(), opt, extra, settings


def _ours_auto(preset: str, device: torch.device, micro_batch: int):
    return _ours(preset, device, micro_batch, "auto")


def _ours_stream(preset: str, device: torch.device, micro_batch: int):
    return _ours(preset, device, micro_batch, "offload", stream=True)


def _ours_overlap(preset: str, device: torch.device, micro_batch: int):
    return _ours(preset, device, micro_batch, "offload", stream=True, overlap=True)


def _ours_prefetch(preset: str, device: torch.device, micro_batch: int):
    return _ours(preset, device, micro_batch, "offload", stream=True, overlap=True, prefetch=True)


def _ours_spec(preset: str, device: torch.device, micro_batch: int):
    return _ours(preset, device, micro_batch, "offload", stream=True, overlap=True, speculate=True)


def _ours_bf16(preset: str, device: torch.device, micro_batch: int):
    return _ours(preset, device, micro_batch, "offload", overlap=True, bf16=True)


def _ours_overlap_bf16(preset: str, device: torch.device, micro_batch: int):
    return _ours(preset, device, micro_batch, "offload", stream=True, overlap=True, bf16=True)


def _ours_spec_prefetch(preset: str, device: torch.device, micro_batch: int):
    return _ours(preset, device, micro_batch, "offload", stream=True, overlap=True, speculate=True, prefetch=True)


def _ours_spec_bf16(preset: str, device: torch.device, micro_batch: int):
    return _ours(preset, device, micro_batch, "offload", stream=True, overlap=True, speculate=True, bf16=True)


def _ours_spec32(preset: str, device: torch.device, micro_batch: int):
    return _ours(preset, device, micro_batch, "offload", stream=True, overlap=True, speculate=32)


def _fsdp2_offload(preset: str, device: torch.device, micro_batch: int):
    from bench.systems import fsdp2_offload_model

    model, opt = fsdp2_offload_model(preset, device)
    settings = ("FSDP2 fully_shard per layer + root, CPUOffloadPolicy(pin_memory=True), bf16 MixedPrecisionPolicy "
                "(fp32 reduce), torch.optim.AdamW(fused=True) on the host")
    return (model, lambda ids: model(input_ids=ids, labels=ids).loss, lambda loss: loss.backward(), opt,
            lambda: {"cpu_threads": torch.get_num_threads()}, settings)


def _deepspeed(preset: str, device: torch.device, micro_batch: int):
    import deepspeed

    config = {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": 1,
              "bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}},
              "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True,
                                    "sub_group_size": 100_000_000,
                                    "offload_optimizer": {"device": "cpu", "pin_memory": True}},
              "steps_per_print": 10**9, "wall_clock_breakdown": False}
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = llama(preset, dtype=None, device=None)
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())

    class Step:
        def step(self) -> None:
            engine.step()

        def zero_grad(self) -> None:
            pass

    settings = ("DeepSpeed ZeRO-3, offload_optimizer cpu (pin_memory), bf16, sub_group_size 1e8, overlap_comm, "
                "contiguous_gradients; DeepSpeedCPUAdam")
    return (engine, lambda ids: engine(input_ids=ids, labels=ids).loss, engine.backward, Step(),
            lambda: {"omp_threads": os.environ.get("OMP_NUM_THREADS")}, settings)


SYSTEMS = {"ours": _ours, "ours_auto": _ours_auto, "ours_stream": _ours_stream, "ours_overlap": _ours_overlap,
           "ours_prefetch": _ours_prefetch, "ours_spec": _ours_spec, "ours_bf16": _ours_bf16,
           "ours_overlap_bf16": _ours_overlap_bf16, "ours_spec_prefetch": _ours_spec_prefetch,
           "ours_spec_bf16": _ours_spec_bf16, "ours_spec32": _ours_spec32,
           "fsdp2_offload": _fsdp2_offload, "deepspeed": _deepspeed}


def _phase(device: torch.device, fn):
    t = time.perf_counter()
    torch.cuda.synchronize(device)
    dist.barrier()
    out = fn()
    torch.cuda.synchronize(device)
    dist.barrier()
    return out, time.perf_counter() - t


def _gathered(value: float) -> list[float]:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def run(system: str, preset: str, iters: int, warmup: int, micro_batch: int, seq: int,
        sweep: list[str] = ()) -> dict:
    world = dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    hidden, layers, vocab = PRESETS[preset]
    row = {"system": system, "model": preset, "ranks": world, "gpu": torch.cuda.get_device_name(device),
           "torch": torch.__version__, "micro_batch_per_rank": micro_batch, "seq": seq, "hidden": hidden,
           "layers": layers, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")}
    try:
        t0 = time.perf_counter()
        model, forward, backward, opt, extra, settings = SYSTEMS[system](preset, device, micro_batch)
        torch.cuda.synchronize(device)
        dist.barrier()
        params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
        row.update(setup_s=round(time.perf_counter() - t0, 2), params=params, settings=settings)
        ids = batch(micro_batch, seq, vocab, device)
        phases, losses, updates, ahead, staged = [], [], [], [], []

        def step() -> None:
            opt.step()
            finished = getattr(opt, "last_update", None)  # ours: the newest finished update (overlap: the last step's)
            if finished is not None:
                updates.append(round(finished.seconds, 4))
                ahead.append(finished.speculated_elements)  # CPU work done during backward: not in its seconds
                staged.append(finished.staged_subgroups)  # the plan it ran: where "auto"/"offload" moved
            opt.zero_grad()

        def iteration() -> None:
            loss, fwd = _phase(device, lambda: forward(ids))
            _, bwd = _phase(device, lambda: backward(loss))
            _, upd = _phase(device, step)
            losses.append(loss.item())
            phases.append((fwd, bwd, upd))

        for _ in range(warmup + iters):
            iteration()
        torch.cuda.synchronize(device)
        dist.barrier()
        first_wall, walls, splits, more = free_running(lambda: forward(ids), backward, step, iters)
        losses += more
        measured = sorted(phases[warmup:], key=sum)
        fwd, bwd, step_s = measured[len(measured) // 2]
        peak = _gathered(torch.cuda.max_memory_allocated(device) / 1e9)
        info = extra()
        update_s = info.get("update_s") or step_s  # ours: the engine's own time (a step may return before it)
        row.update(status="ok", fwd_s=round(fwd, 4), bwd_s=round(bwd, 4), step_s=round(step_s, 4),
                   iter_s=round(max(_gathered(statistics.median(walls))), 4),
                   iter_mean_s=round(max(_gathered(statistics.fmean(walls))), 4), iter_walls_s=[round(w, 4) for w in walls],
                   first_wall_s=round(first_wall, 4), walls_split_s=splits,
                   iter_phases_s=round(fwd + bwd + step_s, 4),
                   aggregate_update_Gparams_per_s=round(params / update_s / 1e9, 3), losses=list(losses),
                   peak_gpu_GB_per_rank=round(max(peak), 2), **info)
        if len(updates) > warmup + 1:  # ours: every step's finished update, and the median past the warm-up
            median = statistics.median(updates[warmup + 1:])
            row.update(updates_s=updates, update_median_s=round(median, 4),
                       aggregate_update_median_Gparams_per_s=round(params / median / 1e9, 3),
                       updates_speculated_elements=ahead, updates_staged=staged)
        row["sweep"] = {}
        for entry in sweep:  # the same job, other schedules (and CPU threads): where the chosen one stands
            schedule, _, threads = str(entry).partition("@")
            opt.schedule = int(schedule) if schedule.isdigit() else schedule
            if threads:
                opt.engine.set_cpu_threads(int(threads))
            updates = []
            for _ in range(3):
                iteration()
                opt.synchronize()
                updates.append(opt.last_update.seconds)
            row["sweep"][str(entry)] = {"update_s": round(statistics.median(updates[1:]), 4),
                                        "staged_subgroups": opt.last_update.staged_subgroups,
                                        "cpu_threads": opt.engine.cpu_threads(),
                                        "predicted_update_s": opt.plan.prediction and
                                        round(opt.plan.prediction.seconds, 4)}
    except Exception as e:  # a system that cannot run is a result too
        import traceback

        row.update(status="oom" if _is_oom(e) else "error", error=f"{type(e).__name__}: {e}"[:800],
                   traceback=traceback.format_exc()[-2000:])
    host = _gathered(_host_peak_gb() or 0.0)
    row["host_peak_GB_all_ranks"] = round(sum(host), 2)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--system", required=True, choices=sorted(SYSTEMS))
    parser.add_argument("--model", default="5.2b", choices=sorted(PRESETS))
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--slots", type=int, default=2, help="ours: staging_slots")
    parser.add_argument("--sweep", default="", help="ours: schedules to time after the run, each with the CPU "
                        "path's threads after @ if given, e.g. cpu,gpu,3,3@8,offload@4")
    args = parser.parse_args(argv)
    sweep = [t for t in args.sweep.split(",") if t]
    global STAGING_SLOTS
    STAGING_SLOTS = args.slots
    dist.init_process_group("nccl")
    try:
        row = run(args.system, args.model, args.iters, args.warmup, args.micro_batch, args.seq, sweep)
        if dist.get_rank() == 0:
            print(RESULT + json.dumps(row), flush=True)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

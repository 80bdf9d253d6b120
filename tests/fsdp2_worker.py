"""One rank of the FSDP2 tests (launched by tests/test_fsdp2.py with torchrun on gloo, CPU).

Modes:
  train  FSDP2 + DeepOptimizerStates against a single-process torch.optim.AdamW on the whole model, step
         by step (fp32, clipping, two micro-batches per step, shards of uneven size).
  save   train, save a DCP checkpoint (and a single-process state_dict from rank 0), train on; rank 0 writes
         the final full params.
  load   load that DCP checkpoint on another number of ranks, train on; rank 0 writes the final full params.
  mixed_precision  fp32 shards, bf16 compute, fp32 reduce (MixedPrecisionPolicy) against torch AdamW on a twin.
  nonfinite  an inf in one rank's gradients: every rank skips that step, then all follow torch AdamW.
  overlap  overlap=True against the same optimizer without, bit for bit at every step (losses, shards and
         states), with every AdamW call slowed down so that the next forward's all-gathers must wait.
  calibrate  every rank plans together (RankSync): a stored calibration on some ranks only must not split
         them; writes each rank's rates and how many barriers it passed to --out, as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh

from deep_optimizer_states import DeepOptimizerStates
from deep_optimizer_states import optimizer as optimizer_module
from deep_optimizer_states.core.fsdp_api import MixedPrecisionPolicy, fully_shard

ROWS = 6  # rows of one global micro-batch: divisible by 1, 2 and 3 ranks
MICRO = 2
LR, WD, MAX_NORM = 3e-3, 0.1, 0.05


DEVICE = torch.device("cpu")


def make_model() -> nn.Module:
    torch.manual_seed(0)  # odd sizes: shards are uneven on 2 and 3 ranks
    return nn.Sequential(nn.Linear(13, 29), nn.GELU(), nn.LayerNorm(29), nn.Linear(29, 31), nn.GELU(),
                         nn.Linear(31, 5)).to(DEVICE)


def shard(model: nn.Module, **kwargs) -> nn.Module:
    mesh = init_device_mesh(DEVICE.type, (dist.get_world_size(),))
    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    return model


def batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + micro)
    return torch.randn(ROWS, 13, generator=gen).to(DEVICE), torch.randn(ROWS, 5, generator=gen).to(DEVICE)


def my_rows(t: torch.Tensor) -> torch.Tensor:
    n, r = dist.get_world_size(), dist.get_rank()
    return t[r * ROWS // n : (r + 1) * ROWS // n]


def train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int, sharded: bool) -> None:
    opt.zero_grad()
    for micro in range(MICRO):
        x, y = batch(step, micro)
        if sharded:
            x, y = my_rows(x), my_rows(y)
        last = micro == MICRO - 1
        with opt.accumulating() if isinstance(opt, DeepOptimizerStates) and not last else contextlib.nullcontext():
            ((model(x) - y).pow(2).mean() / MICRO).backward()
    if not sharded:
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    opt.step()


def full_params(model: nn.Module) -> list[torch.Tensor]:
    return [p.full_tensor().detach().cpu().clone() for p in model.parameters()]


def write_final(model: nn.Module, out: str, what: str) -> None:
    final = full_params(model)  # collective: every rank takes part
    if dist.get_rank() == 0:
        torch.save(final, os.path.join(out, f"{what}_{dist.get_world_size()}.pt"))


def ours(model: nn.Module, schedule, stream: bool = False, overlap: bool = False,
         subgroup_size: int = 97, fill_ahead: bool = False, speculate: bool = False) -> DeepOptimizerStates:
    """Our optimizer on the shards; schedule "mixed": resident, staged and CPU subgroups in turn;
    ``fill_ahead``: prefetch=True with room for every staged subgroup (no GPU budget to read here)."""
    opt = DeepOptimizerStates(model, lr=LR, weight_decay=WD, subgroup_size=subgroup_size, max_grad_norm=MAX_NORM,
                              schedule="cpu" if schedule == "mixed" else schedule, stream_grads=stream,
                              overlap=overlap, prefetch=fill_ahead, speculate=speculate)
    if fill_ahead:
        opt.planner.room_ahead = lambda resident_bytes, ahead_bytes: 1 << 40
    if schedule == "mixed":
        opt.schedule = [("resident", "staged", "cpu")[i % 3] for i in range(len(opt.layout.subgroups))]
    return opt


def train_mode(steps: int, schedule, stream: bool, fill_ahead: bool = False, speculate: bool = False,
               peer: bool = False) -> None:
    """With ``stream``, a second sharded copy trains without stream_grads beside it: the two must agree bit
    for bit (the streamed gradients and their norms take the same fp32 operations); with ``fill_ahead``
    the first also fills its staged subgroups' slots during backward, with ``speculate`` it runs its CPU
    subgroups' updates ahead; with ``peer`` (run unclipped) the same sharded model under FSDP2's usual
    optimizer, torch's fused AdamW over the DTensor shards, must agree with ours bit for bit."""
    ref = make_model()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD, fused=True)
    model = shard(make_model())
    opt = ours(model, schedule, stream, fill_ahead=fill_ahead, speculate=speculate)
    filled = 0
    twin = shard(make_model()) if stream else None
    twin_opt = ours(twin, schedule) if stream else None
    peer_model = shard(make_model()) if peer else None
    peer_opt = torch.optim.AdamW(peer_model.parameters(), lr=LR, weight_decay=WD, fused=True) if peer else None
    for step in range(steps):
        train_step(model, opt, step, sharded=True)
        filled += opt.last_update.prefetched
        train_step(ref, ref_opt, step, sharded=False)
        for (name, p), want in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.full_tensor(), want.detach(), rtol=2e-5, atol=2e-6,
                                       msg=lambda m: f"step {step}, {name}: {m}")
        if peer:
            train_step(peer_model, peer_opt, step, sharded=True)
            for (name, a), b in zip(model.named_parameters(), peer_model.parameters()):
                assert torch.equal(a.to_local(), b.to_local()), f"step {step}, {name}: not FSDP2 + torch AdamW's bits"
        if stream:
            train_step(twin, twin_opt, step, sharded=True)
            assert all(torch.equal(a.to_local(), b.to_local()) for a, b in zip(model.parameters(), twin.parameters()))
            assert opt.last_grad_norm.item() == twin_opt.last_grad_norm.item()
    if speculate:
        spec = opt.speculation
        assert spec.kept + spec.undone + spec.stood_down > 0, "no update ran ahead or stood down"
        print(f"rank {dist.get_rank()}: {spec.kept} updates run ahead and kept, {spec.undone} undone, "
              f"{spec.stood_down} stood down", flush=True)
    if peer:
        print(f"rank {dist.get_rank()}: equal FSDP2 + torch AdamW bit for bit", flush=True)
    if fill_ahead:
        assert filled > 0, "no staged subgroup was filled ahead"
        print(f"rank {dist.get_rank()}: {filled} staged subgroups filled during backward", flush=True)
    if stream:
        assert opt.grad_stream.sent > 0, "gradients were streamed during backward"
        print(f"rank {dist.get_rank()}: streamed {opt.grad_stream.sent} subgroups, equal bit for bit", flush=True)
    local = [p.to_local().numel() for p in model.parameters()]
    print(f"rank {dist.get_rank()}: {steps} steps equal torch AdamW; local shard sizes {local}", flush=True)


def bf16_path_mode(steps: int, schedule, stream: bool) -> None:
    """bf16 params sharded by FSDP2: ours with bf16_cpu_path=True (bf16 gradient shards down, the bf16
    kernel, bf16 params up) against a twin with the fp32 path, bit for bit at every step, clipped."""
    if os.environ.get("DOS_TEST_NO_KERNEL_ON_RANK") == str(dist.get_rank()):
        from deep_optimizer_states.core import cpu_adamw

        cpu_adamw.load = lambda: None  # as if the build had failed here
    models = [shard(make_model().to(torch.bfloat16)) for _ in range(2)]
    opts = [DeepOptimizerStates(m, lr=LR, weight_decay=WD, subgroup_size=97, max_grad_norm=MAX_NORM,
                                schedule="cpu" if schedule == "mixed" else schedule, stream_grads=stream,
                                bf16_cpu_path=lean) for m, lean in zip(models, (True, False))]
    if schedule == "mixed":
        for opt in opts:
            opt.schedule = [("resident", "staged", "cpu")[i % 3] for i in range(len(opt.layout.subgroups))]
    if "DOS_TEST_NO_KERNEL_ON_RANK" in os.environ:  # no rank may take it: they would plan apart
        assert opts[0].engine.bf16_kernel is None, "a rank took the kernel another rank does not have"
    else:
        assert opts[0].engine.bf16_kernel is not None, "the bf16 kernel did not load"
    for step in range(steps):
        for model, opt in zip(models, opts):
            opt.zero_grad()
            x, y = (my_rows(t).to(torch.bfloat16) for t in batch(step, 0))
            (model(x) - y).float().pow(2).mean().backward()
            opt.step()
        for (name, a), b in zip(models[0].named_parameters(), models[1].parameters()):
            assert torch.equal(a.to_local(), b.to_local()), f"step {step}, {name}: not the fp32 path's bits"
            assert torch.equal(opts[0].master(a), opts[1].master(b)), f"step {step}, {name}: masters differ"
    lean, plain = opts[0].last_update.h2d_bytes, opts[1].last_update.h2d_bytes
    assert (lean == plain) if "DOS_TEST_NO_KERNEL_ON_RANK" in os.environ else (lean < plain), (lean, plain)
    print(f"rank {dist.get_rank()}: {steps} steps of the bf16 CPU path equal the fp32 path bit for bit", flush=True)


def mixed_precision_mode(steps: int, schedule) -> None:
    """torchtitan's setting: fp32 sharded params, bf16 compute, fp32 reduce-scatter
    (MixedPrecisionPolicy). Ours on those shards must follow torch.optim.AdamW on a twin sharded alike."""
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model, twin = shard(make_model(), mp_policy=policy), shard(make_model(), mp_policy=policy)
    opt = ours(model, schedule)
    ref_opt = torch.optim.AdamW(twin.parameters(), lr=LR, weight_decay=WD, foreach=True)
    for step in range(steps):
        train_step(model, opt, step, sharded=True)
        ref_opt.zero_grad()
        for micro in range(MICRO):
            x, y = (my_rows(t) for t in batch(step, micro))
            ((twin(x) - y).pow(2).mean() / MICRO).backward()
        torch.nn.utils.clip_grad_norm_(twin.parameters(), MAX_NORM)
        ref_opt.step()
        for (name, p), want in zip(model.named_parameters(), twin.parameters()):
            assert p.dtype == torch.float32
            torch.testing.assert_close(p.to_local(), want.to_local(), rtol=2e-5, atol=2e-6,
                                       msg=lambda m: f"step {step}, {name}: {m}")
    print(f"rank {dist.get_rank()}: {steps} mixed-precision steps equal torch AdamW", flush=True)


def nonfinite_mode(steps: int, schedule, stream: bool, speculate: bool = False) -> None:
    """An inf in one rank's gradient shard at step 2: every rank must skip that step (the norm is global), so
    the ranks never diverge, and training continues equal to torch AdamW that skipped the same step."""
    import warnings

    ref = make_model()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD, fused=True)
    model = shard(make_model())
    poison = {"now": False}
    if dist.get_rank() == dist.get_world_size() - 1:  # the last rank only, in its own shard after the
        target = next(p for p in model.parameters() if p.to_local().numel())  # reduce-scatter (FSDP2 runs
        target.register_post_accumulate_grad_hook(  # this hook before ours, registered later)
            lambda p: p.grad.to_local().view(-1)[0].fill_(float("inf")) if poison["now"] else None)
    opt = ours(model, schedule, stream, speculate=speculate)
    for step in range(steps):
        before = [p.to_local().clone() for p in model.parameters()]
        opt.zero_grad()
        for micro in range(MICRO):
            x, y = (my_rows(t) for t in batch(step, micro))
            last = micro == MICRO - 1
            poison["now"] = step == 2 and last
            with opt.accumulating() if not last else contextlib.nullcontext():
                ((model(x) - y).pow(2).mean() / MICRO).backward()
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            opt.step()
        if step == 2:
            assert all(torch.equal(a, p.to_local()) for a, p in zip(before, model.parameters())), "not skipped"
            continue
        train_step(ref, ref_opt, step, sharded=False)
        for (name, p), want in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.full_tensor(), want.detach(), rtol=2e-5, atol=2e-6,
                                       msg=lambda m: f"step {step}, {name}: {m}")
    assert opt.skipped_steps == 1
    if speculate:
        assert opt.speculation.undone > 0 and opt.speculation.kept > 0, "the poisoned step's updates were undone"
    print(f"rank {dist.get_rank()}: skipped the poisoned step with the others, {steps - 1} steps equal torch AdamW",
          flush=True)


def save_mode(ckpt: str, before: int, after: int, out: str, schedule) -> None:
    model = shard(make_model())
    opt = ours(model, schedule)
    for step in range(before):
        train_step(model, opt, step, sharded=True)
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    host = [v.to_local() for e in opt.state_dict()["state"].values() for k, v in e.items() if k != "step"]
    assert all(t.device.type == "cpu" for t in host), "sharded state wraps the host buffers, no device copy"
    dcp.save(state, checkpoint_id=ckpt)
    full = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    params = full_params(model)
    if dist.get_rank() == 0:
        torch.save({"optim": full, "params": params}, os.path.join(out, "single_process.pt"))
    for step in range(before, before + after):
        train_step(model, opt, step, sharded=True)
    write_final(model, out, "uninterrupted")


def load_mode(ckpt: str, before: int, after: int, out: str, schedule) -> None:
    model = shard(make_model())
    opt = ours(model, schedule)
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=ckpt)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
    for step in range(before, before + after):
        train_step(model, opt, step, sharded=True)
    write_final(model, out, "resumed")


def overlap_mode(steps: int, schedule, stream: bool, prefetch: bool = False) -> None:
    """The update left running must be invisible: each fully_shard unit's all-gather (for a block of
    layers, before any hook of the layers inside it) waits for the subgroups of its own shards, the root's
    too (its own last layer); the slowed AdamW makes the forward reach them before they are written. With
    ``prefetch`` the first block all-gathers the second one's shards in its own pre-forward (set after
    the optimizer is built), so it must wait for those too."""
    import time

    from deep_optimizer_states.core import engine

    real = engine.adam_update

    def slow(*args, **kwargs):
        time.sleep(0.002)
        return real(*args, **kwargs)

    def blocks() -> nn.Module:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Sequential(nn.Linear(13, 29), nn.GELU(), nn.Linear(29, 31)),
                              nn.Sequential(nn.LayerNorm(31), nn.Linear(31, 5)), nn.Linear(5, 5)).to(DEVICE)
        mesh = init_device_mesh(DEVICE.type, (dist.get_world_size(),))
        for block in list(model)[:2]:
            fully_shard(block, mesh=mesh)
        return fully_shard(model, mesh=mesh)  # the root holds the last Linear

    engine.adam_update = slow
    model, twin = blocks(), blocks()
    size = 32 if prefetch else 97  # with prefetch: the second block's shards in subgroups of their own
    opt, ref = ours(model, schedule, stream, overlap=True, subgroup_size=size), ours(twin, schedule, stream,
                                                                                     subgroup_size=size)
    if prefetch:
        for m in (model, twin):
            m[0].set_modules_to_forward_prefetch([m[1]])
    losses = {}
    for m, o in ((model, opt), (twin, ref)):  # one after the other: each forward comes right after a step
        for step in range(steps):
            o.zero_grad()
            for micro in range(MICRO):
                x, y = (my_rows(t) for t in batch(step, micro))
                with o.accumulating() if micro < MICRO - 1 else contextlib.nullcontext():
                    loss = (m(x) - y).pow(2).mean() / MICRO  # the overlapped model waits here, unit by unit
                    losses.setdefault(id(o), []).append(loss.detach().clone())
                    loss.backward()
            o.step()
    for k, (a, b) in enumerate(zip(losses[id(opt)], losses[id(ref)])):
        assert torch.equal(a, b), f"step {k // MICRO}: an all-gather read shards the update had not written yet"
    opt.synchronize()
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p.to_local(), q.to_local())
        assert torch.equal(opt.state[p]["exp_avg_sq"], ref.state[q]["exp_avg_sq"])
    print(f"rank {dist.get_rank()}: overlapped, {steps} steps equal the synchronous run bit for bit", flush=True)


def calibrate_mode(out: str) -> None:
    """Rank 0 has a stored calibration, the others none (each its own cache folder): all must measure, in
    lock-step, and keep the same (averaged) rates; then, with a file stored everywhere, all load it. Last,
    rank 1 alone reads the engine's CPU path far too low: both ranks measure the engine again."""
    import functools
    import json
    from dataclasses import replace

    from deep_optimizer_states.core.ranks import RankSync
    from deep_optimizer_states.planning import calibrate
    from deep_optimizer_states.planning.plan import Planner

    rank = dist.get_rank()
    os.environ["DOS_CACHE_DIR"] = os.path.join(out, f"cache-{rank}")
    if rank == 0:
        calibrate.save(calibrate.Rates(**dict.fromkeys(calibrate.Rates.__dataclass_fields__, 7.0)), DEVICE)
    dist.barrier()
    sync = RankSync(dist.group.WORLD, DEVICE)
    barriers = []
    barrier = sync.barrier
    sync.barrier = lambda: (barriers.append(1), barrier())[1]
    calibrate.measure = functools.partial(calibrate.measure, numel=200_000, subgroups=4)
    measured = Planner([1000] * 4, DEVICE, 2, sync=sync).calibrate()
    stored = Planner([1000] * 4, DEVICE, 2, sync=sync).calibrate()  # every rank has a file now
    engine_rates, engine_runs = calibrate._engine_rates, []

    def slow_once_on_rank_1(*args, **kwargs):  # rank 1's first reading of the engine's CPU path is far too low
        rates = engine_rates(*args, **kwargs)
        engine_runs.append(rates.cpu_engine)
        if rank == 1 and len(engine_runs) == 1:
            rates = replace(rates, cpu_engine=rates.cpu_adam * calibrate.LOW_ENGINE_CPU / 10)
        return rates

    calibrate._engine_rates = slow_once_on_rank_1
    again = calibrate.measure(DEVICE, sync=sync)
    with open(os.path.join(out, f"calibrate-{rank}.json"), "w") as f:
        json.dump({"rank": rank, "measured": measured.as_dict(), "barriers": len(barriers),
                   "stored": stored.as_dict(), "engine_runs": engine_runs, "again": again.as_dict()}, f)


def bad_schedule_mode() -> None:
    """Rank 1's per-subgroup schedule is one too long, rank 0's is right: every rank refuses it, none waits
    at the host-memory barrier for the other."""
    from deep_optimizer_states.core.layout import subgroup_count

    model = shard(make_model())
    count = subgroup_count([([p for p in model.parameters()], [])], 97)
    length = count + (dist.get_rank() == 1)
    try:
        DeepOptimizerStates(model, subgroup_size=97, schedule=["cpu"] * length)
    except ValueError as e:
        print(f"REFUSED rank {dist.get_rank()}: {e}", flush=True)


def peer_build_mode(out: str, steps: int) -> None:
    """The benchmark's FSDP2 + CPUOffloadPolicy peer, built from the meta device: every rank saves its
    initial shards (rows of the whole model, the same on any number of ranks), then trains ``steps`` steps
    on one batch."""
    from bench.systems import fsdp2_offload_model

    model, opt = fsdp2_offload_model("tiny", DEVICE)
    assert not any(p.to_local().is_meta or b.is_meta for p in model.parameters() for b in model.buffers())
    assert all(b.device.type == DEVICE.type for b in model.buffers()), "the rotary buffers where the forward runs"
    initial = {name: p.to_local().detach().cpu().clone() for name, p in model.named_parameters()}
    ids = torch.randint(0, 1000, (1, 16), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.save({"initial": initial, "losses": losses}, os.path.join(out, f"peer-{world}-{rank}.pt"))


def main() -> None:
    global DEVICE, MAX_NORM
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["train", "save", "load", "calibrate", "mixed_precision", "nonfinite",
                                     "overlap", "bad_schedule", "peer_build", "bf16_path"])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--before", type=int, default=3)
    ap.add_argument("--after", type=int, default=3)
    ap.add_argument("--ckpt", default="")
    ap.add_argument("--out", default="")
    ap.add_argument("--schedule", default="2")
    ap.add_argument("--stream", action="store_true", help="train: stream_grads=True (beside a twin without)")
    ap.add_argument("--prefetch", action="store_true", help="overlap: the first block prefetches the second")
    ap.add_argument("--fill-ahead", action="store_true", help="train: ours with prefetch=True (needs --stream)")
    ap.add_argument("--speculate", action="store_true", help="train, nonfinite: ours with speculate=True")
    ap.add_argument("--peer", action="store_true", help="train: beside FSDP2 + torch AdamW, bit for bit (unclipped)")
    ap.add_argument("--max-norm", type=float, default=MAX_NORM, help="the global norm clipped to")
    ap.add_argument("--stand-down", default=None, choices=["forecast", "off"],
                    help="train: optimizer.STAND_DOWN for ours ('forecast' also runs updates ahead after a clip)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cuda: NCCL, one GPU per rank")
    args = ap.parse_args()
    schedule = int(args.schedule) if args.schedule.isdigit() else args.schedule
    MAX_NORM = args.max_norm
    if args.stand_down is not None:
        optimizer_module.STAND_DOWN = "forecast" if args.stand_down == "forecast" else False
        optimizer_module.SIT_OUT_AFTER_CLIP = args.stand_down != "forecast"
    if args.device == "cuda":
        DEVICE = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(DEVICE)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    try:
        if args.mode == "train":
            train_mode(args.steps, schedule, args.stream, args.fill_ahead, args.speculate, args.peer)
        elif args.mode == "save":
            save_mode(args.ckpt, args.before, args.after, args.out, schedule)
        elif args.mode == "calibrate":
            calibrate_mode(args.out)
        elif args.mode == "bad_schedule":
            bad_schedule_mode()
        elif args.mode == "peer_build":
            peer_build_mode(args.out, args.steps)
        elif args.mode == "bf16_path":
            bf16_path_mode(args.steps, schedule, args.stream)
        elif args.mode == "mixed_precision":
            mixed_precision_mode(args.steps, schedule)
        elif args.mode == "nonfinite":
            nonfinite_mode(args.steps, schedule, args.stream, args.speculate)
        elif args.mode == "overlap":
            overlap_mode(args.steps, schedule, args.stream, args.prefetch)
        else:
            load_mode(args.ckpt, args.before, args.after, args.out, schedule)
    finally:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Skip interpreter teardown: now and then a gloo process aborts in C++ static destructors at exit
    # ("terminate called without an active exception") after all its work is done and checked.
    sys.stdout.flush()
    os._exit(0)

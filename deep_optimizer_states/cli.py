"""The ``dos`` command: ``dos train`` (the main job), ``dos bench``, ``dos calibrate`` and ``dos plan``."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch

from .layout import ALIGN


def _schedule(text: str):
    return int(text) if text.isdigit() else text


def _train(args: argparse.Namespace) -> int:
    """Train a Llama-style model on random tokens, checking every step against torch's AdamW."""
    from .models import llama
    from .optimizer import DeepOptimizerStates
    from .reference import ReferenceAdamW

    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    model = llama(args.model, torch.bfloat16, device)
    numel = sum(p.numel() for p in model.parameters())
    size = args.subgroup_size or max(ALIGN, min(25_000_000, math.ceil(numel / 8)))
    opt = DeepOptimizerStates(model, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, subgroup_size=size,
                              schedule=args.schedule, max_grad_norm=1.0)
    ref = ReferenceAdamW(opt) if args.check else None
    places = opt.placements
    print(f"model {args.model}: {numel / 1e6:.1f}M params in {len(places)} subgroups on {device}; schedule "
          f"{args.schedule!r}: {places.count(places[0].STAGED)} staged, {places.count(places[0].CPU)} on the CPU")
    gen = torch.Generator().manual_seed(args.seed)
    worst = 0.0
    for step in range(1, args.steps + 1):
        ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), generator=gen).to(device)
        opt.zero_grad()
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if ref is not None:
            ref.step(max_norm=1.0)
        opt.step()
        line = (f"step {step:3d}  loss {loss.item():.4f}  grad norm {opt.last_grad_norm.item():.3f}  "
                f"update {opt.last_update.seconds * 1e3:7.1f} ms  iteration {(time.perf_counter() - t0) * 1e3:7.1f} ms")
        if ref is not None:
            err = max(ref.relative_errors())
            worst = max(worst, err)
            line += f"  max rel. err vs torch.optim.AdamW {err:.1e}"
        print(line, flush=True)
    if ref is not None:
        verdict = "matches" if worst < 1e-6 else "DIFFERS FROM"
        print(f"{verdict} torch.optim.AdamW on fp32 masters (worst relative error {worst:.1e}, bar 1e-6)")
        return 0 if worst < 1e-6 else 1
    return 0


def _bench(args: argparse.Namespace) -> int:
    from .benchmark import table, update_phase

    if args.threads:
        torch.set_num_threads(args.threads)
    schedules = [_schedule(s) for s in args.schedules.split(",")]
    if args.probes < 0:
        raise SystemExit(f"--probes must be 0 or more, got {args.probes}")
    rows = update_phase(args.model, schedules, args.subgroup_size, args.warmup, args.iters, out=args.out,
                        probes=args.probes)
    print(table(rows))
    return 0


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _calibrate(args: argparse.Namespace) -> int:
    from .calibrate import cache_path, calibrated_rates, describe, load_cached

    device = _device()
    fresh = args.force or load_cached(device) is None
    rates = calibrated_rates(device, force=args.force)
    if args.json:
        print(json.dumps(rates.as_dict()))
        return 0
    print(f"{'measured now' if fresh else 'from the cache'} on {device} ({torch.get_num_threads()} CPU threads):")
    print("\n".join("  " + line for line in describe(rates)))
    print(f"cache: {cache_path(device)}")
    return 0


PLAN_SIZES = (6_250_000, 12_500_000, 25_000_000, 50_000_000, 100_000_000)


def _plan(args: argparse.Namespace) -> int:
    """Print the schedule the model chooses for a model of ``--params`` parameters, and the bound."""
    from .calibrate import calibrated_rates
    from .perfmodel import choose, lower_bound, predict
    from .plan import SCRATCH_BYTES_PER_ELEMENT, SLOT_BYTES_PER_ELEMENT
    from .schedule import placements

    if args.params <= 0:
        raise SystemExit("--params must be > 0")
    device = _device()
    rates = calibrated_rates(device, log=lambda s: print(s, file=sys.stderr))
    params = int(args.params)
    options = []
    for size in ([args.subgroup_size] if args.subgroup_size else PLAN_SIZES):
        count = max(1, math.ceil(params / size))
        sizes = [params // count + (i < params % count) for i in range(count)]
        slots = 2
        if args.gpu_memory_gb is not None:  # what is left after bf16 params and grads (4 B/param) and scratch
            spare = args.gpu_memory_gb * 1e9 - 4 * params - SCRATCH_BYTES_PER_ELEMENT * sizes[0]
            slots = int(max(0, min(2, spare // (SLOT_BYTES_PER_ELEMENT * sizes[0]))))
        if slots:
            places, pred = choose(sizes, rates, slots)
        else:  # no room for a staging slot: everything on the CPU
            places = placements("cpu", count)
            pred = predict(sizes, places, rates)
        options.append((pred.seconds, size, slots, places, pred))
    seconds, size, slots, places, pred = min(options, key=lambda o: o[0])
    bound, fraction = lower_bound(params, rates)
    result = {"params": params, "device": str(device), "subgroup_size": size, "subgroups": len(places),
              "staged": pred.staged, "on_cpu": pred.cpu, "staging_slots": slots,
              "placements": "".join("S" if p.value == "staged" else "c" for p in places),
              "predicted_update_s": round(seconds, 4), "Gparams_per_s": round(params / seconds / 1e9, 3),
              "bottleneck": pred.bottleneck,
              "busy_s": {"cpu": round(pred.cpu_s, 4), "link": round(pred.link_s, 4), "gpu": round(pred.gpu_s, 4)},
              "lower_bound_s": round(bound, 4), "lower_bound_staged_fraction": fraction,
              "of_lower_bound": round(bound / seconds, 3)}
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{params / 1e9:.2f}B params on {device}: subgroups of {size / 1e6:g}M elements ({len(places)}), "
          f"{pred.staged} staged to the GPU and {pred.cpu} on the CPU, {slots} staging slots")
    pattern = result["placements"]
    print(f"  placement   {pattern[:80]}{'...' if len(pattern) > 80 else ''}   (S staged, c CPU)")
    print(f"  predicted   {seconds:.3f} s per update, {result['Gparams_per_s']:.2f} G params/s; bottleneck: "
          f"{pred.bottleneck}")
    print(f"  busy        CPU {pred.cpu_s:.3f} s, link {pred.link_s:.3f} s each way, GPU {pred.gpu_s:.3f} s")
    print(f"  lower bound {bound:.3f} s (everything overlapped, {fraction:.0%} staged): the plan reaches "
          f"{bound / seconds:.0%} of it")
    if device.type != "cuda":
        print("  (no GPU here: the 'link' rates are this machine's host memory copies)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dos", description=__doc__)
    sub = parser.add_subparsers(dest="command")
    train = sub.add_parser("train", help="train a Llama-style model with DeepOptimizerStates (default command)")
    train.add_argument("--model", default="tiny", help="tiny | 0.5b | 1.36b | 5.2b (default tiny)")
    train.add_argument("--steps", type=int, default=20)
    train.add_argument("--batch", type=int, default=2)
    train.add_argument("--seq", type=int, default=64)
    train.add_argument("--lr", type=float, default=1e-3)
    train.add_argument("--schedule", type=_schedule, default="auto", help="auto | cpu | gpu | k")
    train.add_argument("--subgroup-size", type=int, default=None, help="elements (default: 1/8 of the model, <= 25M)")
    train.add_argument("--device", default="auto", help="auto | cpu | cuda")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--no-check", dest="check", action="store_false",
                       help="skip the lockstep torch.optim.AdamW reference (it doubles memory)")
    bench = sub.add_parser("bench", help="time the update phase per schedule")
    bench.add_argument("--model", default="1.36b")
    bench.add_argument("--schedules", default="cpu,1,2,3,4,5,6,7,8,auto")
    bench.add_argument("--subgroup-size", type=int, default=25_000_000)
    bench.add_argument("--warmup", type=int, default=2, help="untimed rounds of every schedule in turn")
    bench.add_argument("--iters", type=int, default=7, help="timed rounds (each schedule's median reported)")
    bench.add_argument("--probes", type=int, default=3,
                       help="untimed 'auto' updates first, which the rates are refined from (default 3)")
    bench.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    bench.add_argument("--out", default=None, help="append JSON lines here")
    calibrate = sub.add_parser("calibrate", help="measure this machine's rates for the performance model")
    calibrate.add_argument("--force", action="store_true", help="measure again even if cached")
    calibrate.add_argument("--json", action="store_true")
    plan = sub.add_parser("plan", help="the schedule, predicted update time and lower bound for a model size")
    plan.add_argument("--params", type=float, required=True, help="parameter count, e.g. 5.2e9")
    plan.add_argument("--gpu-memory-gb", type=float, default=None, help="GPU memory budget (default: all)")
    plan.add_argument("--subgroup-size", type=int, default=None, help="elements (default: the best of a few)")
    plan.add_argument("--json", action="store_true")
    args = parser.parse_args(argv if argv is not None else sys.argv[1:] or ["train"])
    commands = {"train": _train, "bench": _bench, "calibrate": _calibrate, "plan": _plan}
    return commands[args.command](args)


if __name__ == "__main__":
    sys.exit(main())

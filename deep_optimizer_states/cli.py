"""The ``dos`` command: ``dos train`` (the main job) and ``dos bench`` (the update-phase benchmark)."""

from __future__ import annotations

import argparse
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
    rows = update_phase(args.model, schedules, args.subgroup_size, args.warmup, args.iters, out=args.out)
    print(table(rows))
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
    bench.add_argument("--warmup", type=int, default=2)
    bench.add_argument("--iters", type=int, default=5)
    bench.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    bench.add_argument("--out", default=None, help="append JSON lines here")
    args = parser.parse_args(argv if argv is not None else sys.argv[1:] or ["train"])
    return {"train": _train, "bench": _bench}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())

"""The ``dos`` command: ``dos train`` (the main job: train a small Llama on text), ``dos check`` (a self-check
against torch.optim.AdamW, also under torchrun with FSDP2), ``dos bench``, ``dos calibrate``, ``dos plan`` and
``dos profile``."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch

GB = 1e9
SMALLEST_SUBGROUP = 64  # elements: the default subgroup size never goes below this
GPU_BYTES_PER_PARAM = 4  # the model's bf16 params and grads stay on the GPU
CPU_THREADS_HELP = ("the CPU threads to measure for, as the optimizer's cpu_threads (default: as the optimizer's "
                    "default, one core left to the GPU's thread); the rates are cached per thread count")


def _schedule(text: str) -> str | int:
    """auto | offload | cpu | gpu | k (an int >= 1)."""
    from ..core.schedule import validate_schedule

    try:
        return validate_schedule(int(text) if text.lstrip("-").isdigit() else text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0 (argparse type)."""
    value = _number(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _nonnegative_float(text: str) -> float:
    value = _number(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _fraction(text: str) -> float:
    value = _number(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {text}")
    return value


def param_count(text: str) -> int:
    """A parameter count >= 1, written as an int or a float such as 5.2e9 (argparse type)."""
    value = _number(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a parameter count >= 1 (e.g. 5.2e9), got {text}")
    return int(value)


def _schedules(text: str) -> list[str | int]:
    return [_schedule(t) for t in text.split(",")]


def _int_at_least(lowest: int):
    """An argparse type: an int >= ``lowest``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < lowest:
            raise argparse.ArgumentTypeError(f"must be an integer >= {lowest}, got {text}")
        return value
    return parse


positive_int, nonnegative_int = _int_at_least(1), _int_at_least(0)


def _check(args: argparse.Namespace) -> int:
    """Train a Llama-style model on random tokens, checking every step against torch's AdamW. Under torchrun
    the model is sharded with FSDP2 and each rank trains its own batches (the check then runs per shard)."""
    from .distributed import join, leave

    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    device, rank, world = join(device)
    if world == 1:
        return _check_loop(args, device, rank, world)
    leave(_check_loop(args, device, rank, world))
    return 1  # not reached


def _check_loop(args: argparse.Namespace, device: torch.device, rank: int, world: int) -> int:
    from ..optimizer import DeepOptimizerStates
    from ..reference import ReferenceAdamW
    from .distributed import max_over_ranks, shard
    from .models import llama

    model = llama(args.model, torch.bfloat16, device)
    numel = sum(p.numel() for p in model.parameters())
    if world > 1:
        model = shard(model)
    size = args.subgroup_size or max(SMALLEST_SUBGROUP, min(25_000_000, math.ceil(numel / 8)))
    opt = DeepOptimizerStates(model, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, subgroup_size=size,
                              schedule=args.schedule, max_grad_norm=1.0)
    ref = ReferenceAdamW(opt) if args.check else None
    places = opt.placements
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"model {args.model}: {numel / 1e6:.1f}M params" + (f", FSDP2 over {world} ranks" if world > 1 else "")
        + f" in {len(places)} subgroups per rank on {device}; schedule "
          f"{args.schedule!r}: {places.count(places[0].STAGED)} staged, {places.count(places[0].CPU)} on the CPU"
          + (" (provisional: 'auto' calibrates at the first step)" if opt.planner.pending else ""))
    gen = torch.Generator().manual_seed(args.seed + rank)  # every rank its own batches
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
            err = max_over_ranks(max(ref.relative_errors()), world)
            worst = max(worst, err)
            line += f"  max rel. err vs torch.optim.AdamW {err:.1e}"
        say(line, flush=True)
    if ref is not None:
        verdict = "matches" if worst < 1e-6 else "DIFFERS FROM"
        say(f"{verdict} torch.optim.AdamW on fp32 masters (worst relative error {worst:.1e}, bar 1e-6)")
        return 0 if worst < 1e-6 else 1
    return 0


def _profile(args: argparse.Namespace) -> int:
    from .profile import profile
    from .train import _gib

    gpu = torch.cuda.is_available()
    result = profile(args.model or ("1.36b" if gpu else "tiny"), args.iterations, args.schedule,
                     args.micro_batch or (4 if gpu else 2), args.seq or (1024 if gpu else 128), out=args.out,
                     gpu_memory_budget=_gib(args.gpu_memory_budget), subgroup_size=args.subgroup_size,
                     stream_grads=args.stream_grads, speculate=args.speculate, bf16_cpu_path=args.bf16_cpu_path,
                     kernels=args.kernels)
    phases = ", ".join(f"{name} {s * 1e3:.1f} ms" for name, s in result["phases"].items())
    print(f"{phases}\ntimeline: {result['png']}\ntrace (Perfetto, chrome://tracing): {result['trace']}")
    if result["kernels"]:
        print(f"ops and kernels (torch.profiler, Perfetto): {result['kernels']}")
        for phase, k in result["kernel_summary"].items():
            busy = ", ".join(f"stream {s} {ms:.1f}" for s, ms in k["stream_busy_ms"].items()) or "no GPU streams"
            print(f"  {phase}: {k['wall_ms']:.1f} ms; busy ms: {busy}; {k['grad_hooks']} gradient hooks "
                  f"{k['grad_hooks_ms']:.1f} ms, waiting for the last update {k['waits_ms']:.1f} ms")
    return 0


def _bench(args: argparse.Namespace) -> int:
    from .benchmark import default_model, table, update_phase

    if args.threads:
        torch.set_num_threads(args.threads)
    schedules = args.schedules
    model = args.model
    if model is None:
        model = default_model(_device())
        why = "no GPU here" if not torch.cuda.is_available() else "what fits this machine"
        print(f"model {model} ({why}; --model picks another)", flush=True)
    rows = update_phase(model, schedules, args.subgroup_size, args.warmup, args.iters, out=args.out,
                        probes=args.probes)
    print(table(rows))
    return 0


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _calibrate(args: argparse.Namespace) -> int:
    from ..core.ranks import use_cpu_threads
    from ..planning.calibrate import cache_path, calibrated_rates, describe, load_cached

    device, bf16 = _device(), args.bf16_cpu_path
    use_cpu_threads(args.cpu_threads, device)  # the optimizer's threads: measured, and cached, for those
    fresh = args.force or load_cached(device, bf16) is None
    rates = calibrated_rates(device, force=args.force, bf16=bf16)
    if args.json:
        print(json.dumps(rates.as_dict()))
        return 0
    print(f"{'measured now' if fresh else 'from the cache'} on {device} ({torch.get_num_threads()} CPU threads):")
    print("\n".join("  " + line for line in describe(rates)))
    print(f"cache: {cache_path(device, bf16)}")
    return 0


PLAN_SIZES = (6_250_000, 12_500_000, 25_000_000, 50_000_000, 100_000_000)


def _budgets(params: int, device: torch.device, gpu_memory_gb: float | None) -> tuple[dict, list[str]]:
    """The host and GPU memory the plan is made for, and why the model does not fit them (empty if it does)."""
    from ..core.host_memory import available_host_bytes
    from ..core.layout import HOST_BYTES_PER_ELEMENT

    host = available_host_bytes()
    if gpu_memory_gb is not None:
        gpu, gpu_from = gpu_memory_gb * GB, "--gpu-memory-gb"
    elif device.type == "cuda":
        gpu, gpu_from = torch.cuda.get_device_properties(device).total_memory, "the whole GPU"
    else:
        gpu, gpu_from = None, "no GPU"
    need_host, need_gpu = HOST_BYTES_PER_ELEMENT * params, GPU_BYTES_PER_PARAM * params
    budget = {"host_memory_GB": None if host is None else round(host / GB, 2),
              "host_needed_GB": round(need_host / GB, 2),
              "gpu_budget_GB": None if gpu is None else round(gpu / GB, 2), "gpu_budget_from": gpu_from,
              "gpu_needed_GB": round(need_gpu / GB, 2)}
    problems = []
    if host is not None and need_host > host:
        problems.append(f"host memory: the optimizer states need {need_host / GB:.1f} GB of pinned host memory "
                        f"({HOST_BYTES_PER_ELEMENT} B/param: fp32 master, exp_avg, exp_avg_sq, fp32 grad landing "
                        f"zone), {host / GB:.1f} GB available (set DOS_HOST_MEMORY_GB if this machine grows its "
                        "memory on demand)")
    if gpu is not None and need_gpu > gpu:
        problems.append(f"GPU memory: the model's bf16 params and grads need {need_gpu / GB:.1f} GB "
                        f"({GPU_BYTES_PER_PARAM} B/param), the budget is {gpu / GB:.1f} GB ({gpu_from})")
    return budget, problems


def _plan(args: argparse.Namespace) -> int:
    """Print the schedule the model chooses for a model of ``--params`` parameters, and the bound; without a
    GPU, the CPU path's time. Exit status 1 when the model does not fit this machine's memory."""
    from ..core.engine import DEFAULT_STAGING_SLOTS
    from ..core.ranks import use_cpu_threads
    from ..core.schedule import placements
    from ..planning.calibrate import calibrated_rates
    from ..planning.perfmodel import choose, lower_bound, predict
    from ..planning.plan import SCRATCH_BYTES_PER_ELEMENT, SLOT_BYTES_PER_ELEMENT

    device = _device()
    use_cpu_threads(args.cpu_threads, device)
    cuda = device.type == "cuda"
    params = args.params
    budget, problems = _budgets(params, device, args.gpu_memory_gb)
    if problems:
        if args.json:
            print(json.dumps({"params": params, "device": str(device), "fits": False, "problems": problems,
                              "budget": budget}))
        else:
            print(f"{params / 1e9:.2f}B params do not fit on this machine ({device}):")
            print("\n".join("  " + p for p in problems))
            print("  shard the model over several processes (one optimizer per GPU), or use a machine with more "
                  "memory")
        return 1
    rates = calibrated_rates(device, log=lambda s: print(s, file=sys.stderr))
    gpu = budget["gpu_budget_GB"]
    options = []
    for size in ([args.subgroup_size] if args.subgroup_size else PLAN_SIZES):
        count = max(1, math.ceil(params / size))
        sizes = [params // count + (i < params % count) for i in range(count)]
        slots = 0
        if cuda:  # what is left after bf16 params and grads (4 B/param) and scratch
            spare = gpu * GB - GPU_BYTES_PER_PARAM * params - SCRATCH_BYTES_PER_ELEMENT * sizes[0]
            slots = int(max(0, min(DEFAULT_STAGING_SLOTS, spare // (SLOT_BYTES_PER_ELEMENT * sizes[0]))))
        if slots:
            places, pred = choose(sizes, rates, slots)
        else:  # no GPU, or no room for a staging slot: everything on the CPU path
            places = placements("cpu", count)
            pred = predict(sizes, places, rates)
        options.append((pred.seconds, size, slots, places, pred))
    seconds, size, slots, places, pred = min(options, key=lambda o: o[0])
    bound, fraction = lower_bound(params, rates) if cuda else (pred.body_s, 0.0)
    result = {"params": params, "device": str(device), "fits": True, "budget": budget, "cpu_path_only": not cuda,
              "subgroup_size": size, "subgroups": len(places),
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
    host = budget["host_memory_GB"]
    host_text = "unknown" if host is None else f"{host:g} GB available"
    gpu_text = "no GPU" if gpu is None else f"{gpu:g} GB ({budget['gpu_budget_from']})"
    gpu_need = "" if gpu is None else f" (bf16 params and grads need {budget['gpu_needed_GB']:g} GB)"
    print(f"{params / 1e9:.2f}B params on {device}; planned for host memory {host_text} (needs "
          f"{budget['host_needed_GB']:g} GB), GPU {gpu_text}{gpu_need}")
    if not cuda:
        print(f"  no GPU here: every subgroup is updated on the CPU path (torch's fused CPU AdamW); "
              f"subgroups of {size / 1e6:g}M elements ({len(places)})")
        print(f"  predicted   {seconds:.3f} s per update, {result['Gparams_per_s']:.2f} G params/s "
              f"(CPU AdamW {pred.cpu_s:.3f} s, "
              f"grad and param copies {pred.link_s:.3f} s)")
        return 0
    print(f"  subgroups of {size / 1e6:g}M elements ({len(places)}), {pred.staged} staged to the GPU and "
          f"{pred.cpu} on the CPU, {slots} staging slots")
    pattern = result["placements"]
    print(f"  placement   {pattern[:80]}{'...' if len(pattern) > 80 else ''}   (S staged, c CPU)")
    print(f"  predicted   {seconds:.3f} s per update, {result['Gparams_per_s']:.2f} G params/s; bottleneck: "
          f"{pred.bottleneck}")
    print(f"  busy        CPU {pred.cpu_s:.3f} s, link {pred.link_s:.3f} s each way, GPU {pred.gpu_s:.3f} s")
    print(f"  lower bound {bound:.3f} s (everything overlapped, {fraction:.0%} staged): the plan reaches "
          f"{bound / seconds:.0%} of it")
    return 0


def main(argv: list[str] | None = None) -> int:
    from .models import PRESETS

    parser = argparse.ArgumentParser(prog="dos", description=__doc__)
    sub = parser.add_subparsers(dest="command")
    train = sub.add_parser(
        "train", help="train a small Llama on text that needs no download (default command)",
        description="Train a Llama-style model with DeepOptimizerStates: by default on the Python standard "
                    "library's source at the byte level, a small model on the CPU (a few minutes on 2 cores) or a "
                    "preset that fits the free memory on a GPU. Checkpoints resume exactly (--resume).")
    what = train.add_argument_group("model and data")
    what.add_argument("--preset", choices=list(PRESETS), default=None,
                      help="a tools/models.py size (vocab from the data); default: hidden 256, 4 layers on the CPU, "
                           "by free memory on a GPU")
    what.add_argument("--hidden", type=positive_int, default=None, help="hidden size (a multiple of 64)")
    what.add_argument("--layers", type=positive_int, default=None, help="decoder layers")
    what.add_argument("--model", default=None, metavar="PATH",
                      help="a local Hugging Face model directory (and its tokenizer, if present) to train instead")
    what.add_argument("--data", nargs="+", default=None, metavar="FILE",
                      help="your own text files (default: the Python standard library's *.py source)")
    what.add_argument("--data-mb", type=positive_float, default=8.0,
                      help="MB of standard library source to read (default 8)")
    what.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    what.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"],
                      help="params' dtype (default: fp32 on the CPU, bf16 on a GPU)")
    loop = train.add_argument_group("training")
    loop.add_argument("--steps", type=positive_int, default=500, help="optimizer steps in all (default 500)")
    loop.add_argument("--seq", type=positive_int, default=None, help="tokens per sequence (default 128; GPU 1024)")
    loop.add_argument("--micro-batch", type=positive_int, default=None,
                      help="sequences per forward/backward (default 16; GPU 8)")
    loop.add_argument("--accum", type=positive_int, default=1, help="micro-batches accumulated per step (default 1)")
    loop.add_argument("--lr", type=positive_float, default=3e-3, help="peak learning rate (default 3e-3)")
    loop.add_argument("--warmup", type=nonnegative_int, default=None,
                      help="linear warm-up steps, then cosine decay (default: 10%% of --steps, <= 100)")
    loop.add_argument("--min-lr-ratio", type=_fraction, default=0.1,
                      help="the cosine ends at this fraction of --lr (default 0.1)")
    loop.add_argument("--weight-decay", type=_nonnegative_float, default=0.1,
                      help="on matrices and embeddings (default 0.1)")
    loop.add_argument("--max-grad-norm", type=_nonnegative_float, default=1.0,
                      help="global gradient-norm clipping, 0 for none (default 1.0)")
    loop.add_argument("--schedule", type=_schedule, default="auto",
                      help="optimizer schedule: auto | offload | cpu | gpu | k")
    loop.add_argument("--gpu-memory-budget", type=positive_float, default=None, metavar="GiB",
                      help="GPU memory the optimizer may fill with resident states, model included "
                           "(default: the device less a margin)")
    loop.add_argument("--stream-grads", action="store_true",
                      help="send the CPU path's gradients to host memory during backward (less GPU memory)")
    loop.add_argument("--overlap", action="store_true",
                      help="leave each update running beside the next forward")
    loop.add_argument("--prefetch", nargs="?", const=True, default=False, choices=["release"],
                      help="with --stream-grads: copy the staged subgroups' states to the GPU during backward; "
                           "'--prefetch release' gives each such copy's memory back at its flush, not at the "
                           "update's end (a lower GPU peak)")
    loop.add_argument("--speculate", action="store_true",
                      help="with --stream-grads: run the CPU path's update during backward, undone if the step "
                           "clips or skips")
    loop.add_argument("--bf16-cpu-path", action="store_true",
                      help="bf16 params: the CPU path's gradients down and params up in bf16, through our "
                           "kernel (bit for bit torch's; built at first use)")
    loop.add_argument("--subgroup-size", type=positive_int, default=None,
                      help="elements (default: 1/8 of the model, <= 25M)")
    loop.add_argument("--seed", type=nonnegative_int, default=0, help="model init and data order (default 0)")
    ckpt = train.add_argument_group("evaluation, checkpoints and output")
    ckpt.add_argument("--eval-every", type=nonnegative_int, default=100,
                      help="held-out loss every N steps, 0 for only at the end (default 100)")
    ckpt.add_argument("--eval-batches", type=positive_int, default=8,
                      help="held-out micro-batches per evaluation (default 8)")
    ckpt.add_argument("--checkpoint-dir", default=None, metavar="DIR", help="save checkpoints here (and at the end)")
    ckpt.add_argument("--checkpoint-every", type=nonnegative_int, default=0,
                      help="save every N steps, 0 for only at the end (default 0)")
    ckpt.add_argument("--keep-checkpoints", type=positive_int, default=2, help="newest checkpoints kept (default 2)")
    ckpt.add_argument("--resume", action="store_true",
                      help="continue from the newest checkpoint in --checkpoint-dir (from step 0 if there is none)")
    ckpt.add_argument("--sample-tokens", type=nonnegative_int, default=200,
                      help="tokens of text generated at the end, 0 for none (default 200)")
    ckpt.add_argument("--prompt", default="def ", help="the sample's prompt (default 'def ')")
    ckpt.add_argument("--top-k", type=positive_int, default=8, help="sample from the k likeliest, 1 = greedy (default 8)")
    ckpt.add_argument("--summary-json", default=None, metavar="PATH",
                      help="write losses, eval losses, tokens/s and the time split here as JSON")
    ckpt.add_argument("--no-progress", action="store_true", help="no progress bar")
    check = sub.add_parser("check", help="self-check: train on random tokens, every step checked against "
                                         "torch.optim.AdamW (under torchrun: FSDP2)")
    check.add_argument("--model", default="tiny", choices=list(PRESETS), help="a preset size (default tiny)")
    check.add_argument("--steps", type=positive_int, default=20)
    check.add_argument("--batch", type=positive_int, default=2)
    check.add_argument("--seq", type=positive_int, default=64)
    check.add_argument("--lr", type=positive_float, default=1e-3)
    check.add_argument("--schedule", type=_schedule, default="auto", help="auto | offload | cpu | gpu | k")
    check.add_argument("--subgroup-size", type=positive_int, default=None,
                       help="elements (default: 1/8 of the model, <= 25M)")
    check.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    check.add_argument("--seed", type=int, default=0)
    check.add_argument("--no-check", dest="check", action="store_false",
                       help="skip the lockstep torch.optim.AdamW reference (it doubles memory)")
    bench = sub.add_parser("bench", help="time the update phase per schedule")
    bench.add_argument("--model", default=None,
                       help="tiny | 0.5b | 1.36b | 5.2b (default: tiny without a GPU, else 1.36b or 0.5b, what fits)")
    bench.add_argument("--schedules", type=_schedules, default="cpu,1,2,3,4,5,6,7,8,auto")
    bench.add_argument("--subgroup-size", type=positive_int, default=None,
                       help="elements (default: 1/8 of the model, <= 25M)")
    bench.add_argument("--warmup", type=nonnegative_int, default=2, help="untimed rounds of every schedule in turn")
    bench.add_argument("--iters", type=positive_int, default=7, help="timed rounds (each schedule's median reported)")
    bench.add_argument("--probes", type=nonnegative_int, default=3,
                       help="untimed 'auto' updates first, which the rates are refined from (default 3)")
    bench.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads (default: torch's)")
    bench.add_argument("--out", default=None, help="append JSON lines here")
    calibrate = sub.add_parser("calibrate", help="measure this machine's rates for the performance model")
    calibrate.add_argument("--force", action="store_true", help="measure again even if cached")
    calibrate.add_argument("--json", action="store_true")
    calibrate.add_argument("--bf16-cpu-path", action="store_true",
                           help="the rates of the engine with bf16_cpu_path=True (cached in their own file)")
    calibrate.add_argument("--cpu-threads", type=positive_int, default=None, help=CPU_THREADS_HELP)
    plan = sub.add_parser("plan", help="the schedule, predicted update time and lower bound for a model size")
    plan.add_argument("--params", type=param_count, required=True, help="parameter count, e.g. 5.2e9")
    plan.add_argument("--gpu-memory-gb", type=positive_float, default=None,
                      help="GPU memory budget (default: the whole GPU)")
    plan.add_argument("--subgroup-size", type=positive_int, default=None, help="elements (default: the best of a few)")
    plan.add_argument("--cpu-threads", type=positive_int, default=None, help=CPU_THREADS_HELP)
    plan.add_argument("--json", action="store_true")
    profile = sub.add_parser("profile", help="a few iterations, then a timeline of the last one (PNG and Chrome trace)")
    profile.add_argument("--model", default=None, help="tiny | 0.5b | 1.36b | 5.2b (default: 1.36b on a GPU, else tiny)")
    profile.add_argument("--iterations", type=positive_int, default=3)
    profile.add_argument("--schedule", type=_schedule, default="auto", help="auto | offload | cpu | gpu | k")
    profile.add_argument("--micro-batch", type=positive_int, default=None, help="default: 4 on a GPU, else 2")
    profile.add_argument("--seq", type=positive_int, default=None, help="default: 1024 on a GPU, else 128")
    profile.add_argument("--out", default="profile", help="folder for timeline.png and trace.json")
    profile.add_argument("--gpu-memory-budget", type=positive_float, default=None, metavar="GiB",
                         help="GPU memory budget, model included (default: the device less a margin)")
    profile.add_argument("--subgroup-size", type=positive_int, default=None,
                         help="elements per subgroup (default: a sixteenth of the model)")
    profile.add_argument("--stream-grads", action="store_true", help="the CPU path's gradients leave in backward")
    profile.add_argument("--speculate", action="store_true",
                         help="the CPU path's update runs ahead in backward (needs --stream-grads)")
    profile.add_argument("--bf16-cpu-path", action="store_true", help="the CPU path reads bf16 gradients")
    profile.add_argument("--kernels", action="store_true",
                         help="also record the last iteration with torch.profiler (kernels.json)")
    args = parser.parse_args(argv if argv is not None else sys.argv[1:] or ["train"])
    if args.command == "train":
        from .train import UsageError, train as run_training

        try:
            return run_training(args)
        except UsageError as e:
            train.error(str(e))
    if args.command == "check" and args.device == "cuda" and not torch.cuda.is_available():
        check.error("--device cuda: no CUDA device here")
    if args.command == "profile" and args.speculate and not args.stream_grads:
        profile.error("--speculate needs --stream-grads: the CPU path runs ahead from the gradient hooks")
    commands = {"check": _check, "bench": _bench, "calibrate": _calibrate, "plan": _plan, "profile": _profile}
    return commands[args.command](args)


if __name__ == "__main__":
    sys.exit(main())

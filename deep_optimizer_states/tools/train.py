"""``dos train``: train a Llama-style language model with DeepOptimizerStates on text that needs no download.

The data (tools/data.py) is the Python standard library's source at the byte level unless ``--data`` or a
local Hugging Face model (``--model PATH``, with its tokenizer) says otherwise. Batches depend on the step
index alone and checkpoints hold the model, the optimizer, the LR scheduler, the step and the RNG, so a run
resumed with ``--resume`` continues the uninterrupted run's loss curve exactly (fp32 on the CPU).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

# CPU default: 2.8M params, about 2 minutes on 2 idle cores, byte-level loss from ~5.5 to below 2.
CPU_DEFAULTS = {"hidden": 256, "layers": 4, "seq": 128, "micro_batch": 16}
GPU_DEFAULTS = {"seq": 1024, "micro_batch": 8}
# the files a Hugging Face tokenizer is saved as (any one of them: the directory has a tokenizer)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model")


class UsageError(Exception):
    """A problem with the options or the checkpoint directory: reported as an argparse-style error (exit 2)."""


def _log(*args, **kwargs) -> None:
    try:
        from tqdm import tqdm
        tqdm.write(" ".join(str(a) for a in args), file=sys.stdout)
    except ImportError:
        print(*args, **kwargs, flush=True)


def _gpu_preset(device: torch.device) -> str:
    """A bigger preset for the free GPU memory (bf16 params and grads on the GPU, activations beside them)."""
    free, _ = torch.cuda.mem_get_info(device)
    if free >= 60e9:
        return "1.36b"
    if free >= 24e9:
        return "0.5b"
    return "tiny"


def _llama(hidden: int, layers: int, vocab: int, seq: int, seed: int):
    """A LlamaForCausalLM shaped as tools/models.py's presets, on the current default device (the caller
    builds it on the meta device and materialises it, sharded or not)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    head_dim = 64 if hidden < 1024 else 128
    if hidden % head_dim:
        raise UsageError(f"--hidden must be a multiple of {head_dim}, got {hidden}")
    cfg = LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=hidden // head_dim,
                      num_key_value_heads=hidden // head_dim,
                      intermediate_size=max(256, int(hidden * 2.75) // 256 * 256),
                      vocab_size=vocab, max_position_embeddings=max(2048, seq))
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


def _pretrained(path: str, meta: bool = False):
    """A local Hugging Face causal LM and its tokenizer (None when the directory has none). ``meta``: built
    from its config on the meta device, for each rank to read only its own shards (``materialize``)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if not Path(path).is_dir():
        raise UsageError(f"--model {path}: not a directory (a local Hugging Face model directory is expected)")
    try:
        if meta:
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path, local_files_only=True))
        else:
            model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)  # dtype set below
    except (OSError, ValueError) as e:
        raise UsageError(f"--model {path}: cannot load it as a causal LM ({e})") from None
    if not any((Path(path) / name).is_file() for name in TOKENIZER_FILES):
        return model, None  # no tokenizer there: asked for anyway, transformers may raise anything (4.57 on llama)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # a tokenizer that is there but does not load: never train on bytes instead
        raise UsageError(f"--model {path}: its tokenizer does not load ({type(e).__name__}: {e}); fix or remove "
                         f"its tokenizer files ({', '.join(TOKENIZER_FILES)}) to train on bytes") from None
    return model, tokenizer


def lr_lambda(step: int, steps: int, warmup: int, min_ratio: float) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine from 1 down to ``min_ratio`` at ``steps``."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def _param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices (and embeddings), none on norms and biases."""
    decay, rest = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else rest).append(p)
    return [g for g in ({"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0})
            if g["params"]]


class PhaseTimer:
    """Wall time per phase (forward, backward, update), synchronising the device at each boundary on a GPU."""

    def __init__(self, device: torch.device):
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        self.total = {"forward": 0.0, "backward": 0.0, "update": 0.0}
        self._t = 0.0

    def start(self) -> None:
        self.sync()
        self._t = time.perf_counter()

    def lap(self, phase: str) -> None:
        self.sync()
        now = time.perf_counter()
        self.total[phase] += now - self._t
        self._t = now

    def seconds(self) -> float:
        return sum(self.total.values())

    def split(self) -> dict[str, float]:
        whole = self.seconds() or 1.0
        return {k: v / whole for k, v in self.total.items()}


def _loss(model, batch: torch.Tensor, device: torch.device) -> torch.Tensor:
    batch = batch.to(device, non_blocking=True)
    logits = model(input_ids=batch[:, :-1]).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))


@torch.no_grad()
def evaluate(model: nn.Module, batches: list[torch.Tensor], device: torch.device) -> float:
    """Mean loss over the held-out batches."""
    was_training = model.training
    model.eval()
    total = sum(_loss(model, b, device).item() for b in batches) / len(batches)
    model.train(was_training)
    return total


@torch.no_grad()
def generate(model: nn.Module, prompt: list[int], new_tokens: int, context: int, device: torch.device, top_k: int = 1,
             seed: int = 0) -> list[int]:
    """``new_tokens`` ids continuing ``prompt``: greedy for top_k 1, else sampled from the top k (seeded)."""
    was_training = model.training
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    ids = list(prompt)
    for _ in range(new_tokens):
        x = torch.tensor([ids[-context:]], device=device)
        logits = model(input_ids=x).logits[0, -1].float().cpu()
        if top_k <= 1:
            ids.append(int(logits.argmax()))
        else:
            values, indices = logits.topk(min(top_k, logits.numel()))
            pick = torch.multinomial(torch.softmax(values, -1), 1, generator=gen)
            ids.append(int(indices[pick]))
    model.train(was_training)
    return ids[len(prompt):]


# What a resumed run must share with the checkpoint for its curve to continue exactly.
# Ranks times accumulation is what matters: rank r takes micro-batches r, r + ranks, ... of each step.
_CURVE_KEYS = ("model", "hidden", "layers", "vocab", "seq", "micro_batch", "micro_batches_per_step", "lr", "warmup",
               "min_lr_ratio", "weight_decay", "max_grad_norm", "seed", "dtype", "data")


def train(args: argparse.Namespace) -> int:
    """`dos train`; under torchrun, data-parallel over the ranks with the model sharded by FSDP2 (each rank
    its own micro-batches, our optimizer on each rank's shards)."""
    from .distributed import join, leave, world_size

    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device here")
    if world_size() == 1:
        return _train(args, device, 0, 1)
    device, rank, world = join(device)
    leave(_train(args, device, rank, world))
    return 1  # not reached


def _train(args: argparse.Namespace, device: torch.device, rank: int, world: int) -> int:
    from ..checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, read_manifest, save_checkpoint
    from ..integrations.fsdp2 import load_sharded_checkpoint, save_sharded_checkpoint
    from ..optimizer import DeepOptimizerStates
    from .data import load_text_data
    from .distributed import mean_over_ranks, shard
    from .models import PRESETS, materialize, rebuild_rotary

    say = _log if rank == 0 else (lambda *a, **k: None)
    cuda = device.type == "cuda"
    dtype = {"auto": torch.bfloat16 if cuda else torch.float32, "fp32": torch.float32,
             "bf16": torch.bfloat16}[args.dtype]
    defaults = GPU_DEFAULTS if cuda else CPU_DEFAULTS
    seq = args.seq or defaults["seq"]
    micro = args.micro_batch or defaults["micro_batch"]
    if args.resume and not args.checkpoint_dir:
        raise UsageError("--resume needs --checkpoint-dir")
    if args.checkpoint_every and not args.checkpoint_dir:
        raise UsageError("--checkpoint-every needs --checkpoint-dir (where to write the checkpoints)")
    for flag in ("prefetch", "speculate"):
        if getattr(args, flag) and not args.stream_grads:
            raise UsageError(f"--{flag} needs --stream-grads (it starts from the gradient hooks in backward)")

    # ---- model and data -----------------------------------------------------------------------------------
    tokenizer = None
    if args.model:
        if args.preset or args.hidden or args.layers:
            raise UsageError("--model PATH cannot be combined with --preset, --hidden or --layers")
        torch.manual_seed(args.seed)
        model, tokenizer = _pretrained(args.model, meta=world > 1)
        hidden, layers = model.config.hidden_size, model.config.num_hidden_layers
        model_name = args.model
    else:
        preset = args.preset or (_gpu_preset(device) if cuda and not (args.hidden or args.layers) else None)
        hidden, layers = (PRESETS[preset][:2] if preset else (CPU_DEFAULTS["hidden"], CPU_DEFAULTS["layers"]))
        hidden, layers = args.hidden or hidden, args.layers or layers
        model_name = preset or "custom"
    try:
        data = load_text_data(args.data, seq, micro, seed=args.seed, limit_mb=args.data_mb, tokenizer=tokenizer)
    except (OSError, ValueError) as e:
        raise UsageError(f"data: {e}") from None
    if args.model:
        vocab = model.config.vocab_size
        if data.vocab_size > vocab:
            raise UsageError(f"--model {args.model}: its vocabulary ({vocab}) is smaller than the data's token ids "
                             f"({data.vocab_size}{', bytes: no tokenizer in the directory' if tokenizer is None else ''})")
    else:
        vocab = data.vocab_size
        with torch.device("meta"):
            model = _llama(hidden, layers, vocab, seq, args.seed)
    if model.device.type == "meta":
        model = model.to(dtype)
    else:  # loaded whole: its rotary buffers back to fp32 after the cast, as materialize makes them
        model = model.to(device, dtype)
        rebuild_rotary(model, device)
    model.train()
    numel = sum(p.numel() for p in model.parameters())
    if world > 1:
        model = shard(model)
    if next(model.parameters()).device.type == "meta":  # each rank makes (or reads) only its own shards: no
        try:  # process holds the whole model (drawn: the same model on any rank count)
            materialize(model, device, args.seed, weights=args.model or None)
        except (OSError, ValueError) as e:
            raise UsageError(f"{'--model ' + args.model if args.model else 'the model'}: {e}") from None

    steps, accum = args.steps, args.accum
    warmup = args.warmup if args.warmup is not None else min(100, steps // 10)
    size = args.subgroup_size or max(64, min(25_000_000, math.ceil(numel / 8)))
    max_norm = args.max_grad_norm or None
    opt = DeepOptimizerStates(_param_groups(model, args.weight_decay), lr=args.lr, betas=(0.9, 0.95),
                              weight_decay=args.weight_decay, subgroup_size=size, schedule=args.schedule,
                              max_grad_norm=max_norm, gpu_memory_budget=_gib(args.gpu_memory_budget),
                              stream_grads=args.stream_grads, overlap=args.overlap, prefetch=args.prefetch,
                              speculate=args.speculate, bf16_cpu_path=args.bf16_cpu_path, model=model)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_lambda(s, steps, warmup, args.min_lr_ratio))
    run = {"model": model_name, "hidden": hidden, "layers": layers, "vocab": vocab, "seq": seq, "micro_batch": micro,
           "accum": accum, "ranks": world, "micro_batches_per_step": accum * world, "steps": steps, "lr": args.lr, "warmup": warmup, "min_lr_ratio": args.min_lr_ratio,
           "weight_decay": args.weight_decay, "max_grad_norm": max_norm or 0.0, "seed": args.seed,
           "dtype": str(dtype), "data": data.fingerprint, "bf16_cpu_path": opt.engine.bf16_kernel is not None}

    # ---- resume -------------------------------------------------------------------------------------------
    start = 0
    if args.resume:
        path = latest_checkpoint(args.checkpoint_dir)
        if path is None:
            say(f"--resume: no checkpoint in {args.checkpoint_dir} yet; starting at step 0")
        else:
            try:
                if read_manifest(path).get("sharded"):  # saved under torchrun: resharded to this run's ranks
                    extra = load_sharded_checkpoint(path, model, opt)
                elif world > 1:
                    raise CheckpointError(f"{path} was saved by one process; resume it in one process")
                else:
                    extra = load_checkpoint(path, model, opt)
            except CheckpointError as e:
                raise UsageError(f"--resume: {e}") from None
            saved = extra.get("run", {})
            saved = {**saved, "micro_batches_per_step": saved.get(  # checkpoints from before this key
                "micro_batches_per_step", saved.get("accum", 1) * saved.get("ranks", 1))}
            if args.warmup is None and isinstance(saved.get("warmup"), int):  # derived from --steps: keep the run's
                warmup = run["warmup"] = saved["warmup"]
            differ = [f"{k}: checkpoint {saved.get(k)!r}, now {run[k]!r}" for k in _CURVE_KEYS if saved.get(k) != run[k]]
            if differ:
                raise UsageError(f"--resume: {path} was saved by a different run (" + "; ".join(differ)
                                 + "); use the same options or another --checkpoint-dir")
            if saved.get("steps") != steps:
                say(f"note: the LR schedule now spans {steps} steps (the checkpoint's run: {saved.get('steps')}); "
                     "the curve from here on differs from that run's")
            sched.load_state_dict(extra["lr_scheduler"])
            start = int(extra["step"])
            torch.set_rng_state(extra["rng"]["torch"])
            if cuda and extra["rng"].get("cuda") is not None:
                torch.cuda.set_rng_state(extra["rng"]["cuda"], device)
            say(f"resumed from {path} at step {start}")
    if start >= steps:
        raise UsageError(f"--steps {steps}: the checkpoint is already at step {start}; ask for more steps")

    places = opt.placements
    ranks = (f", FSDP2 over {world} ranks ({len(places)} subgroups per rank)" if world > 1
             else f"; {len(places)} subgroups")
    say(f"model {model_name}: hidden {hidden}, {layers} layers, vocab {vocab}, {numel / 1e6:.2f}M params, {dtype} "
        f"on {device}{ranks}, schedule {args.schedule!r}")
    say(f"data: {data.description}; {len(data.train):,} training tokens, {len(data.held_out):,} held out")
    say(f"steps {start + 1}-{steps}: {micro} x {seq} tokens x {accum} accumulated" + (f" x {world} ranks" if world > 1
        else "") + f" per step, lr {args.lr:g} (warm-up {warmup}, cosine to {args.min_lr_ratio:g}x), max grad norm "
        f"{max_norm}")

    # ---- loop ---------------------------------------------------------------------------------------------
    eval_batches = data.eval_batches(args.eval_batches)
    timer = PhaseTimer(device)
    losses: list[list] = []
    evals: list[list] = []
    tokens_per_step = micro * seq * accum * world
    checkpoints: list[str] = []
    saved_step: int | None = None  # the step of this run's last save (names may carry a suffix)

    def save(step: int) -> None:
        nonlocal saved_step
        extra = {"step": step, "lr_scheduler": sched.state_dict(), "data": data.state(step), "run": run,
                 "rng": {"torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state(device) if cuda else None}}
        saver = save_sharded_checkpoint if world > 1 else save_checkpoint
        checkpoints.append(str(saver(args.checkpoint_dir, model, opt, extra=extra, step=step,
                                     keep=args.keep_checkpoints)))
        saved_step = step

    try:
        from tqdm import tqdm
        bar = None if args.no_progress or rank else tqdm(total=steps, initial=start, desc="train", unit="step",
                                                  dynamic_ncols=True)
    except ImportError:
        bar = None
    for step in range(start + 1, steps + 1):
        torch.manual_seed(args.seed * 1_000_003 + step)  # dropout, if a model has any, by step index
        total = 0.0
        timer.start()
        for m in range(accum):
            loss = _loss(model, data.batch(step, m * world + rank), device)  # each rank its own
            timer.lap("forward")
            with opt.accumulating() if m < accum - 1 else contextlib.nullcontext():  # stream_grads: the last only
                opt.scale_loss(loss / accum).backward()
            total += loss.item()
            timer.lap("backward")
        opt.step()
        opt.zero_grad()
        sched.step()
        timer.lap("update")
        loss_value = mean_over_ranks(total / accum, world)
        losses.append([step, loss_value])
        if not math.isfinite(loss_value):
            say(f"step {step}: loss is {loss_value}; stopping")
            break
        if bar is not None:
            split = timer.split()
            bar.set_postfix_str(f"loss {loss_value:.3f}, {tokens_per_step * len(losses) / timer.seconds():,.0f} tok/s, "
                                f"fwd/bwd/upd {split['forward']:.0%}/{split['backward']:.0%}/{split['update']:.0%}",
                                refresh=False)
            bar.update(1)
        elif rank == 0 and (step % max(1, steps // 20) == 0 or step == start + 1):
            print(f"step {step:5d}  loss {loss_value:.4f}  {tokens_per_step * len(losses) / timer.seconds():,.0f} "
                  f"tokens/s", flush=True)
        if args.eval_every and step % args.eval_every == 0 and step != steps:
            evals.append([step, mean_over_ranks(evaluate(model, eval_batches, device), world)])
            say(f"step {step}: train loss {loss_value:.4f}, eval loss {evals[-1][1]:.4f}, "
                 f"lr {sched.get_last_lr()[0]:.2e}")
        if args.checkpoint_dir and args.checkpoint_every and step % args.checkpoint_every == 0:
            save(step)
    if bar is not None:
        bar.close()
    last = losses[-1][0] if losses else start
    if (args.checkpoint_dir and losses and math.isfinite(losses[-1][1])
            and saved_step != last):
        save(last)
    eval_loss = mean_over_ranks(evaluate(model, eval_batches, device), world)
    evals.append([last, eval_loss])

    # ---- summary ------------------------------------------------------------------------------------------
    seconds = timer.seconds()
    tok_s = tokens_per_step * len(losses) / seconds if seconds else 0.0
    split = timer.split()
    first_loss = losses[0][1] if losses else float("nan")
    final_loss = losses[-1][1] if losses else float("nan")
    say(f"done: steps {start + 1}-{last} in {seconds:.1f} s; train loss {first_loss:.4f} -> {final_loss:.4f}, "
          f"eval loss {eval_loss:.4f}; {tok_s:,.0f} tokens/s; time: forward {split['forward']:.0%}, backward "
        f"{split['backward']:.0%}, update {split['update']:.0%}")
    if checkpoints:
        say(f"checkpoint: {checkpoints[-1]}")
    sample = None
    if args.sample_tokens:
        prompt_ids = data.encode(args.prompt)
        if not prompt_ids:
            prompt_ids = [0]
        out = generate(model, prompt_ids, args.sample_tokens, seq, device, args.top_k, args.seed)  # on every rank
        sample = data.decode(prompt_ids + out)
        how = "greedy" if args.top_k <= 1 else f"top-{args.top_k} sampling"
        say(f"sample ({how}, {args.sample_tokens} tokens from {args.prompt!r}):\n{sample}\n")
    if args.summary_json and rank == 0:
        summary = {"run": run, "device": str(device), "world_size": world, "params": numel, "start_step": start,
                   "last_step": last,
                   "losses": losses, "evals": evals, "final_train_loss": final_loss, "final_eval_loss": eval_loss,
                   "tokens_per_s": tok_s, "seconds": seconds, "time_split": split,
                   "phase_seconds": dict(timer.total), "checkpoints": checkpoints, "sample": sample}
        Path(args.summary_json).write_text(json.dumps(summary, indent=1))
    opt.close()
    return 0 if math.isfinite(final_loss) else 1


def _gib(gb: float | None) -> int | None:
    """--gpu-memory-budget GiB as the optimizer's byte count (None: its default, the device less a margin)."""
    return None if gb is None else int(gb * 2**30)

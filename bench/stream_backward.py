"""Where a streamed backward's time goes: backward alone, unprofiled, under ``stream_grads`` with its
gradient hooks doing less and less, against the same backward with the gradients gathered at the step.

    python3 -m bench.stream_backward [--model 1.36b] [--iters 5] [--bf16-cpu-path] [--speculate]
                                     [--launch-share F] [--variants gathered,stream]

Variants, each on a fresh optimizer over the same model and batch (schedule "offload", every subgroup's
update on the CPU path, the case where every gradient streams):
  gathered   no hooks: gradients stay on the GPU until step()
  hooks_off  stream_grads, hooks registered but returning at once (the cost of autograd calling Python)
  no_send    the hooks' bookkeeping and norms, nothing copied down
  stream     the whole streamed path (copies down on the side stream, gradients given back)
For each: the median backward (device synchronised before and after), the hooks' CPU time summed inside
backward, and the median step. A variant's step is not comparable where its hooks were cut short.
Prints one JSON line per variant and a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import deep_optimizer_states.optimizer as optimizer_module
from deep_optimizer_states import DeepOptimizerStates
from deep_optimizer_states.core import grad_stream as gs
from deep_optimizer_states.tools.models import llama

VARIANTS = ("gathered", "hooks_off", "no_send", "stream")


def _timed_hooks(variant: str) -> tuple[list[float], object]:
    """Patch GradStream for ``variant``; return the list the hooks' seconds go to and an undo."""
    spent: list[float] = []
    on_grad, send = gs.GradStream._on_grad, gs.GradStream._send

    def timed(self, p):
        t = time.perf_counter()
        if variant != "hooks_off":
            on_grad(self, p)
        spent.append(time.perf_counter() - t)

    def landed_only(self, sg):
        self.landed[sg.index] = None

    gs.GradStream._on_grad = timed
    if variant == "no_send":
        gs.GradStream._send = landed_only

    def undo():
        gs.GradStream._on_grad, gs.GradStream._send = on_grad, send
    return spent, undo


def run(preset: str, iters: int, warmup: int, bf16_cpu_path: bool, speculate: bool,
        variants: tuple[str, ...] = VARIANTS, launch_share: float | None = None) -> list[dict]:
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    model = llama(preset, torch.bfloat16, dev)
    n = sum(p.numel() for p in model.parameters())
    shape = (4, 1024) if dev.type == "cuda" else (2, 64)
    ids = torch.randint(0, model.config.vocab_size, shape, generator=torch.Generator().manual_seed(0)).to(dev)
    rows = []
    if launch_share is not None:
        optimizer_module.LAUNCH_SHARE = launch_share
    for variant in variants:
        stream = variant != "gathered"
        spent, undo = _timed_hooks(variant) if stream else ([], lambda: None)
        opt = DeepOptimizerStates(model, lr=1e-4, weight_decay=0.01, schedule="offload", subgroup_size=25_000_000,
                                  stream_grads=stream, speculate=speculate and variant == "stream",
                                  bf16_cpu_path=bf16_cpu_path)
        backward, step, hooks = [], [], []
        try:
            for i in range(warmup + iters):
                opt.zero_grad()
                loss = model(input_ids=ids, labels=ids).loss
                sync()
                spent.clear()
                t0 = time.perf_counter()
                loss.backward()
                sync()
                t1 = time.perf_counter()
                hooks_s = sum(spent)
                opt.step()
                sync()
                t2 = time.perf_counter()
                if i >= warmup:
                    backward.append(t1 - t0)
                    step.append(t2 - t1)
                    hooks.append(hooks_s)
            spec = getattr(opt, "speculation", None)
            ahead = (None if spec is None
                     else {"kept": spec.kept, "undone": spec.undone, "called_off": spec.called_off})
        finally:
            undo()
            opt.close()
        row = {"variant": variant, "model": preset, "params": n, "bf16_cpu_path": bf16_cpu_path,
               "speculate": speculate and variant == "stream",
               "launch_share": optimizer_module.LAUNCH_SHARE, "backward_s": statistics.median(backward),
               "hooks_s": statistics.median(hooks), "step_s": statistics.median(step),
               "backward_all_s": [round(b, 4) for b in backward], "run_ahead": ahead}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="1.36b")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--bf16-cpu-path", action="store_true")
    ap.add_argument("--speculate", action="store_true")
    ap.add_argument("--launch-share", type=float)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args()
    variants = tuple(args.variants.split(","))
    if not set(variants) <= set(VARIANTS):
        ap.error(f"--variants: pick from {', '.join(VARIANTS)}")
    rows = run(args.model, args.iters, args.warmup, args.bf16_cpu_path, args.speculate, variants, args.launch_share)
    print(f"{'variant':<10} {'backward ms':>12} {'hooks ms':>9} {'step ms':>8}")
    for r in rows:
        print(f"{r['variant']:<10} {r['backward_s'] * 1e3:>12.1f} {r['hooks_s'] * 1e3:>9.1f} {r['step_s'] * 1e3:>8.1f}")


if __name__ == "__main__":
    main()

"""repro_2: a gradient changed after opt.clip_grad_norm_() (before step) escapes the inf/nan check.

clip_grad_norm_ caches the global norm for step() (optimizer.py, _grad_multipliers: ``raw = self._norm_cache``),
and step() decides "skip or not" from that cached norm alone. A NaN that reaches a gradient after the call is
not seen: the step is taken, not skipped and not counted, NaN goes into the master and the moments, and the
optimizer's own state_dict() is then refused by its own load_state_dict() ("holds inf/nan: the state_dict is
corrupt"). README: "every step checks the global norm once on the device before anything is written. With
nonfinite='skip' (the default) a step whose gradients hold inf/nan changes nothing". Without the
clip_grad_norm_ call the same step is skipped (shown below). The same stale norm also clips gradients added by
a backward after the call by the norm of the earlier ones only (a silent difference from torch, where
clip_grad_norm_ scales the gradients there and then; the README asks for the call "after the last backward").
"""
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout

import torch
from torch import nn

from deep_optimizer_states import DeepOptimizerStates


def run(clip_first: bool) -> DeepOptimizerStates:
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    opt = DeepOptimizerStates(model, lr=1e-2, schedule="cpu")  # nonfinite="skip", the default
    model(torch.randn(5, 8)).pow(2).mean().backward()
    if clip_first:
        opt.clip_grad_norm_(1.0)
    with torch.no_grad():
        model.bias.grad[0] = float("nan")  # e.g. a gradient-noise or masking step of the user's
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    skipped_warned = any("step skipped" in str(w.message) for w in caught)
    finite = all(torch.isfinite(opt.master(p)).all() and torch.isfinite(opt.state[p]["exp_avg"]).all()
                 for p in model.parameters() if opt.state[p])
    print(f"clip_grad_norm_ first: {clip_first}: skipped_steps={opt.skipped_steps} warned={skipped_warned} "
          f"states finite={finite}")
    return opt


run(clip_first=False)  # skipped, as documented
opt = run(clip_first=True)  # taken: NaN in the states
try:
    opt.load_state_dict(opt.state_dict())
    print("own state_dict loads")
except ValueError as err:
    print("own state_dict refused:", err)
assert opt.skipped_steps == 1, "the step with a NaN gradient was taken"

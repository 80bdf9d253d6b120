"""repro_4: opt.state[p]["master"] is stale after a weight edit (until the next step or an opt.master() call),
and writing it back (as Lightning and Accelerate do with every state tensor after a load:
``state[k] = state[k].to(device)``) silently reverts the edited weights.

README: "a weight changed in place outside the optimizer (model.load_state_dict(...), p.copy_(...) under
no_grad ...) becomes the new master at the next step"; opt.master(p) and state_dict() take such edits at once
(optimizer.py master(): ``self.layout.take_edits(settle=False)``; state_dict() likewise), but a read through
opt.state (HostState.__getitem__ -> DeepOptimizerStates._make_current, optimizer.py) does not: it returns the
master from before the edit. The same view then changes value when opt.master(p) is called. A write of that
stale value through opt.state[p]["master"] = ... (_before_state_write takes the edits first, then the stale
value is copied over them and the param follows its master) undoes the user's model.load_state_dict.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout

import torch
from torch import nn

from deep_optimizer_states import DeepOptimizerStates

torch.manual_seed(0)
model = nn.Linear(4, 2)
opt = DeepOptimizerStates(model, lr=1e-2, schedule="cpu")
model(torch.randn(3, 4)).sum().backward()
opt.step()
opt.zero_grad()

loaded = {"weight": torch.ones(2, 4), "bias": torch.zeros(2)}
model.load_state_dict(loaded)  # e.g. resuming from a model-only checkpoint
p = model.weight
print("param after load           ", p.detach()[0].tolist())
print("opt.state[p]['master']     ", opt.state[p]["master"][0].tolist(), "(stale)")

# what Lightning / Accelerate do after a load: every state tensor written back, moved to the model's device
# (on a GPU, .to("cuda") of a host tensor is a new tensor; here on the CPU, .clone() stands for it)
for key, value in list(opt.state[p].items()):
    if isinstance(value, torch.Tensor):
        opt.state[p][key] = value.clone()
print("param after the write-back ", p.detach()[0].tolist())
print("opt.master(p)              ", opt.master(p)[0].tolist())
assert torch.equal(p.detach(), loaded["weight"]), "the loaded weights were reverted by writing opt.state back"

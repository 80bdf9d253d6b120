"""repro_1: with stream_grads=True, the CPU path's .grad are None after backward, so later steps that torch takes
with those gradients (or with zeros) are silently not taken.

torch: zero_grad(set_to_none=False) leaves every .grad a zero tensor, so a param that gets no gradient in the next
backward is still stepped by AdamW (a zero gradient: its moments decay, it moves by m_hat/sqrt(v_hat), weight decay
applies). With stream_grads the CPU-placed params' gradients were given back during the last backward
(core/grad_stream.py, GradStream._give_back: ``p.grad = None``), so zero_grad(set_to_none=False) leaves them
None, and the next step skips them (optimizer.py _has_grad: ``f or self.grad_stream.had_grad(p)``, and the
stream's record is reset at every step() and zero_grad()). Same root: a second step() on the same gradients (no
backward between) updates only the params whose gradients stayed on the device, and a loop that does not zero
the gradients between steps accumulates only those. No error or warning; the result differs from
torch.optim.AdamW and from the same optimizer with stream_grads=False.
"""
import copy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout

import torch
from torch import nn

from deep_optimizer_states import DeepOptimizerStates


def run(case: str) -> list[str]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    twin = copy.deepcopy(model)
    ours = DeepOptimizerStates(model, lr=1e-2, schedule="cpu", stream_grads=True)
    ref = torch.optim.AdamW(twin.parameters(), lr=1e-2, fused=True)
    x = torch.randn(5, 8)
    for m, o in ((model, ours), (twin, ref)):
        m(x).pow(2).mean().backward()  # step 1: every param has a gradient
        o.step()
        if case == "zero_grad(set_to_none=False), then a step without the last layer":
            o.zero_grad(set_to_none=False)  # torch: every .grad is now zeros
            m[0](x).pow(2).mean().backward()  # the last Linear gets no gradient: its .grad stays zeros in torch
            o.step()
        else:  # "step() twice on the same gradients"
            o.step()
    return [n for (n, p), q in zip(model.named_parameters(), twin.parameters())
            if not torch.equal(ours.master(p), q.detach())]


failed = False
for case in ("zero_grad(set_to_none=False), then a step without the last layer", "step() twice on the same gradients"):
    bad = run(case)
    print(f"{case}: params that differ from torch.optim.AdamW: {bad or 'none'}")
    failed |= bool(bad)
assert not failed, "stream_grads=True differs from torch.optim.AdamW"

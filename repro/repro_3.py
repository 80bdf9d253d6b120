"""repro_3: stream_grads + reentrant activation checkpointing + a param used in two checkpointed segments (or in
one and outside it): the backward raises "a second backward reached gradients that stream_grads has already
treated as final ... run the backward of every micro-batch but the last under `with opt.accumulating():`",
although there is one backward and one micro-batch.

Reentrant checkpointing (torch.utils.checkpoint(..., use_reentrant=True), transformers'
gradient_checkpointing_enable() with use_reentrant=True) runs a nested backward per segment: a param read in
two segments (weights shared across layers, as in ALBERT or a looped block) is accumulated into once per nested
backward, and its post-accumulate-grad hook runs once per segment. GradStream._final_grad
(core/grad_stream.py: ``if id(p) in self.versions: raise``) takes the first call as the param's final gradient
(the CPU-placed subgroups are sent down and the gradient given back) and refuses the second. The README says
checkpointing "works with stream_grads and overlap (tested bit for bit, reentrant or not)". Without
stream_grads (or with use_reentrant=False) the same loop trains and equals torch's AdamW.
"""
import copy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from deep_optimizer_states import DeepOptimizerStates


class Looped(nn.Module):
    """One block applied twice (shared weights), each application checkpointed."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.reentrant = reentrant
        self.block = nn.Linear(16, 16)
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        for _ in range(2):
            x = checkpoint(lambda h: torch.tanh(self.block(h)), x, use_reentrant=self.reentrant)
        return self.head(x).pow(2).mean()


def train(reentrant: bool, stream_grads: bool) -> str:
    model = Looped(reentrant)
    twin = copy.deepcopy(model)
    opt = DeepOptimizerStates(model, lr=1e-2, schedule="cpu", stream_grads=stream_grads)
    ref = torch.optim.AdamW(twin.parameters(), lr=1e-2, fused=True)
    x = torch.randn(8, 16, requires_grad=True)  # reentrant checkpointing needs an input that requires grad
    try:
        for m, o in ((model, opt), (twin, ref)):
            for _ in range(3):
                o.zero_grad()
                m(x).backward()
                o.step()
    except RuntimeError as err:
        return f"RuntimeError: {str(err)[:110]}..."
    same = all(torch.equal(opt.master(p), q.detach()) for p, q in zip(model.parameters(), twin.parameters()))
    return f"trains, equal to torch AdamW: {same}"


results = {}
for reentrant in (False, True):
    for stream in (False, True):
        results[reentrant, stream] = train(reentrant, stream)
        print(f"use_reentrant={reentrant!s:5} stream_grads={stream!s:5}: {results[reentrant, stream]}")
assert results[True, True].startswith("trains"), "reentrant checkpointing + stream_grads fails on shared weights"

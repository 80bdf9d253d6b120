"""Backward's time on the CPU with our gradient hooks (``stream_grads``, ``overlap``, ``prefetch``,
``speculate``), on a model with as many params as the 1.36B one (216: 24 blocks of nine) but tiny ones, so
that the hooks' Python, not the arithmetic, is what the time shows. Room for two slots filled ahead, as the
bounded fills leave at 1.36B after a few subgroups. One thread. Compare two trees by running it in each:

    PYTHONPATH=TREE python3 -m bench.hook_cost --steps 220
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from deep_optimizer_states import DeepOptimizerStates
from deep_optimizer_states.core.slots import FILL_BYTES_PER_ELEMENT


class Block(torch.nn.Module):
    """Nine params, as a Llama block has: four projections, a gated MLP's three, two norms."""

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (torch.nn.Linear(d, d, bias=False) for _ in range(4))
        self.gate, self.up = torch.nn.Linear(d, 2 * d, bias=False), torch.nn.Linear(d, 2 * d, bias=False)
        self.down = torch.nn.Linear(2 * d, d, bias=False)
        self.n1, self.n2 = torch.nn.RMSNorm(d), torch.nn.RMSNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.n1(x)
        x = x + self.o(self.q(h) * self.k(h) + self.v(h))
        h = self.n2(x)
        return x + self.down(torch.nn.functional.silu(self.gate(h)) * self.up(h))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=220)
    ap.add_argument("--warmup", type=int, default=20)
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(*[Block() for _ in range(24)]).to(torch.bfloat16)
    opt = DeepOptimizerStates(model, lr=1e-3, schedule=2, subgroup_size=30_000, stream_grads=True, overlap=True,
                              prefetch=True, speculate=True)
    biggest = max(sg.numel for sg in opt.layout.subgroups)
    opt.planner.room_ahead = lambda resident, ahead: max(0, 2 * FILL_BYTES_PER_ELEMENT * biggest - ahead)
    x = torch.randn(8, 64).to(torch.bfloat16)
    times = []
    for i in range(args.steps):
        opt.zero_grad()
        loss = model(x).float().pow(2).mean()
        opt.synchronize()
        start = time.perf_counter()
        loss.backward()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
        opt.step()
        opt.synchronize()
    print(f"params {sum(1 for _ in model.parameters())}, subgroups {len(opt.layout.subgroups)}: "
          f"backward median {statistics.median(times) * 1e3:.2f} ms over {len(times)}")


if __name__ == "__main__":
    main()

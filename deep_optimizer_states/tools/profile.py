"""`dos profile`: a few training iterations, then a timeline of the last one.

The picture (PNG) has one row per phase and per lane of the update: the GPU streams (grads down, params up,
stage in, GPU AdamW, stage out) and the CPU worker's AdamW, each subgroup a bar, with the GPU memory
allocated over the iteration beneath (on a GPU). The same timeline is written as a Chrome trace (JSON) that
opens in Perfetto or chrome://tracing for zooming. This is where the interleaving shows at a glance.

``kernels=True`` also records the last iteration with torch.profiler (every op on the CPU threads, every
kernel and copy on the GPU streams) into kernels.json: where backward spends its time while gradients
stream down (``stream_grads``) and the CPU path runs ahead (``speculate``), which the lanes above do not show.
``kernel_summary`` reads it back per phase: the wall, each GPU stream's busy time, and the CPU time of the
gradient hooks and of their waits for the last update.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Iterator

import torch

from ..core.schedule import Schedule
from ..optimizer import DeepOptimizerStates
from .models import llama

LANES = ("grads_down", "params_up", "stage_in", "gpu", "stage_out", "resident", "cpu_adam")
COLORS = {"forward": "#4c72b0", "backward": "#dd8452", "update": "#55a868", "grads_down": "#8172b3",
          "params_up": "#937860", "stage_in": "#da8bc3", "gpu": "#c44e52", "stage_out": "#8c8c8c",
          "resident": "#64b5cd", "cpu_adam": "#ccb974"}


SAMPLE_EVERY_S = 0.001  # the memory sampler's period during the traced iteration


class _Clock:
    """Seconds since the iteration began, with the device synchronised first (phases end on the GPU), and
    the GPU memory (allocated, reserved) over the iteration: sampled at phase points and module hooks, and
    by a thread every SAMPLE_EVERY_S while ``sampling`` (the update allocates inside ``step``, out of
    reach of any hook)."""

    def __init__(self, device: torch.device, read=None) -> None:
        self.device = device
        self.read = read or (_cuda_memory(device) if device.type == "cuda" else None)
        self.sync()
        self.t0 = time.perf_counter()
        self.memory: list[tuple[float, float, float]] = []  # (seconds, GB allocated, GB reserved)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def sample(self) -> None:
        if self.read is not None:
            allocated, reserved = self.read()
            self.memory.append((self.now(), allocated / 1e9, reserved / 1e9))

    @contextlib.contextmanager
    def sampling(self) -> Iterator[None]:
        """Sample the memory from a thread while the enclosed code runs."""
        if self.read is None:
            yield
            return
        stop = threading.Event()

        def run() -> None:
            while not stop.wait(SAMPLE_EVERY_S):
                self.sample()

        thread = threading.Thread(target=run, name="dos-profile-memory", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()
            self.memory.sort()


def _cuda_memory(device: torch.device):
    return lambda: (torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device))


def _memory_hooks(model: torch.nn.Module, clock: _Clock) -> list:
    """On a GPU, sample its memory after each leaf module's forward, and when backward reaches that module's
    output (the activations' swing)."""
    if clock.device.type != "cuda":
        return []

    def after_forward(module: torch.nn.Module, args: tuple, output: object) -> None:
        clock.sample()
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(lambda grad: clock.sample())

    return [m.register_forward_hook(after_forward) for m in model.modules() if not list(m.children())]


def profile(preset: str = "tiny", iterations: int = 3, schedule: Schedule = "auto", micro_batch: int = 2,
            seq: int = 128, device: str | None = None, out: str | Path = "profile",
            gpu_memory_budget: int | float | None = None, subgroup_size: int | None = None,
            stream_grads: bool = False, speculate: bool | int = False, bf16_cpu_path: bool = False,
            kernels: bool = False) -> dict:
    """Train ``iterations`` iterations of the ``preset`` Llama on random tokens and write the last one's
    timeline to ``out``/timeline.png and ``out``/trace.json (and, with ``kernels``, its torch.profiler
    trace to ``out``/kernels.json); returns the phases and paths. ``subgroup_size``: default a sixteenth
    of the model; the other options are the optimizer's."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = llama(preset, torch.bfloat16, dev)
    opt = DeepOptimizerStates(model, lr=1e-4, weight_decay=0.01, schedule=schedule,
                              gpu_memory_budget=gpu_memory_budget, stream_grads=stream_grads,
                              speculate=speculate, bf16_cpu_path=bf16_cpu_path,
                              subgroup_size=subgroup_size or max(64, sum(p.numel() for p in model.parameters()) // 16))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if opt.grad_stream is not None:
        opt.grad_stream.annotate = kernels
    ids = torch.randint(0, model.config.vocab_size, (micro_batch, seq), generator=torch.Generator().manual_seed(0))
    ids = ids.to(dev)
    for i in range(iterations):
        last = i == iterations - 1
        opt.engine.trace = last
        clock = _Clock(dev)
        handles = _memory_hooks(model, clock) if last else []
        recording = _kernels(dev) if last and kernels else contextlib.nullcontext()
        with recording as recorder, clock.sampling() if last else contextlib.nullcontext():
            clock.sample()
            with torch.profiler.record_function("dos.forward"):
                loss = model(input_ids=ids, labels=ids).loss
                clock.sync()
            t_fwd = clock.now()
            with torch.profiler.record_function("dos.backward"):
                loss.backward()
                clock.sync()
            t_bwd = clock.now()
            with torch.profiler.record_function("dos.step"):
                opt.step()
                clock.sync()
            t_upd = clock.now()
            clock.sample()
        opt.zero_grad()
        for h in handles:
            h.remove()
    phases = [("forward", 0.0, t_fwd), ("backward", t_fwd, t_bwd), ("update", t_bwd, t_upd)]
    blocks = [{**b, "start": b["start"] + t_bwd, "end": b["end"] + t_bwd} for b in opt.last_update.timeline]
    summary = None
    if kernels:
        recorder.export_chrome_trace(str(out / "kernels.json"))
        summary = kernel_summary(json.loads((out / "kernels.json").read_text())["traceEvents"])
    trace = _chrome_trace(phases, blocks, clock.memory)
    (out / "trace.json").write_text(json.dumps(trace))
    u = opt.last_update
    budget = opt.memory()["gpu_budget_bytes"]
    title = (f"{preset} on {dev}, schedule {schedule!r}"
             + (f", GPU budget {budget / 2**30:.0f} GiB" if budget else "")
             + f": {u.resident_subgroups} resident, {u.staged_subgroups} staged, {u.cpu_subgroups} on the CPU; "
             f"iteration {t_upd * 1e3:.1f} ms")
    _figure(phases, blocks, clock.memory, title, out / "timeline.png")
    opt.close()
    return {"phases": {name: round(b - a, 6) for name, a, b in phases}, "png": str(out / "timeline.png"),
            "trace": str(out / "trace.json"), "blocks": len(blocks), "speculated": u.speculated,
            "kernels": str(out / "kernels.json") if kernels else None, "kernel_summary": summary}


PHASES = ("forward", "backward", "step")


def kernel_summary(events: list[dict]) -> dict:
    """Per phase of a ``kernels`` trace: its wall (ms, GPU work included: profile synchronises each), each
    GPU stream's busy time inside it (kernels, copies and memsets, overlaps merged), and the count and CPU
    time of the gradient hooks (``dos.grad_hook``) and of their waits for the last update."""
    spans = {e["name"][4:]: (e["ts"], e["ts"] + e["dur"]) for e in events
             if e.get("cat") == "user_annotation" and e.get("name", "")[4:] in PHASES and "dur" in e}
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    out = {}
    for phase, (a, b) in spans.items():
        streams = defaultdict(list)
        for e in gpu:
            start, end = max(e["ts"], a), min(e["ts"] + e["dur"], b)
            if end > start:
                streams[str(e.get("args", {}).get("stream"))].append((start, end))

        def annotated(name: str) -> list[float]:
            return [e["dur"] for e in events if e.get("cat") == "user_annotation" and e.get("name") == name
                    and a <= e["ts"] < b and "dur" in e]

        hooks, waits = annotated("dos.grad_hook"), annotated("dos.wait_last_update")
        out[phase] = {"wall_ms": (b - a) / 1e3,
                      "stream_busy_ms": {k: _covered(v) / 1e3 for k, v in sorted(streams.items())},
                      "grad_hooks": len(hooks), "grad_hooks_ms": sum(hooks) / 1e3, "waits_ms": sum(waits) / 1e3}
    return out


def _covered(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of ``intervals``."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def _kernels(device: torch.device) -> torch.profiler.profile:
    """torch.profiler over the CPU threads, and the GPU's streams where there is one."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(activities=activities)


def _chrome_trace(phases, blocks, memory) -> dict:
    """Chrome trace format: complete events (ph X) in microseconds, one thread per row, memory as a counter."""
    rows = ["phases", *LANES]
    events = [{"name": "thread_name", "ph": "M", "pid": 1, "tid": i, "args": {"name": r}} for i, r in enumerate(rows)]
    events += [{"name": name, "ph": "X", "pid": 1, "tid": 0, "ts": a * 1e6, "dur": (b - a) * 1e6}
               for name, a, b in phases]
    events += [{"name": b["label"], "ph": "X", "pid": 1, "tid": rows.index(b["lane"]), "ts": b["start"] * 1e6,
                "dur": (b["end"] - b["start"]) * 1e6, "cat": b["lane"]} for b in blocks]
    events += [{"name": "GPU memory", "ph": "C", "pid": 1, "ts": t * 1e6,
                "args": {"allocated GB": allocated, "reserved GB": reserved}} for t, allocated, reserved in memory]
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _figure(phases, blocks, memory, title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = ["phases", *LANES]
    fig, (ax, mem) = plt.subplots(2, 1, figsize=(12, 5.5), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    for name, a, b in phases:
        ax.broken_barh([(a * 1e3, (b - a) * 1e3)], (0.1, 0.8), color=COLORS[name])
        ax.text((a + b) / 2 * 1e3, 0.5, name, ha="center", va="center", fontsize=8, color="white")
    for b in blocks:
        y = rows.index(b["lane"])
        ax.broken_barh([(b["start"] * 1e3, max(b["end"] - b["start"], 1e-7) * 1e3)], (y + 0.15, 0.7),
                       color=COLORS[b["lane"]], edgecolor="white", linewidth=0.3)
    ax.set_yticks([i + 0.5 for i in range(len(rows))], rows)
    ax.set_ylim(len(rows), 0)
    ax.set_title(title, fontsize=9)
    for _, _, b in phases[:-1]:
        for axis in (ax, mem):
            axis.axvline(b * 1e3, color="black", linewidth=0.6, linestyle="--")
    if memory:
        ms = [t * 1e3 for t, _, _ in memory]
        mem.plot(ms, [r for _, _, r in memory], color="grey", linewidth=1, linestyle="--", label="reserved")
        mem.plot(ms, [a for _, a, _ in memory], color="black", linewidth=1, label="allocated")
        mem.legend(loc="lower right", fontsize=7)
        mem.set_ylabel("GPU GB")
    else:
        mem.text(0.5, 0.5, "no GPU: memory not sampled", ha="center", va="center", transform=mem.transAxes)
        mem.set_yticks([])
    mem.set_xlabel("ms since the iteration began")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

"""`dos profile`: the timeline of one iteration, as a picture and as a Chrome trace (CPU lanes here)."""

import json

import pytest

from deep_optimizer_states.tools.profile import LANES, profile


def test_profile_writes_a_figure_and_a_trace_with_every_subgroup(tmp_path):
    result = profile("tiny", iterations=2, schedule=2, seq=32, out=tmp_path)
    png = (tmp_path / "timeline.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    phases = [e for e in events if e["ph"] == "X" and e["tid"] == 0]
    assert [e["name"] for e in phases] == ["forward", "backward", "update"]
    update = phases[-1]
    blocks = [e for e in events if e["ph"] == "X" and e["tid"] > 0]
    assert len(blocks) == result["blocks"] > 0
    lanes = {LANES[e["tid"] - 1] for e in blocks}
    assert {"cpu_adam", "gpu", "stage_in", "stage_out", "grads_down", "params_up"} == lanes  # schedule 2: both paths
    cpu_subgroups = {e["name"] for e in blocks if e["cat"] == "cpu_adam"}
    staged_subgroups = {e["name"] for e in blocks if e["cat"] == "gpu"}
    assert cpu_subgroups and staged_subgroups and not cpu_subgroups & staged_subgroups
    for e in blocks:  # every block lies inside the update phase (same clock)
        assert update["ts"] - 1 <= e["ts"] and e["ts"] + e["dur"] <= update["ts"] + update["dur"] + 1


def test_dos_profile_from_the_command_line(tmp_path, capsys):
    from deep_optimizer_states.tools.cli import main

    assert main(["profile", "--iterations", "2", "--seq", "32", "--schedule", "2", "--out", str(tmp_path)]) == 0
    assert "timeline:" in capsys.readouterr().out
    assert (tmp_path / "timeline.png").stat().st_size > 10_000
    assert json.loads((tmp_path / "trace.json").read_text())["traceEvents"]


def test_memory_is_sampled_by_a_thread_through_the_update(tmp_path):
    """The update allocates inside step(), where no module hook reaches: a thread samples allocated and
    reserved memory all through the iteration (a fake reading here: the CPU has no device memory)."""
    import time

    import torch

    from deep_optimizer_states.tools import profile as prof

    level = [1e9]
    clock = prof._Clock(torch.device("cpu"), read=lambda: (level[0], 1.5 * level[0]))
    with clock.sampling():
        time.sleep(0.05)
        level[0] = 3e9  # an allocation inside the update
        time.sleep(0.05)
    times = [t for t, _, _ in clock.memory]
    assert len(times) > 10 and times == sorted(times)
    assert {1.0, 3.0} <= {round(a, 3) for _, a, _ in clock.memory}
    assert all(r == 1.5 * a for _, a, r in clock.memory)
    phases = [("forward", 0.0, 0.03), ("backward", 0.03, 0.05), ("update", 0.05, 0.1)]
    prof._figure(phases, [], clock.memory, "fake memory", tmp_path / "memory.png")
    assert (tmp_path / "memory.png").stat().st_size > 10_000
    counters = [e for e in prof._chrome_trace(phases, [], clock.memory)["traceEvents"] if e["ph"] == "C"]
    assert len(counters) == len(clock.memory) and set(counters[0]["args"]) == {"allocated GB", "reserved GB"}


def test_profile_runs_ahead_with_streamed_gradients_and_records_the_ops(tmp_path):
    """With ``stream_grads`` and ``speculate`` the CPU subgroups' updates run during backward (the update
    then takes them as done), and ``kernels`` writes torch.profiler's trace of the iteration, backward's ops
    among them."""
    result = profile("tiny", iterations=2, schedule=2, seq=32, out=tmp_path, stream_grads=True, speculate=True,
                     kernels=True)
    assert result["speculated"] > 0
    events = json.loads((tmp_path / "kernels.json").read_text())["traceEvents"]
    names = {e.get("name", "") for e in events}
    assert any("backward" in n.lower() for n in names) and any(n.startswith("aten::") for n in names)
    summary = result["kernel_summary"]
    assert set(summary) == {"forward", "backward", "step"} and all(k["wall_ms"] > 0 for k in summary.values())
    from deep_optimizer_states.tools.models import llama

    params = sum(p.requires_grad for p in llama("tiny").parameters())
    assert summary["backward"]["grad_hooks"] == params and summary["backward"]["grad_hooks_ms"] > 0
    assert summary["forward"]["grad_hooks"] == summary["step"]["grad_hooks"] == 0
    plain = profile("tiny", iterations=2, schedule=2, seq=32, out=tmp_path / "plain")
    assert plain["speculated"] == 0 and plain["kernels"] is None and not (tmp_path / "plain" / "kernels.json").exists()


def test_dos_profile_refuses_speculate_without_streamed_gradients(tmp_path, capsys):
    from deep_optimizer_states.tools.cli import main

    with pytest.raises(SystemExit):
        main(["profile", "--speculate", "--out", str(tmp_path)])
    assert "--speculate needs --stream-grads" in capsys.readouterr().err


def test_kernel_summary_merges_each_streams_work_inside_each_phase():
    """A GPU trace, written out by hand: per phase, each stream's busy time counts overlapping kernels and
    copies once and only their part inside the phase; the gradient hooks and their waits are summed."""
    from deep_optimizer_states.tools.profile import kernel_summary

    def span(cat, name, ts, dur, **args):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": args}

    events = [span("user_annotation", "dos.forward", 0, 100), span("user_annotation", "dos.backward", 100, 200),
              span("kernel", "gemm", 90, 30, stream=7),  # 20 of its 30 us inside backward
              span("kernel", "gemm", 115, 40, stream=7), span("kernel", "add", 130, 10, stream=7),  # overlapped
              span("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 150, 100, stream=20),
              span("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 280, 50, stream=20),  # 20 us inside
              span("user_annotation", "dos.grad_hook", 120, 5), span("user_annotation", "dos.grad_hook", 200, 7),
              span("user_annotation", "dos.wait_last_update", 201, 3), span("cpu_op", "aten::mm", 110, 50)]
    out = kernel_summary(events)
    back = out["backward"]
    assert back["wall_ms"] == 0.2 and back["grad_hooks"] == 2 and back["waits_ms"] == 0.003
    assert abs(back["grad_hooks_ms"] - 0.012) < 1e-12
    assert back["stream_busy_ms"] == {"7": 0.055, "20": 0.12}  # [100, 155] and [150, 250] + [280, 300]
    assert out["forward"]["stream_busy_ms"] == {"7": 0.01} and out["forward"]["grad_hooks"] == 0

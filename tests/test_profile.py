"""`dos profile`: the timeline of one iteration, as a picture and as a Chrome trace (CPU lanes here)."""

import json

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

"""Staged subgroups' states filled ahead during backward (``prefetch=True``), on the CPU.

On a CPU-only machine there is no GPU memory to budget, so the planner's room for slots filled ahead is
set by each test (``opt.planner.room_ahead``); the slots are CPU tensors and the copies run in program
order: the same code paths as on a GPU. Every run is compared bit for bit with the same run without
prefetch, on the same data (test_grad_stream.py holds that one to torch's AdamW: a reference cannot ride
along here, as stream_grads gives the CPU path's gradients back during backward).
"""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch

from deep_optimizer_states import DeepOptimizerStates, Placement
from deep_optimizer_states.core.slots import FILL_BYTES_PER_ELEMENT as FILL_BYTES
from deep_optimizer_states.core.slots import SLOT_BYTES_PER_ELEMENT as SLOT_BYTES
from deep_optimizer_states.planning import budget as budget_module
from deep_optimizer_states.planning.budget import MemoryBudget
from deep_optimizer_states.planning.plan import Planner
from tests.harness import loss_of, mlp, needs_compiler, tiny_llama, without_stand_down
from tests.test_perfmodel import H200_LIKE
from tests.test_residency import FakeProbe

GB = 10**9
UNLIMITED = 10**15


def _build(prefetch: bool | str, kind: str = "mlp", room: int = UNLIMITED, **kwargs) -> tuple:
    model = (mlp if kind == "mlp" else tiny_llama)(torch.bfloat16, "cpu", seed=5)
    size = sum(p.numel() for p in model.parameters()) // 9
    kwargs = {"schedule": 2, "lr": 3e-3, "weight_decay": 0.1, **kwargs}
    opt = DeepOptimizerStates(model, subgroup_size=size, stream_grads=True, prefetch=prefetch, **kwargs)
    if prefetch:
        opt.planner.room_ahead = lambda resident_bytes, ahead_bytes: max(0, room - ahead_bytes)
    return model, opt


def _train(model, opt, steps: int, between=None, micro_batches: int = 1, seed: int = 11) -> list[int]:
    """Train ``steps`` steps; ``between(step)`` acts after backward, before the step. Returns how many
    subgroups each update found filled ahead."""
    gen = torch.Generator().manual_seed(seed)
    filled = []
    for step in range(steps):
        opt.zero_grad()
        for k in range(micro_batches):
            if k < micro_batches - 1:
                with opt.accumulating():
                    (loss_of(model, gen) / micro_batches).backward()
            else:
                (loss_of(model, gen) / micro_batches).backward()
        if between is not None:
            between(step)
        opt.step()
        opt.synchronize()
        filled.append(opt.last_update.prefetched)
    return filled


def _masters(model, opt) -> list[torch.Tensor]:
    return [opt.master(p).clone() for p in model.parameters()]


def _assert_same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert all(torch.equal(x, y) for x, y in zip(a, b)), "filled ahead differs from staged at the update"


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("kwargs", [{}, {"max_grad_norm": 0.5}, {"schedule": "gpu"}, {"speculate": True},
                                    pytest.param({"speculate": True, "bf16_cpu_path": True, "max_grad_norm": 0.5},
                                                 marks=needs_compiler)],
                         ids=["mixed", "clipped", "all-staged", "speculate", "speculate+bf16+clipped"])
def test_states_filled_ahead_give_the_same_result_bit_for_bit(overlap, kwargs, monkeypatch):
    """Also beside the CPU path's update run ahead (``speculate``, with the bf16 CPU path): both during
    backward, the staged subgroups' states in, the CPU subgroups' AdamW on the worker (clipped: run, then
    undone, rather than standing down before they start)."""
    without_stand_down(monkeypatch)
    runs = []
    for prefetch in (False, True):
        model, opt = _build(prefetch, "llama", overlap=overlap, **kwargs)
        filled = _train(model, opt, steps=6, micro_batches=2)
        staged = opt.placements.count(Placement.STAGED)
        runs.append(_masters(model, opt))
    assert staged and filled == [staged] * 6, "every staged subgroup filled ahead, at every step"
    if kwargs.get("speculate"):
        assert opt.speculation.kept + opt.speculation.undone > 0, "the CPU path ran ahead too"
    _assert_same(*runs)


def test_a_slot_filled_ahead_holds_p_m_v_and_its_update_shares_one_gradient_buffer():
    """A slot filled ahead is 12 B/element (p, m, v in one allocation, no gradient row); the update takes
    the gradients of all of them, one after another, into one fp32 buffer of the biggest, which its own
    buffers count (``device_bytes``) beside the staging slots and the CPU path's scratch."""
    model = tiny_llama(torch.bfloat16, "cpu", seed=5)
    opt = DeepOptimizerStates(model, lr=3e-3, subgroup_size=12345, schedule="gpu", stream_grads=True, prefetch=True)
    opt.planner.room_ahead = lambda resident_bytes, ahead_bytes: max(0, UNLIMITED - ahead_bytes)
    gen = torch.Generator().manual_seed(3)
    opt.zero_grad()
    loss_of(model, gen).backward()
    ready = dict(opt.prefetch.ready)
    staged = [sg for sg, place in zip(opt.layout.subgroups, opt.placements) if place is Placement.STAGED]
    assert ready and set(ready) == {sg.index for sg in staged}
    assert len({sg.numel for sg in staged}) > 1, "subgroups of different sizes share the one buffer"
    for sg in staged:
        filled = ready[sg.index]
        assert not hasattr(filled, "g") and all(t.numel() == sg.numel for t in (filled.p, filled.m, filled.v))
        base = filled.p.untyped_storage()
        assert base.nbytes() == FILL_BYTES * sg.numel and FILL_BYTES == 12
        assert all(t.untyped_storage().data_ptr() == base.data_ptr() for t in (filled.m, filled.v))
    assert opt.prefetch.bytes() == FILL_BYTES * sum(sg.numel for sg in staged)
    seen = []
    update = opt.engine._update_staged

    def spy(job, slot, multipliers, grads, filled=None, filled_grad=None):
        seen.append(None if filled_grad is None else (filled_grad.data_ptr(), filled_grad.numel()))
        return update(job, slot, multipliers, grads, filled, filled_grad)

    opt.engine._update_staged = spy
    opt.step()
    opt.synchronize()
    assert len(seen) == len(staged) and len(set(seen)) == 1
    assert seen[0][1] == max(sg.numel for sg in staged)
    assert opt.last_update.device_bytes == 4 * seen[0][1]  # on the CPU: no staging slot, no GPU scratch


def test_no_memory_for_the_shared_gradient_buffer_sends_the_subgroups_filled_ahead_to_the_cpu(monkeypatch):
    """Where the update cannot allocate the gradient buffer its slots filled ahead share, those subgroups take
    the CPU path that step, with a warning (their host states are untouched: exact), and training goes on:
    bit for bit the run without prefetch."""
    runs = []
    for prefetch in (False, True):
        model, opt = _build(prefetch, "llama", schedule="gpu")
        if prefetch:
            buffers, empty, failing = opt.engine._buffers, torch.empty, []

            def no_memory(*args, **kwargs):
                if failing:
                    raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
                return empty(*args, **kwargs)

            def without_room(jobs, count, landed, ahead):
                failing.append(1)  # every subgroup is filled ahead: the buffer is the first allocation
                try:
                    return buffers(jobs, count, landed, ahead)
                finally:
                    failing.clear()

            monkeypatch.setattr(torch, "empty", no_memory)
            monkeypatch.setattr(opt.engine, "_buffers", without_room)
            with pytest.warns(UserWarning, match="gradient buffer of the subgroups filled ahead"):
                filled = _train(model, opt, steps=3)
            assert filled == [0, 0, 0] and opt.last_update.fallbacks == len(opt.layout.subgroups)
            monkeypatch.setattr(torch, "empty", empty)
        else:
            _train(model, opt, steps=3)
        runs.append(_masters(model, opt))
    _assert_same(*runs)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_the_room_bounds_the_slots_and_the_first_the_update_takes_come_first(overlap):
    model, opt = _build(True, "llama", overlap=overlap)
    staged = [sg for sg, place in zip(opt.layout.subgroups, opt.placements) if place is Placement.STAGED]
    biggest = max(sg.numel for sg in staged)
    opt.planner.room_ahead = lambda resident_bytes, ahead_bytes: max(0, FILL_BYTES * 2 * biggest - ahead_bytes)
    taken = []
    gen = torch.Generator().manual_seed(4)
    for _ in range(3):
        opt.zero_grad()
        loss_of(model, gen).backward()
        taken.append(sorted(opt.prefetch.ready))
        assert opt.prefetch.bytes() <= FILL_BYTES * 2 * biggest
        opt.step()
        opt.synchronize()
    order = sorted(staged, key=lambda sg: opt._need_order.get(sg.index, len(opt._need_order)))
    assert taken[-1] == sorted(sg.index for sg in order[:len(taken[-1])]) and len(taken[-1]) >= 1
    assert opt.prefetch.ready == {}, "an update takes every slot filled ahead"


def _edit_weight(model, opt):
    with torch.no_grad():
        next(model.parameters()).mul_(0.5)


def _write_moment(model, opt):
    opt.state[next(model.parameters())]["exp_avg"].mul_(0.25)


def _write_master(model, opt):
    p = next(model.parameters())
    opt.state[p]["master"] = opt.state[p]["master"] * 0.75


@pytest.mark.parametrize("change", [_edit_weight, _write_moment, _write_master],
                         ids=["edited-weight", "moment-written", "master-written"])
def test_a_host_change_between_backward_and_step_is_not_undone_by_a_copy_taken_ahead(change):
    """The first param sits in subgroup 0, which "2" stages and the update takes first."""
    runs = []
    for prefetch in (False, True):
        model, opt = _build(prefetch)
        filled = _train(model, opt, steps=5, between=lambda step: change(model, opt) if step == 2 else None)
        runs.append(_masters(model, opt))
        if prefetch:
            assert filled[1] > 0 and filled[2] < filled[1], "the copies taken before the change were dropped"
    _assert_same(*runs)


def test_a_checkpoint_loaded_between_backward_and_step_is_what_the_step_updates():
    runs = []
    for prefetch in (False, True):
        model, opt = _build(prefetch)
        _train(model, opt, steps=2)
        saved = opt.state_dict()
        _train(model, opt, steps=2, seed=12)
        filled = _train(model, opt, steps=2, seed=13, between=lambda step: opt.load_state_dict(saved) if step == 0
                        else None)
        runs.append(_masters(model, opt))
        if prefetch:
            assert filled == [0, opt.placements.count(Placement.STAGED)]
    _assert_same(*runs)


def test_a_skipped_step_drops_its_slots_and_the_next_one_fills_again():
    runs = []
    for prefetch in (False, True):
        model, opt = _build(prefetch)
        gen = torch.Generator().manual_seed(7)
        filled = []
        for step in range(4):
            opt.zero_grad()
            loss = loss_of(model, gen)
            (loss * float("inf") if step == 1 else loss).backward()  # step 1: inf/nan gradients
            if prefetch and step == 1:
                assert opt.prefetch.ready, "filled during the backward whose step is skipped"
            opt.step()
            filled.append(opt.last_update.prefetched)
            if prefetch:
                assert opt.prefetch.ready == {}
        assert opt.skipped_steps == 1
        if prefetch:
            assert filled[2] > 0
        runs.append(_masters(model, opt))
    _assert_same(*runs)


def test_no_room_no_slots_and_the_same_result():
    model, opt = _build(True, room=0)
    assert _train(model, opt, steps=3) == [0, 0, 0]


def test_prefetch_needs_stream_grads_and_a_bool_or_release():
    with pytest.raises(ValueError, match="prefetch=True needs stream_grads=True"):
        DeepOptimizerStates(mlp(), prefetch=True)
    with pytest.raises(ValueError, match="prefetch='release' needs stream_grads=True"):
        DeepOptimizerStates(mlp(), prefetch="release")
    for bad in ("yes", "rel", 1.0, None):
        with pytest.raises(ValueError, match="prefetch must be True, False or 'release'"):
            DeepOptimizerStates(mlp(), stream_grads=True, prefetch=bad)
    assert DeepOptimizerStates(mlp(), stream_grads=True, prefetch="release").engine.release_at_flush
    assert not DeepOptimizerStates(mlp(), stream_grads=True, prefetch=True).engine.release_at_flush


def test_the_room_ahead_keeps_the_budget_at_the_measured_peak():
    """Room for slots filled ahead: the budget less the measured need, the headroom, the residents, the
    update's own buffers and the slots already filled; never more than is free now less the headroom;
    none before a need was measured."""
    sizes = [1000] * 10
    probe = FakeProbe(total=100 * GB, limit=100 * GB, allocated=30 * GB, peak=40 * GB)
    planner = Planner(sizes, torch.device("cpu"), 4, rates=H200_LIKE, budget=MemoryBudget(50 * GB, probe))
    assert planner.room_ahead(0, 0) == 0, "no need measured yet"
    planner.budget.observe(0)
    headroom = planner.budget.headroom()
    own = (16 * 4 + 8 + 4) * 1000
    assert planner.room_ahead(0, 0) == 50 * GB - 40 * GB - headroom - own
    assert planner.room_ahead(2 * GB, 3 * GB) == 50 * GB - 40 * GB - headroom - own - 5 * GB
    filling = Planner(sizes, torch.device("cpu"), 4, rates=H200_LIKE, budget=planner.budget, prefetch=True)
    assert filling.room_ahead(0, 0) == 50 * GB - 40 * GB - headroom - own - 4 * 1000, \
        "with prefetch the update also holds the gradient buffer its slots filled ahead share"
    probe.alloc = 45 * GB  # backward holds more now: what is free bounds it
    assert planner.room_ahead(0, 0) == 5 * GB - headroom


def test_the_room_ahead_holds_no_more_than_the_link_carries_in_the_rest():
    """Once the rest of the iteration is learnt (``overlap``), the room for fills is also bounded by the
    slots of what the link carries in it (``Planner.carried``): more could not come in before the update
    and would only hold memory. None before a rest is learnt (the first steps), unbounded without overlap;
    the memory bounds where it is tighter."""
    sizes = [1000] * 10
    probe = FakeProbe(total=100 * GB, limit=100 * GB, allocated=30 * GB, peak=40 * GB)
    planner = Planner(sizes, torch.device("cpu"), 4, rates=H200_LIKE, budget=MemoryBudget(50 * GB, probe),
                      overlap=True, prefetch=True)
    planner.budget.observe(0)
    assert planner.fill_cap() == 0 and planner.room_ahead(0, 0) == 0, "no rest learnt yet: no fills"
    plain = Planner(sizes, torch.device("cpu"), 4, rates=H200_LIKE, budget=planner.budget, prefetch=True)
    memory = plain.room_ahead(0, 0)
    assert plain.fill_cap() == math.inf and memory > 5 * GB, "without overlap no rest is learnt: the memory alone"
    for _ in range(2):  # the first updates teach no rest (one-off costs)
        planner.observe(SimpleNamespace(speculated_elements=0, prefetched_elements=0, prefetched=0, speculated=0))
    planner.observe_step(0.3, 0.2)
    assert planner.rest_s == pytest.approx(0.1)
    carried = int(0.1 * H200_LIKE.link_contended / 12)  # elements: 12 B each way the link carries
    assert abs(int(planner.carried) - carried) <= 1
    cap = int(planner.carried) * FILL_BYTES
    assert planner.fill_cap() == cap and cap < memory
    assert planner.room_ahead(0, 0) == cap
    assert planner.room_ahead(0, cap // 4) == cap - cap // 4, "the slots already filled count against it"
    probe.alloc = 48 * GB  # backward holds more now: what is free is the tighter bound
    assert planner.room_ahead(0, 0) == 2 * GB - planner.budget.headroom()


def test_an_optimizer_fills_ahead_only_what_the_link_carries_and_gives_the_same_result(monkeypatch):
    """End to end: with the planner's bound at 3.5 subgroups' worth, each backward fills the first three
    subgroups of the update's order and no more (the update stages the rest itself), bit for bit the
    result of the same run without prefetch."""
    runs = {}
    for prefetch in (False, True):
        model, opt = _build(prefetch, overlap=True, schedule="gpu")
        if prefetch:
            size = max(sg.numel for sg in opt.layout.subgroups)
            monkeypatch.setattr(Planner, "carried", property(lambda self: 3.5 * size))
            opt.planner.room_ahead = Planner.room_ahead.__get__(opt.planner)
            probe = FakeProbe(total=100 * GB, limit=100 * GB, allocated=GB, peak=GB)
            opt.planner.budget = MemoryBudget(50 * GB, probe)
        filled = _train(model, opt, steps=4)
        runs[prefetch] = _masters(model, opt)
    assert filled[0] == 0 and filled[1:] == [3, 3, 3], filled
    _assert_same(runs[False], runs[True])


def test_the_steps_before_a_rest_is_learnt_do_not_hold_the_priced_fills_at_none():
    """Overlapped, the first steps fill nothing (no rest learnt, nothing carried); from then on every staged
    subgroup is filled. The plan must price those fills: the empty steps were bounded by their room, not
    fills stopping short, and an update that fills all its staged subgroups teaches no reach that would
    replace them (on an H200 the window kept pricing none filled, tests/gpu/test_gpu_overlap.py)."""
    model, opt = _build(True, overlap=True, schedule="offload")
    opt.planner.room_ahead = Planner.room_ahead.__get__(opt.planner)
    probe = FakeProbe(total=100 * GB, limit=100 * GB, allocated=GB, peak=GB)
    planner = Planner([sg.numel for sg in opt.layout.subgroups], torch.device("cpu"), 4, rates=H200_LIKE,
                      budget=MemoryBudget(50 * GB, probe), overlap=True, prefetch=True)
    planner._gpu = True  # plan and measure as on a GPU (the fake probe stands for its memory)
    opt.planner = planner
    opt.schedule = 2  # a fixed split: the same staged subgroups every step
    staged = opt.placements.count(Placement.STAGED)
    filled = _train(model, opt, steps=8)
    assert filled[:3] == [0, 0, 0] and filled[-3:] == [staged] * 3, filled
    assert planner.rest_s > 0 and planner.carried > 0
    assert planner.window.filled == pytest.approx(min(planner.fill_room() // FILL_BYTES, planner.carried))

@pytest.mark.parametrize("schedule", ["offload", 2], ids=str)
def test_the_slots_filled_ahead_are_not_counted_in_the_need_of_forward_and_backward(schedule):
    """The fills raise the allocator's peak during backward; the need the budget measures (which sizes the
    residents and the room for fills) must stay forward's and backward's own. A fixed schedule measures
    it too (else it would never fill)."""
    model, opt = _build(True)
    opt.planner.room_ahead = Planner.room_ahead.__get__(opt.planner)  # the planner's own room, not the tests'
    base = 10 * GB

    class Allocator(FakeProbe):
        def peak(self):  # the allocator's peak: monotone, raised by the slots filled ahead
            self.peak_bytes = max(self.peak_bytes, base + opt.prefetch.bytes())
            return self.peak_bytes

    probe = Allocator(total=100 * GB, limit=100 * GB, allocated=base, peak=base)
    planner = Planner([sg.numel for sg in opt.layout.subgroups], torch.device("cpu"), 4, rates=H200_LIKE,
                      budget=MemoryBudget(50 * GB, probe))
    planner._gpu = True  # plan and measure as on a GPU (the fake probe stands for its memory)
    opt.planner = planner
    opt.schedule = schedule
    filled = _train(model, opt, steps=4)
    assert filled[0] == 0 and all(filled[1:]), "no need measured before the first step: fills from the second"
    assert probe.peak_bytes > base and planner.budget.need == base


def test_the_room_ahead_counts_the_residents_the_update_will_admit():
    """At the first step no resident is admitted yet; the room for fills must leave their states' bytes."""
    model, opt = _build(True)
    count = len(opt.layout.subgroups)
    opt.schedule = [("resident", "staged", "cpu")[i % 3] for i in range(count)]
    seen = []
    opt.planner.room_ahead = lambda resident_bytes, ahead_bytes: seen.append(resident_bytes) or UNLIMITED
    _train(model, opt, steps=1)
    planned = 12 * sum(sg.numel for sg in opt.layout.subgroups[::3])
    assert seen and seen[0] == planned and len(opt.residents) == len(opt.layout.subgroups[::3])


def test_the_fill_lane_keeps_no_record_of_its_work():
    """Nobody reads the fill lane's busy time: it must not gather a timing record per fill, step after step."""
    model, opt = _build(True)
    _train(model, opt, steps=3)
    assert opt.prefetch.filled > 0 and opt.prefetch.lane._spans == []


@pytest.mark.parametrize("prefetch", [False, True, "release"], ids=str)
def test_an_update_left_running_into_the_next_forward_is_not_counted_in_its_need(prefetch):
    """With ``overlap`` the update holds its buffers (staging slots, scratch, and the slots filled ahead it
    took, each let go at its flush with ``"release"``) into the next forward: the allocator's peak is then
    the model's memory plus them. The need must stay the model's, and still rise when the model's does."""
    model, opt = _build(prefetch, overlap=True)
    model_bytes, held = {"now": 10 * GB}, {"now": 0}

    class Allocator(FakeProbe):
        def peak(self):  # the model's memory beside what the update and this backward's fills hold now
            filled = opt.prefetch.bytes() if prefetch else 0  # until an update takes them
            self.peak_bytes = max(self.peak_bytes, model_bytes["now"] + held["now"] + filled)
            return self.peak_bytes

    probe = Allocator(total=100 * GB, limit=100 * GB, allocated=10 * GB, peak=10 * GB)
    planner = Planner([sg.numel for sg in opt.layout.subgroups], torch.device("cpu"), 4, rates=H200_LIKE,
                      budget=MemoryBudget(50 * GB, probe), overlap=True, prefetch=bool(prefetch))
    planner._gpu = True  # plan and measure as on a GPU (the fake probe stands for its memory)
    opt.planner = planner
    opt.schedule = 2  # a fixed split: the same staged subgroups every step
    if prefetch:
        opt.planner.room_ahead = lambda resident_bytes, ahead_bytes: max(0, UNLIMITED - ahead_bytes)
    note, told = opt.engine.on_memory, []

    def on_memory(nbytes: int) -> None:  # the allocator's peak passes through what the update holds
        note(nbytes)
        held["now"] = nbytes
        told.append(nbytes)
        probe.peak()

    opt.engine.on_memory = on_memory
    filled = _train(model, opt, steps=4)
    assert max(told) > 0 and told[-1] == 0 and probe.peak_bytes > 10 * GB
    if prefetch:
        assert all(filled[1:]), "fills from the second step"
    if prefetch == "release":
        assert len([t for t in told if t > 0]) > 2, "the update told each slot it let go"
    assert planner.budget.need == 10 * GB
    model_bytes["now"] = 12 * GB  # a longer batch
    _train(model, opt, steps=2)
    assert planner.budget.need == 12 * GB


def test_a_need_that_grows_late_in_backward_is_still_measured_with_fills_held():
    """The fills are held from early in backward; forward's and backward's own memory, growing late in a
    later step (gradients piling up, a longer batch), must still raise the need (as without prefetch)."""
    needs = {}
    for prefetch in (False, True):
        model, opt = _build(prefetch)
        if prefetch:
            opt.planner.room_ahead = Planner.room_ahead.__get__(opt.planner)
        now = {"step": 0, "hooks": 0}

        class Allocator(FakeProbe):
            def peak(self):  # the model's bytes: 10 GB early in backward, 12 (14 from step 3) late in it
                late = now["hooks"] > 4
                model_bytes = 10 * GB + (0 if not late else (2 if now["step"] < 3 else 4) * GB)
                self.peak_bytes = max(self.peak_bytes, model_bytes + (opt.prefetch.bytes() if prefetch else 0))
                return self.peak_bytes

        probe = Allocator(total=100 * GB, limit=100 * GB, allocated=10 * GB, peak=10 * GB)
        planner = Planner([sg.numel for sg in opt.layout.subgroups], torch.device("cpu"), 4, rates=H200_LIKE,
                          budget=MemoryBudget(50 * GB, probe))
        planner._gpu = True
        opt.planner = planner
        opt.schedule = 2
        hook = opt.grad_stream.after_grad

        def counting():
            now["hooks"] += 1
            probe.peak()  # the allocator passes through this moment's memory
            if hook is not None:
                hook()

        opt.grad_stream.after_grad = counting
        needs[prefetch], filled = [], []
        for step in range(1, 6):
            now["step"], now["hooks"] = step, 0
            filled += _train(model, opt, steps=1)
            needs[prefetch].append(planner.budget.need)
        if prefetch:
            assert all(filled[1:]), "fills from the second step"
    assert needs[True] == needs[False] == [12 * GB, 12 * GB, 14 * GB, 14 * GB, 14 * GB]


def test_a_torch_state_dict_loaded_between_backward_and_step_is_what_the_step_updates():
    """A torch AdamW state_dict (no fp32 masters in it) writes the moments through no weight edit: the
    copies taken ahead of the load must go too."""
    runs = []
    for prefetch in (False, True):
        model, opt = _build(prefetch)
        _train(model, opt, steps=2)
        sd = opt.state_dict()
        saved = {"state": {k: {n: v[n].clone() for n in ("step", "exp_avg", "exp_avg_sq")}
                           for k, v in sd["state"].items()}, "param_groups": sd["param_groups"]}
        _train(model, opt, steps=2, seed=12)
        _train(model, opt, steps=2, seed=13, between=lambda step: opt.load_state_dict(saved) if step == 0 else None)
        runs.append(_masters(model, opt) + [opt.state[p]["exp_avg"].clone() for p in model.parameters()])
    _assert_same(*runs)


@pytest.mark.parametrize("prefetch,room_in_slots", [(False, 2.5), (True, 8), ("release", 8)], ids=str)
def test_overlapped_steps_keep_a_simulated_allocator_within_the_budget(prefetch, room_in_slots, monkeypatch):
    """End to end on a simulated allocator: the model's memory (higher from the first forward until its
    backward ends, as activations are), the slots filled ahead not yet taken and what the update holds
    beside the next forward, read at every module's forward, every batch of fills, every change of the
    update's memory and every step. With room for ``room_in_slots`` staging slots beside the model's peak
    (and the scratch the planner sets aside), no moment goes past the budget, while every update stages
    through slots and, with prefetch, backward fills some ahead. Without the cap on overlapped slots the
    first case goes 0.75 slot past it (what is free at the step gives all four); with the update's buffers
    counted in the need, the room for slots and fills reads as none."""
    monkeypatch.setattr(budget_module, "MIN_HEADROOM_BYTES", 0)  # the headroom would hide every slot here
    monkeypatch.setattr(budget_module, "HEADROOM_FRACTION", 0.0)
    model, opt = _build(prefetch, "llama", overlap=True, schedule="gpu")
    sizes = [sg.numel for sg in opt.layout.subgroups]
    slot = SLOT_BYTES * max(sizes)
    low, high = 100 * slot, 106 * slot  # the model's memory at the step, and from its forward to backward's end
    memory = {"model": high, "update": 0}
    seen = []

    class Allocator(FakeProbe):
        def allocated(self):
            return memory["model"] + memory["update"] + (opt.prefetch.bytes() if prefetch else 0)

        def peak(self):  # every reading is a moment the allocator passes through
            seen.append(self.allocated())
            self.peak_bytes = max(self.peak_bytes, seen[-1])
            return self.peak_bytes

        def free(self):
            return self._limit - self.allocated()

    probe = Allocator(total=10**12, limit=10**12, peak=high)
    scratch = (8 + 4 + (4 if prefetch else 0)) * max(sizes)  # the CPU path's, the residents', the fills' buffer
    budget = high + scratch + int(room_in_slots * slot)
    planner = Planner(sizes, torch.device("cpu"), 4, rates=H200_LIKE, budget=MemoryBudget(budget, probe),
                      overlap=True, prefetch=bool(prefetch))
    planner._gpu = True  # plan and measure as on a GPU (the simulated allocator stands for its memory)
    opt.planner = planner
    opt.schedule = "gpu"
    if prefetch:
        opt.planner.room_ahead = Planner.room_ahead.__get__(opt.planner)  # the planner's own room
    note = opt.engine.on_memory

    def on_memory(nbytes: int) -> None:
        note(nbytes)
        memory["update"] = nbytes
        probe.peak()

    def forward(*args) -> None:
        memory["model"] = high
        probe.peak()

    opt.engine.on_memory = on_memory
    hooks = [m.register_forward_pre_hook(forward) for m in model.modules()]
    gen, slots, filled = torch.Generator().manual_seed(11), [], []
    for _ in range(8):
        opt.zero_grad()
        loss_of(model, gen).backward()
        probe.peak()
        memory["model"] = low  # activations gone
        opt.step()  # left running into the next forward
        slots.append(opt.plan.slots)
        if opt.last_update is not None:
            filled.append(opt.last_update.prefetched)
    opt.synchronize()
    for h in hooks:
        h.remove()
    assert max(seen) <= budget, (max(seen) - budget) / slot
    assert min(slots[1:]) >= 1 and opt.last_update.staged_subgroups == len(sizes)
    if prefetch:
        assert any(filled), "backward filled some slots ahead"
    else:
        assert slots[1:] == [2] * 7, slots


def test_a_step_that_runs_the_plan_its_gradients_streamed_for_takes_no_more_slots_than_fit_now():
    """With streamed CPU gradients the step runs the plan of its backward; a plan made at the step with
    fewer staging slots (less memory now) bounds that update's slots all the same."""
    model, opt = _build(False)
    refresh, update, seen = opt.planner.refresh, opt.engine.update, []

    def fewer_slots(*args, **kwargs):
        return dataclasses.replace(refresh(*args, **kwargs), slots=1)

    def spy(jobs, multipliers, max_slots, residents, landed, *args, **kwargs):
        seen.append((max_slots, len(landed)))
        return update(jobs, multipliers, max_slots, residents, landed, *args, **kwargs)

    opt.engine.update = spy
    _train(model, opt, steps=1)
    opt.planner.refresh = fewer_slots
    _train(model, opt, steps=1)
    assert seen[1][1] > 0 and opt._ran_as_planned, "the CPU subgroups' gradients streamed down: the old plan ran"
    assert [slots for slots, _ in seen] == [opt.plan.slots, 1] and opt.plan.slots > 1


@pytest.mark.parametrize("prefetch", [False, True], ids=["no_prefetch", "prefetch"])
@pytest.mark.parametrize("now_stages", [False, True], ids=["model_stages_none", "fixed_schedule_stages"])
def test_a_streamed_step_where_no_slot_fits_now_takes_its_staged_subgroups_to_the_cpu(prefetch, now_stages):
    """The step runs the plan its gradients streamed for; where no staging slot fits now (the need grew) and
    the plan of now stages nothing, that plan's staged subgroups not filled ahead take the CPU path (one
    slot would go past the budget beside the next forward), with the same result. A plan of now that
    stages (a fixed schedule) keeps them staged: it was warned of the missing slot."""
    runs = []
    for squeeze in (False, True):
        model, opt = _build(prefetch)
        if prefetch:  # room for one subgroup filled ahead: the others need a slot
            room = FILL_BYTES * max(sg.numel for sg in opt.layout.subgroups)
            opt.planner.room_ahead = lambda resident_bytes, ahead_bytes: max(0, room - ahead_bytes)
        refresh, update, seen = opt.planner.refresh, opt.engine.update, []

        def no_slot(*args, **kwargs):
            plan = refresh(*args, **kwargs)
            places = plan.placements if now_stages else [Placement.CPU] * len(plan.placements)
            return dataclasses.replace(plan, placements=places, slots=0)

        def spy(jobs, multipliers, max_slots, *args, **kwargs):
            seen.append(([j.placement for j in jobs], set(kwargs.get("ahead") or ())))  # the update empties it
            return update(jobs, multipliers, max_slots, *args, **kwargs)

        opt.engine.update = spy
        _train(model, opt, steps=1)
        if squeeze:
            opt.planner.refresh = no_slot
        _train(model, opt, steps=2)
        runs.append(_masters(model, opt))
        if squeeze:
            for placements, ahead in seen[1:]:
                staged = [i for i, place in enumerate(placements) if place is Placement.STAGED]
                if now_stages:
                    assert staged, "a fixed schedule that stages keeps its staged subgroups"
                else:
                    assert set(staged) <= ahead, (staged, ahead)  # only those filled ahead stay
                    assert Placement.CPU in placements
            if prefetch and not now_stages:
                assert any(ahead for _, ahead in seen[1:]), "a subgroup filled ahead stays staged"
    _assert_same(*runs)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_the_update_lets_its_buffers_go_before_it_tells_the_budget_it_holds_none(overlap, monkeypatch):
    """Once the update tells the budget it holds nothing (``MemoryBudget.note_update(0)``), a peak the next
    forward reaches is counted as the model's: by then no staging slot and no slot filled ahead may still be
    alive (held by the update's locals or the caller's dict until it returns), else they would be counted
    in the need, for good."""
    import weakref

    from deep_optimizer_states.core import engine as engine_module
    from deep_optimizer_states.core import prefetch as prefetch_module

    made = []  # weak references to every slot made

    class Slot(engine_module.Slot):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(weakref.ref(self))

    class Ahead(prefetch_module.Ahead):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(weakref.ref(self))

    monkeypatch.setattr(engine_module, "Slot", Slot)
    monkeypatch.setattr(prefetch_module, "Ahead", Ahead)
    model, opt = _build(True, overlap=overlap)
    room = FILL_BYTES * max(sg.numel for sg in opt.layout.subgroups)  # one filled ahead, the others in slots
    opt.planner.room_ahead = lambda resident_bytes, ahead_bytes: max(0, room - ahead_bytes)
    told = opt.engine.on_memory
    at_zero = []

    def on_memory(held: int) -> None:
        if held == 0:
            at_zero.append(sum(ref() is not None for ref in made))
        told(held)

    opt.engine.on_memory = on_memory
    filled = _train(model, opt, steps=3)
    assert any(filled) and opt.last_update.staged_subgroups > sum(filled[-1:]), "slots filled ahead and staged"
    assert at_zero and set(at_zero) == {0}, at_zero


def test_a_plan_made_again_at_the_step_drops_the_slots_filled_for_the_old_one():
    """Without streamed CPU subgroups the step may plan again (new residents, say): the slots filled for
    the old plan go before the update allocates for the new one; the result does not change."""
    runs = []
    for prefetch in (False, True):
        model, opt = _build(prefetch, schedule="gpu")
        refresh = opt.planner.refresh
        calls = {"n": 0}

        def replanning(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == 3:
                return opt.planner.plan("gpu")  # the same placements, planned again: a new plan
            return refresh(*args, **kwargs)

        opt.planner.refresh = replanning
        filled = _train(model, opt, steps=4)
        if prefetch:
            staged = len(opt.layout.subgroups)
            assert filled == [staged, staged, 0, staged]
        runs.append(_masters(model, opt))
    _assert_same(*runs)


def test_the_room_is_read_once_a_step_not_at_every_gradient():
    """The budget's readings (device memory queries) cost more than a backward hook may: once a step."""
    model, opt = _build(True, "llama")
    calls = []
    opt.planner.room_ahead = lambda resident_bytes, ahead_bytes: calls.append(1) or UNLIMITED
    _train(model, opt, steps=3)
    assert len(calls) == 3 and len(list(model.parameters())) > 3


def test_a_subgroup_without_gradients_last_step_is_not_filled_ahead():
    """A branch the forward does not use has no gradients: its staged subgroups are not filled ahead
    after a step that had none for them (the first step, knowing nothing, fills them). Bit for bit the
    run without prefetch."""
    class Branchy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.used, self.unused = torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)

        def forward(self, x):
            return self.used(x).pow(2).mean()

    runs, fills = [], []
    for prefetch in (False, True):
        model = Branchy()
        opt = DeepOptimizerStates(model, subgroup_size=1056, schedule="gpu", stream_grads=True, prefetch=prefetch)
        if prefetch:
            opt.planner.room_ahead = lambda resident_bytes, ahead_bytes: UNLIMITED
        gen = torch.Generator().manual_seed(3)
        for _ in range(4):
            opt.zero_grad()
            before = opt.prefetch.filled if prefetch else 0
            model(torch.randn(8, 32, generator=gen)).backward()  # fills during backward
            opt.step()
            fills.append(opt.prefetch.filled - before if prefetch else None)
        runs.append(_masters(model, opt))
    unused = {sg.index for p in model.unused.parameters() for sg in opt.layout.subgroups_of(*opt.layout.where[id(p)])}
    used = len(opt.layout.subgroups) - len(unused)
    assert unused and used
    assert fills[4:] == [used + len(unused), used, used, used], "the unused branch filled on the first step only"
    _assert_same(*runs)


@pytest.mark.parametrize("ahead_last", [False, True], ids=["in-order", "ahead-last"])
def test_the_next_backward_fills_and_runs_ahead_while_the_last_update_still_flushes(ahead_last, monkeypatch):
    """``overlap``: the update left running may still flush its last staged subgroup when the next backward
    begins. A fill ahead waits only for its own subgroup's flush and an update run ahead (``speculate``) for
    its own subgroup's host states, not for the whole update: with the update's last flush held until
    backward has ended, backward runs through (the launching thread used to wait for the whole update),
    staged subgroups are filled, CPU subgroups run ahead, and the result is the same bit for bit. With the
    flushes in the update's order, every staged subgroup but the held one (the last in that order) is
    filled; with those filled ahead flushed last (``engine.FLUSH_AHEAD_LAST``), the fills, which go in the
    update's order, stop at the held one, which is one of those."""
    import threading

    from deep_optimizer_states.core import engine

    monkeypatch.setattr(engine, "FLUSH_AHEAD_LAST", ahead_last)
    steps, runs = 5, []
    for hold in (False, True):
        model, opt = _build(True, "llama", overlap=True, speculate=True)
        gates = [threading.Event() for _ in range(steps)]
        held = {"calls": 0, "timeouts": 0, "flushed": 0}
        if hold:
            settled = opt.overlapper.settled
            staged_ids = {i for i, p in enumerate(opt.placements) if p is Placement.STAGED}

            def holding(index, event):
                if index in staged_ids:
                    held["flushed"] += 1
                    if held["flushed"] == len(staged_ids):  # the update's last flush
                        held["flushed"] = 0
                        gate, held["calls"] = gates[held["calls"]], held["calls"] + 1
                        held["timeouts"] += not gate.wait(timeout=10)
                settled(index, event)

            opt.overlapper.settled = holding
        gen = torch.Generator().manual_seed(11)
        filled, ahead = [], []
        for step in range(steps):
            opt.zero_grad()
            loss_of(model, gen).backward()
            if step:
                gates[step - 1].set()  # the flush of the update before this backward goes on
                filled.append(opt.prefetch.filled)
                ahead.append(len(opt.speculation))
            opt.step()
        for gate in gates:
            gate.set()
        opt.synchronize()
        runs.append(_masters(model, opt))
        if hold:
            staged = opt.placements.count(Placement.STAGED)
            assert {k: held[k] for k in ("calls", "timeouts")} == {"calls": steps, "timeouts": 0}, \
                "backward waited for the whole update"
            per_step = [b - a for a, b in zip([0] + filled, filled)][1:]
            if ahead_last:
                assert all(per_step), "staged subgroups filled ahead while the update still flushed"
            else:
                assert per_step == [staged - 1] * (steps - 2), "every staged subgroup but the held one filled ahead"
            assert all(ahead), "CPU subgroups ran ahead while the update still flushed"
            assert opt.speculation.kept >= steps - 1 and not opt.speculation.undone, \
                "kept: run with this step's counts, though the update before had not ended"
    _assert_same(*runs)


@pytest.mark.parametrize("ahead_last", [True, False], ids=["ahead-last", "in-order"])
def test_the_update_writes_the_params_filled_ahead_first_and_flushes_in_order(ahead_last, monkeypatch):
    """The subgroups filled ahead are updated (their params written, which the next forward waits for)
    before any flush; the flushes then go in the update's order (the next backward fills in that order),
    those of the subgroups filled ahead after the others (``engine.FLUSH_AHEAD_LAST``: the slots' next
    fills wait for the others), and the result is the same either way."""
    from deep_optimizer_states.core import engine

    monkeypatch.setattr(engine, "FLUSH_AHEAD_LAST", ahead_last)
    model, opt = _build(True, "llama")
    room = 3 * FILL_BYTES * max(sg.numel for sg in opt.layout.subgroups)
    opt.planner.room_ahead = lambda resident_bytes, ahead_bytes: max(0, room - ahead_bytes)
    log = []
    update, flush = opt.engine._update_staged, opt.engine._flush
    opt.engine._update_staged = lambda job, slot, *a: log.append(("update", job.subgroup.index, slot is None)) \
        or update(job, slot, *a)
    opt.engine._flush = lambda out, *rest: log.append(("flush", out.subgroup.index)) or flush(out, *rest)
    filled = _train(model, opt, steps=2)
    staged = [sg.index for sg, p in zip(opt.layout.subgroups, opt.placements) if p is Placement.STAGED]
    order = sorted(staged, key=lambda i: opt._need_order.get(i, len(opt._need_order)))
    last = log[len(log) // 2:]  # the second step's
    ahead = [i for kind, i, *rest in last if kind == "update" and rest[0]]
    assert filled[-1] == len(ahead) == 3 < len(staged), "three filled ahead (the room), the others staged"
    first_flush = next(k for k, entry in enumerate(last) if entry[0] == "flush")
    assert all(k < first_flush for k, entry in enumerate(last) if entry[0] == "update" and entry[2]), \
        "every subgroup filled ahead updated before the first flush"
    flushed = [i for kind, i, *_ in last if kind == "flush"]
    if ahead_last:
        assert flushed == [i for i in order if i not in ahead] + [i for i in order if i in ahead]
    else:
        assert flushed == order, "flushed in the update's order"
    twin, ref = _build(False, "llama")
    _train(twin, ref, steps=2)
    _assert_same(_masters(model, opt), _masters(twin, ref))


@pytest.mark.parametrize("ahead_last", [True, False], ids=["ahead-last", "in-order"])
def test_slots_filled_ahead_leave_the_update_at_their_flush_with_the_same_result(ahead_last, monkeypatch):
    """``prefetch="release"``: a slot filled ahead is let go once its flush is enqueued (on a GPU
    the allocator hands it out again after that flush has run), not when the update ends, which with
    ``overlap`` is during the next forward: at each later flush no slot flushed before is referenced any more.
    Each one is asked to wait for the update's and the flush's streams. The result is the same bit for bit."""
    import weakref

    from deep_optimizer_states.core import engine
    from deep_optimizer_states.core.slots import Ahead

    monkeypatch.setattr(engine, "FLUSH_AHEAD_LAST", ahead_last)
    runs, release_after = [], Ahead.release_after
    for release in (False, True):
        model, opt = _build("release" if release else True, "llama", overlap=True)
        flushed, alive_at_flush, asked = [], [], []
        flush = opt.engine._flush

        def watching(out, ahead):
            alive_at_flush.append(sum(ref() is not None for ref in flushed))
            filled = out.slot is None
            slot = weakref.ref(out.states[0]) if filled else None
            out = flush(out, ahead)
            if filled:
                flushed.append(slot)

        opt.engine._flush = watching
        monkeypatch.setattr(Ahead, "release_after", lambda self, *streams: asked.append(len(streams))
                            or release_after(self, *streams))
        filled = _train(model, opt, steps=3)
        assert filled[-1] >= 2, "subgroups filled ahead, more than one"
        if release:
            assert asked == [2] * len(flushed) and not any(alive_at_flush), \
                "every slot filled ahead let go at its flush, on the update's and the flush's streams"
        else:
            assert not asked and any(alive_at_flush), "held until the update's end"
        runs.append(_masters(model, opt))
    _assert_same(*runs)


def test_once_the_room_runs_out_the_gradients_hooks_stop_asking_until_the_step():
    """Every final gradient's hook may fill slots; once the next slot found no room, nothing more fits
    until the step (the room is read once a step and only shrinks), so later hooks do not try again (each
    try costs backward's launching thread), and the next step fills as many again."""
    model, opt = _build(True, "llama")
    biggest = max(sg.numel for sg in opt.layout.subgroups)
    room = 2 * FILL_BYTES * biggest
    opt.planner.room_ahead = lambda resident_bytes, ahead_bytes: max(0, room - ahead_bytes)
    calls = []
    top_up = opt.prefetch.top_up
    opt.prefetch.top_up = lambda *a, **k: calls.append(1) or top_up(*a, **k)
    hooks = []
    after_grad = opt.grad_stream.after_grad
    opt.grad_stream.after_grad = lambda: hooks.append(1) or after_grad()
    tries = []
    filled = _train(model, opt, steps=3, between=lambda step: tries.append((len(calls), len(hooks))))
    per_step = [(c - c0, h - h0) for (c, h), (c0, h0) in zip(tries, [(0, 0)] + tries[:-1])]
    assert all(f == 2 for f in filled[1:]), "two slots' room, two filled each step"
    assert all(c <= 2 < h for c, h in per_step), "tries stop at the one that found no room"

"""The CPU path's update run ahead during backward (``speculate``), on the CPU.

Each run with ``speculate`` trains beside a twin that neither streams nor speculates (the path the other
tests hold to torch's AdamW) on the same fresh random batches, and the two must agree bit for bit after
every step: where the update ran ahead and was kept, where it was undone (clipped, skipped, a new lr, a
read of the states, zero_grad), and where it did not run. Every test also asserts that updates did run
ahead (and were kept or undone as the case says), so a speculation that silently never ran fails.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

from deep_optimizer_states import DeepOptimizerStates, Placement
from deep_optimizer_states import optimizer as optimizer_module
from deep_optimizer_states.core import speculate as speculate_module
from tests.harness import loss_of, mlp, tiny_llama


def _pair(model, **kwargs):
    twin = copy.deepcopy(model)
    return ((model, DeepOptimizerStates(model, stream_grads=True, speculate=True, **kwargs)),
            (twin, DeepOptimizerStates(twin, **kwargs)))


def _same(o1, m1, o2, m2, when: str) -> None:
    for p1, p2 in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(o1.master(p1), o2.master(p2)), f"{when}: masters differ"
        assert torch.equal(p1, p2), f"{when}: params differ"
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(o1.state[p1][key], o2.state[p2][key]), f"{when}: {key} differs"


def _backward(pairs, gen_pairs, micro=1, scale=1.0):
    for (m, o), gen in zip(pairs, gen_pairs):
        o.zero_grad()
        for k in range(micro):
            with o.accumulating() if k < micro - 1 else contextlib.nullcontext():
                (loss_of(m, gen) * scale / micro).backward()


@pytest.mark.parametrize("schedule", ["cpu", 2], ids=str)
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_updates_run_ahead_are_kept_and_equal_the_plain_step_bit_for_bit(schedule, overlap):
    (m1, o1), (m2, o2) = _pair(tiny_llama(), schedule=schedule, subgroup_size=3000, lr=1e-2, overlap=overlap)
    gens = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)
    ahead = min(o1.placements.count(Placement.CPU), 16)  # as many as there are spares
    assert ahead >= 8
    for step in range(5):
        _backward([(m1, o1), (m2, o2)], gens, micro=2 if step == 3 else 1)
        assert len(o1.speculation) == ahead, "CPU subgroups ran ahead during backward, one per spare"
        ran = sum(o1.layout.subgroups[i].numel for i in o1.speculation._ahead)
        o1.step()
        o2.step()
        _same(o1, m1, o2, m2, f"step {step}")
        assert o1.last_update.speculated == ahead
        o1.synchronize()  # the update's stats are final once it ended (overlap)
        assert o1.last_update.speculated_elements == ran > 0  # the head start the plan prices
    assert o1.speculation.kept == 5 * ahead and o1.speculation.undone == 0


def test_equal_to_torch_adamw():
    model = tiny_llama()
    twin = copy.deepcopy(model)
    opt = DeepOptimizerStates(model, stream_grads=True, speculate=2, schedule="cpu", subgroup_size=4000, lr=1e-2,
                              weight_decay=0.1)
    ref = torch.optim.AdamW(twin.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    for _ in range(4):
        opt.zero_grad()
        ref.zero_grad()
        loss_of(model, g1).backward()
        loss_of(twin, g2).backward()
        opt.step()
        ref.step()
        for p, q in zip(model.parameters(), twin.parameters()):
            assert torch.equal(opt.master(p), q.detach())
    assert opt.speculation.kept == 4 * 2, "two subgroups (the spares) ran ahead each step"


def test_clipping_undoes_the_update_run_ahead_and_pauses_speculation_for_one_step():
    (m1, o1), (m2, o2) = _pair(tiny_llama(), schedule="cpu", subgroup_size=8000, lr=1e-2)
    gens = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    ahead, kept, undone = [], [], []
    for step, max_norm in enumerate([1e6, 1e-3, 1e6, 1e6, 1e-3]):
        _backward([(m1, o1), (m2, o2)], gens)
        ahead.append(len(o1.speculation))
        n1, n2 = o1.clip_grad_norm_(max_norm), o2.clip_grad_norm_(max_norm)
        assert torch.equal(n1, n2)
        o1.step()
        o2.step()
        _same(o1, m1, o2, m2, f"step {step}")
        kept.append(o1.speculation.kept)
        undone.append(o1.speculation.undone)
    n = len(o1.layout.subgroups)
    assert n <= 16
    # step 1 clips: undone; step 2 runs nothing ahead (the last step clipped); step 3 runs ahead again
    assert ahead == [n, n, 0, n, n]
    assert kept == [n, n, n, 2 * n, 2 * n] and undone == [0, n, n, n, 2 * n]


@pytest.mark.parametrize("stand_down", [True, False], ids=["stand_down", "no_stand_down"])
@pytest.mark.parametrize("sit_out", [True, False], ids=["sit_out", "every_step"])
@pytest.mark.parametrize("max_norm", [1e-3, 1.6], ids=["all_over", "some_over"])
def test_updates_run_ahead_stand_down_once_the_norm_landed_passes_the_clip(monkeypatch, sit_out, max_norm,
                                                                          stand_down):
    """Gradients land last layers first, each subgroup's with the norm measured so far: an update run ahead
    after that norm passed ``max_grad_norm`` stands down before its copy aside (the step will clip it), one
    before it runs and is undone. Either way each step equals the plain one bit for bit. ``SIT_OUT_AFTER_CLIP``
    off: updates run ahead on the steps after a clip too, and stand down there. ``STAND_DOWN`` off (what the
    bench measures the stand-down against): every one runs and is undone."""
    monkeypatch.setattr(optimizer_module, "SIT_OUT_AFTER_CLIP", sit_out)
    monkeypatch.setattr(optimizer_module, "STAND_DOWN", stand_down)
    (m1, o1), (m2, o2) = _pair(tiny_llama(), schedule="cpu", subgroup_size=8000, lr=1e-2, max_grad_norm=max_norm)
    gens = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    n = len(o1.layout.subgroups)
    for step in range(3):
        before = o1.speculation.undone, o1.speculation.stood_down
        _backward([(m1, o1), (m2, o2)], gens)
        ahead = sorted(o1.speculation._ahead)
        over = [i for i in ahead if stand_down and o1.grad_stream.partial_sq(i) > max_norm ** 2]
        o1.step()
        o2.step()
        _same(o1, m1, o2, m2, f"step {step}")
        assert o1.last_grad_norm > max_norm, "every step clips"
        undone, stood = o1.speculation.undone - before[0], o1.speculation.stood_down - before[1]
        if step > 0 and sit_out:
            assert ahead == [] and undone == stood == 0, "a step after a clip runs nothing ahead"
            continue
        assert len(ahead) == n and stood == len(over) and undone == n - len(over)
        if stand_down:
            assert (undone == 0) if max_norm == 1e-3 else (undone > 0 and stood > 0)
        else:
            assert undone == n and stood == 0
    assert o1.speculation.kept == 0


@pytest.mark.parametrize("stand_down", [True, "forecast"], ids=["landed", "forecast"])
def test_a_forecast_stands_a_spikes_updates_down_from_the_first_and_runs_ahead_after_it(monkeypatch, stand_down):
    """Gradient spikes (norm about 1.6 against about 0.5, clipped at 1.0), updates run ahead on every step (no
    pause after a clip): with the norm landed alone, the first subgroups of a spike's step run before it passes
    the clip and are undone; forecast by the share of the last step's norm landed by the same point (about 0.3
    at the first, steady between steps), every one stands down from the first. Either way the step after a
    spike keeps every update run ahead, and every step equals the plain one bit for bit."""
    monkeypatch.setattr(optimizer_module, "SIT_OUT_AFTER_CLIP", False)
    monkeypatch.setattr(optimizer_module, "STAND_DOWN", stand_down)
    (m1, o1), (m2, o2) = _pair(tiny_llama(), schedule="cpu", subgroup_size=8000, lr=1e-3, max_grad_norm=1.0)
    gens = torch.Generator().manual_seed(4), torch.Generator().manual_seed(4)
    n = len(o1.layout.subgroups)
    for step, scale in enumerate([0.2, 0.2, 0.6, 0.2, 0.2, 0.6, 0.2]):
        before = o1.speculation.kept, o1.speculation.undone, o1.speculation.stood_down
        _backward([(m1, o1), (m2, o2)], gens, scale=scale)
        o1.step()
        o2.step()
        _same(o1, m1, o2, m2, f"step {step}")
        kept, undone, stood = (now - then for now, then in zip((o1.speculation.kept, o1.speculation.undone,
                                                                 o1.speculation.stood_down), before))
        spike = scale > 0.2
        assert (o1.last_grad_norm > 1.0) == spike, f"step {step}: norm {float(o1.last_grad_norm)}"
        if not spike:
            assert (kept, undone, stood) == (n, 0, 0), f"step {step}"
        elif stand_down == "forecast":
            assert (kept, undone, stood) == (0, 0, n), f"step {step}: every one stands down"
        else:
            assert kept == 0 and undone > 0 and stood > 0 and undone + stood == n, f"step {step}"


def test_the_last_steps_shares_come_from_the_last_step_that_ended():
    """``last_share`` reads the last step's sums: a backward dropped by zero_grad leaves none of its own, a step
    whose norm is not finite (skipped) gives none, and the step after gives them again."""
    model = tiny_llama()
    opt = DeepOptimizerStates(model, stream_grads=True, speculate=True, schedule="cpu", subgroup_size=8000,
                              max_grad_norm=1e9, nonfinite="skip")
    stream, n = opt.grad_stream, len(opt.layout.subgroups)
    gen = torch.Generator().manual_seed(6)

    def backward(scale: float = 1.0) -> list[float]:
        opt.zero_grad()
        (loss_of(model, gen) * scale).backward()
        return [stream.partial_sq(i) for i in range(n)]

    assert [stream.last_share(i) for i in range(n)] == [None] * n, "no step yet"
    sums = backward()
    opt.step()
    shares = [stream.last_share(i) for i in range(n)]
    assert shares == pytest.approx([p / max(sums) for p in sums]) and max(shares) == pytest.approx(1.0)
    backward(scale=3.0)  # dropped: zero_grad before any step
    model.lm_head.weight.requires_grad_(False)  # its subgroups do not land in the step after
    sums = backward()
    model.lm_head.weight.requires_grad_(True)
    opt.step()
    shares = [stream.last_share(i) for i in range(n)]
    assert 0 < sums.count(0.0) < n and [s is None for s in shares] == [p == 0.0 for p in sums]
    assert [s for s in shares if s is not None] == pytest.approx([p / max(sums) for p in sums if p])
    backward(scale=float("nan"))
    with pytest.warns(RuntimeWarning, match="skipped"):
        opt.step()
    assert [stream.last_share(i) for i in range(n)] == [None] * n, "a norm that is not finite forecasts nothing"
    sums = backward()
    opt.step()
    assert [stream.last_share(i) for i in range(n)] == pytest.approx([p / max(sums) for p in sums])
    assert opt.speculation.kept > 0
    opt.close()


def test_a_stand_down_mode_that_does_not_exist_is_refused(monkeypatch):
    monkeypatch.setattr(optimizer_module, "STAND_DOWN", "forcast")
    (m1, o1), _ = _pair(tiny_llama(), schedule="cpu", subgroup_size=8000, max_grad_norm=1.0)
    with pytest.raises(ValueError, match="STAND_DOWN is 'forcast': set it to True, False or 'forecast'"):
        loss_of(m1, torch.Generator().manual_seed(0)).backward()


def test_a_kept_update_whose_run_ahead_stood_down_is_updated_by_the_step(monkeypatch):
    """Should ``step()`` keep an update whose run-ahead stood down (on a GPU it may not have ended when the step
    settles), the engine updates that subgroup itself: no step is lost. Forced here: a clip expected at a
    tiny norm (the run-aheads stand down), none applied (the step keeps them), the stand-down not seen."""
    monkeypatch.setattr(speculate_module, "_stood_down", lambda done: False)
    (m1, o1), (m2, o2) = _pair(tiny_llama(), schedule="cpu", subgroup_size=8000, lr=1e-2)
    o1._clip_seen, o1.grad_stream.partial = 1e-9, True
    gens = torch.Generator().manual_seed(2), torch.Generator().manual_seed(2)
    for step in range(3):
        _backward([(m1, o1), (m2, o2)], gens)
        assert len(o1.speculation) == len(o1.layout.subgroups)
        o1.step()
        o2.step()
        _same(o1, m1, o2, m2, f"step {step}")
    assert o1.speculation.kept == 3 * len(o1.layout.subgroups) and o1.speculation.undone == 0


def test_an_injected_nan_skips_the_step_and_puts_the_states_back():
    (m1, o1), (m2, o2) = _pair(mlp(torch.bfloat16), schedule="cpu", subgroup_size=2000, lr=1e-3)
    gens = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    for step in range(4):
        _backward([(m1, o1), (m2, o2)], gens, scale=float("nan") if step == 1 else 1.0)
        ran = len(o1.speculation)
        assert ran > 0
        with pytest.warns(RuntimeWarning, match="skipped") if step == 1 else contextlib.nullcontext():
            o1.step()
        with pytest.warns(RuntimeWarning, match="skipped") if step == 1 else contextlib.nullcontext():
            o2.step()
        _same(o1, m1, o2, m2, f"step {step}")
    assert o1.skipped_steps == o2.skipped_steps == 1
    assert o1.speculation.undone == ran, "the skipped step's updates were undone"


def test_a_new_lr_a_state_read_or_a_weight_edit_after_backward_is_taken():
    (m1, o1), (m2, o2) = _pair(mlp(), schedule=2, subgroup_size=2000, lr=1e-3)
    gens = torch.Generator().manual_seed(4), torch.Generator().manual_seed(4)
    for step in range(5):
        _backward([(m1, o1), (m2, o2)], gens)
        assert len(o1.speculation) > 0
        before = o1.speculation.undone
        if step == 1:  # an LR schedule stepped between backward and step
            for o in (o1, o2):
                o.param_groups[0]["lr"] = 3e-3
        if step == 2:  # a read of the states sees them before the step
            for p1, p2 in zip(m1.parameters(), m2.parameters()):
                assert torch.equal(o1.state[p1]["exp_avg"], o2.state[p2]["exp_avg"])
            assert len(o1.speculation) == 0
        if step == 3:  # a weight edited in place becomes the new master
            with torch.no_grad():
                for m in (m1, m2):
                    m[0].weight.mul_(0.5)
        o1.step()
        o2.step()
        _same(o1, m1, o2, m2, f"step {step}")
        assert (o1.speculation.undone > before) == (step in (1, 2, 3))


def test_a_checkpoint_saved_or_loaded_between_backward_and_step():
    """state_dict() after backward holds the states before the step (as the twin's: it reads them through
    opt.state, which undoes); a checkpoint loaded there is what the step then updates, in every subgroup."""
    (m1, o1), (m2, o2) = _pair(mlp(), schedule="cpu", subgroup_size=2000, lr=1e-3)
    gens = torch.Generator().manual_seed(6), torch.Generator().manual_seed(6)
    saved = None
    for step in range(4):
        _backward([(m1, o1), (m2, o2)], gens)
        assert len(o1.speculation) > 0
        if step == 1:
            sd1, sd2 = o1.state_dict(), o2.state_dict()
            assert len(o1.speculation) == 0
            for i in sd2["state"]:
                for key, value in sd2["state"][i].items():
                    assert torch.equal(sd1["state"][i][key], value), f"state_dict shows {key} after the update"
            saved = copy.deepcopy(sd2)
        if step == 3:
            o1.load_state_dict(copy.deepcopy(saved))
            o2.load_state_dict(copy.deepcopy(saved))
        o1.step()
        o2.step()
        _same(o1, m1, o2, m2, f"step {step}")


def test_a_resident_of_the_last_plan_does_not_run_ahead_on_its_stale_host_states():
    """A new plan makes resident subgroups CPU-placed: their states stay on the device until the step evicts
    them, so their update must not run ahead on the host copy (it would be lost, or undone onto it)."""
    def stack():
        torch.manual_seed(0)
        return torch.nn.Sequential(*[torch.nn.Linear(96, 96) for _ in range(8)])

    def loss_fn(model, gen):
        return model(torch.randn(16, 96, generator=gen)).pow(2).mean()

    (m1, o1), (m2, o2) = _pair(stack(), schedule="cpu", subgroup_size=8000, lr=1e-2)
    n = len(o1.layout.subgroups)
    gens = torch.Generator().manual_seed(8), torch.Generator().manual_seed(8)
    for step, schedule in enumerate([["cpu"] * (n - 3) + ["resident"] * 3, None, "cpu", None]):
        if schedule is not None:
            o1.schedule = o2.schedule = schedule
        for (m, o), gen in zip(((m1, o1), (m2, o2)), gens):
            o.zero_grad()
            loss_fn(m, gen).backward()
        if step == 2:
            assert len(o1.residents) == 3 and len(o1.speculation) == min(n - 3, 16), "residents stay out"
        o1.step()
        o2.step()
        if step != 1:  # reading the states evicts the residents: not before step 2
            _same(o1, m1, o2, m2, f"step {step}")


def test_zero_grad_after_backward_drops_the_update_run_ahead():
    model = mlp()
    opt = DeepOptimizerStates(model, stream_grads=True, speculate=True, schedule="cpu", subgroup_size=2000)
    gen = torch.Generator().manual_seed(0)
    loss_of(model, gen).backward()
    opt.step()
    before = copy.deepcopy(opt.state_dict()["state"])
    masters = [opt.master(p).clone() for p in model.parameters()]
    loss_of(model, gen).backward()
    assert len(opt.speculation) == len(opt.layout.subgroups)
    opt.zero_grad()
    opt.step()  # no gradient: nothing to do
    assert all(torch.equal(opt.master(p), m) for p, m in zip(model.parameters(), masters))
    after = opt.state_dict()["state"]
    assert all(torch.equal(after[i][k], v) for i in before for k, v in before[i].items())
    assert opt.speculation.undone == len(opt.layout.subgroups)


def test_speculate_input_is_checked():
    with pytest.raises(ValueError, match="stream_grads"):
        DeepOptimizerStates(mlp(), speculate=True)
    with pytest.raises(ValueError, match="speculate must be"):
        DeepOptimizerStates(mlp(), stream_grads=True, speculate="yes")
    with pytest.raises(ValueError, match="speculate must be"):
        DeepOptimizerStates(mlp(), stream_grads=True, speculate=-1)
    with pytest.raises(ValueError, match="loss scaling"):
        DeepOptimizerStates(mlp(torch.float16), stream_grads=True, speculate=True)


@pytest.mark.parametrize("stream_grads", [False, True])
def test_the_planner_hears_whether_an_update_ran_the_plan_its_backward_ran_under(stream_grads):
    """A plan made at a step runs at once when no gradient went down during backward; then what ran ahead
    during that backward belongs to the plan before, and the planner is told so (it learns no head start
    from that update). With gradients sent down, the step runs the plan they went for: told as planned."""
    import dataclasses

    model = mlp()
    opt = DeepOptimizerStates(model, lr=1e-2, subgroup_size=3000, stream_grads=stream_grads, schedule="cpu")
    told, real_observe, real_refresh = [], opt.planner.observe, opt.planner.refresh
    opt.planner.observe = lambda *a, planned_in_backward=True, **kw: (
        told.append(planned_in_backward), real_observe(*a, planned_in_backward=planned_in_backward, **kw))

    def refresh(*a, **kw):  # at the second step, a plan made again (a new object, same placements)
        plan = real_refresh(*a, **kw)
        if len(told) == 1:
            opt.planner.current = plan = dataclasses.replace(plan)
        return plan

    opt.planner.refresh = refresh
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        opt.zero_grad()
        loss_of(model, gen).backward()
        opt.step()
    opt.synchronize()
    assert told == ([True, True, True] if stream_grads else [True, False, True])


@pytest.mark.parametrize("threads, share, during", [(16, 0.25, 12), (3, 0.25, 2), (1, 0.25, 1), (8, 0.0, 8),
                                                   (16, 1 / 16, 15), (8, 1 / 16, 7), (32, 1 / 16, 30)])
def test_an_update_run_ahead_leaves_its_share_of_threads_to_backward_and_gives_them_back(
        monkeypatch, threads, share, during):
    """With a GPU, backward's launching thread needs a core while an update runs ahead (``LAUNCH_SHARE``)."""
    from deep_optimizer_states.core import speculate

    seen = []
    now = {"n": threads}
    monkeypatch.setattr(torch, "get_num_threads", lambda: now["n"])
    monkeypatch.setattr(torch, "set_num_threads", lambda n: now.update(n=n))

    class Job:
        subgroup = type("Sg", (), {"numel": 4, "master": torch.zeros(4), "exp_avg": torch.zeros(4),
                                   "exp_avg_sq": torch.zeros(4), "grad32": torch.zeros(4)})()

        def adam(self, *args):
            seen.append(now["n"])

    engine = type("Engine", (), {"takes_bf16": lambda self, sg: False})()
    ahead = speculate._Ahead(Job(), torch.ones(3, 4))
    speculate._run_ahead(ahead, (None, None), share, engine)
    assert seen == [during] and now["n"] == threads and ahead.copied
    assert torch.equal(ahead.spare, torch.zeros(3, 4))

"""Gradients streamed to the host during backward (``stream_grads=True``), on the CPU.

The streamed path must give exactly what the path that gathers gradients at the step gives (which the
other tests hold to torch's AdamW): the same fp32 values, the same multiplies (unscale, clip) in the same
order, so the two runs are compared bit for bit, step by step, on fresh random data. Also: the CPU path's
gradients really leave (``.grad`` is None after backward), accumulation keeps non-final micro-batches on
the device, and clipping, an injected overflow, a module used twice and an unused param come out the same.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import time
import warnings
import weakref

import pytest
import torch
from torch import nn

from deep_optimizer_states import DeepOptimizerStates, Placement
from tests.harness import loss_of, mlp, tiny_llama


def _pair(model: nn.Module, **kwargs):
    twin = copy.deepcopy(model)
    return (model, DeepOptimizerStates(model, stream_grads=True, **kwargs)), (twin, DeepOptimizerStates(twin, **kwargs))


def _step_both(runs, loss_fn) -> None:
    """One step of each (model, optimizer, generator) run on its own batch from ``loss_fn``."""
    for model, opt, gen in runs:
        opt.zero_grad()
        loss_fn(model, gen).backward()
        opt.step()


def _lockstep(make, steps=5, micro=1, seed=0, max_norm=None, check=None, **kwargs):
    (m1, o1), (m2, o2) = _pair(make(), **kwargs)
    gen1, gen2 = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
    for step in range(steps):
        for o in (o1, o2):
            o.zero_grad()
        for k in range(micro):
            with o1.accumulating() if k < micro - 1 else contextlib.nullcontext():
                (loss_of(m1, gen1) / micro).backward()
            (loss_of(m2, gen2) / micro).backward()
        if check:
            check(m1, o1)
        if max_norm:
            n1, n2 = o1.clip_grad_norm_(max_norm), o2.clip_grad_norm_(max_norm)
            torch.testing.assert_close(n1, n2, rtol=1e-6, atol=0)
        o1.step()
        o2.step()
        for p1, p2 in zip(m1.parameters(), m2.parameters()):
            assert torch.equal(o1.master(p1), o2.master(p2)), f"step {step}: masters differ"
            assert torch.equal(p1, p2)
        for p1, p2 in zip(m1.parameters(), m2.parameters()):
            assert torch.equal(o1.state[p1]["exp_avg_sq"], o2.state[p2]["exp_avg_sq"])
    return o1, o2


@pytest.mark.parametrize("schedule", ["cpu", 2, "gpu"], ids=str)
def test_streamed_gradients_give_the_same_steps_bit_for_bit(schedule):
    def grads_left(model, opt):
        for sg, place in zip(opt.layout.subgroups, opt.placements):
            assert (sg.index in opt.grad_stream.landed) == (place is Placement.CPU)
        cpu_only = {id(p) for b in opt.layout.buckets for i, p in enumerate(b.params)
                    if all(opt.placements[sg.index] is Placement.CPU for sg in opt.layout.subgroups_of(b, i))}
        for p in model.parameters():
            assert (p.grad is None) == (id(p) in cpu_only), "the CPU path's gradients left; the others stayed"

    _lockstep(tiny_llama, schedule=schedule, subgroup_size=3000, lr=1e-2, check=grads_left)


def test_with_clipping_and_accumulation_over_three_micro_batches():
    kept = []

    def check(model, opt):
        kept.append(len(opt.grad_stream.landed))

    o1, _ = _lockstep(tiny_llama, micro=3, max_norm=0.3, schedule=2, subgroup_size=3000, lr=1e-2, check=check)
    assert all(n == o1.placements.count(Placement.CPU) for n in kept), "only the final micro-batch streams"
    _lockstep(tiny_llama, micro=2, schedule="cpu", subgroup_size=5000, lr=1e-2, max_grad_norm=0.5)


def test_backwards_span_of_final_gradients_reaches_the_planner():
    """The host seconds from a step's first final gradient to its last (what ``plan.FILLS_WITHIN_BACKWARD``
    bounds the fills by): spans only the last micro-batch's backward, which a slow hook in it lengthens;
    none before a final gradient and after the step; none without ``stream_grads``."""
    model = mlp()
    opt = DeepOptimizerStates(model, stream_grads=True, schedule="cpu", subgroup_size=2000)
    gen = torch.Generator().manual_seed(0)
    assert opt.grad_stream.backward_s() is None and opt.planner.backward_s is None
    with opt.accumulating():
        loss_of(model, gen).backward()
    assert opt.grad_stream.backward_s() is None, "a non-final micro-batch's gradients are not final"
    # the output layer's gradients are final first; a hook registered after ours runs after it, so the
    # other layers' final gradients come at least 50 ms after the first
    list(model.parameters())[-1].register_post_accumulate_grad_hook(lambda p: time.sleep(0.05))
    loss_of(model, gen).backward()
    span = opt.grad_stream.backward_s()
    assert span is not None and span >= 0.05
    opt.step()
    assert opt.planner.backward_s == span and opt.grad_stream.backward_s() is None
    plain_model = mlp()
    plain = DeepOptimizerStates(plain_model, schedule="cpu", subgroup_size=2000)
    loss_of(plain_model, gen).backward()
    plain.step()
    assert plain.planner.backward_s is None


def test_non_final_micro_batches_keep_their_gradients():
    model = mlp()
    opt = DeepOptimizerStates(model, stream_grads=True, schedule="cpu", subgroup_size=2000)
    gen = torch.Generator().manual_seed(0)
    with opt.accumulating():
        loss_of(model, gen).backward()
    assert all(p.grad is not None for p in model.parameters()) and not opt.grad_stream.landed
    loss_of(model, gen).backward()
    assert all(p.grad is None for p in model.parameters())
    assert len(opt.grad_stream.landed) == len(opt.layout.subgroups)
    opt.zero_grad()
    assert not opt.grad_stream.landed, "zero_grad forgets what was streamed"


def test_an_injected_overflow_is_skipped_and_the_next_steps_agree():
    (m1, o1), (m2, o2) = _pair(mlp(torch.float16), schedule=2, subgroup_size=2000, lr=1e-3, loss_scale=1024.0)
    gen1, gen2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    for step in range(4):
        for m, o, gen in ((m1, o1, gen1), (m2, o2, gen2)):
            o.zero_grad()
            loss = loss_of(m, gen)
            if step == 1:
                loss = loss * float("inf")
            o.scale_loss(loss).backward()
        o1.step()  # step 1: an fp16 overflow, skipped quietly while the scale backs off
        o2.step()
        for p1, p2 in zip(m1.parameters(), m2.parameters()):
            assert torch.equal(o1.master(p1), o2.master(p2))
    assert o1.scaler.scale == o2.scaler.scale < 1024.0


def test_a_module_used_twice_and_a_param_without_a_gradient():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.a, self.b, self.unused = nn.Linear(32, 32), nn.Linear(32, 8), nn.Linear(4, 4)

        def forward(self, x):
            return self.b(torch.tanh(self.a(torch.tanh(self.a(x)))))

    def loss_twice(model, gen):
        x, y = torch.randn(16, 32, generator=gen), torch.randn(16, 8, generator=gen)
        return (model(x) - y).pow(2).mean()

    model = Twice()
    (m1, o1), (m2, o2) = _pair(model, schedule="cpu", subgroup_size=300, lr=1e-2, max_grad_norm=0.1)
    gen1, gen2 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    for _ in range(4):
        _step_both(((m1, o1, gen1), (m2, o2, gen2)), loss_twice)
        for p1, p2 in zip(m1.parameters(), m2.parameters()):
            assert torch.equal(o1.master(p1), o2.master(p2))
    assert "step" not in o1.state[m1.unused.weight], "a param without a gradient is left alone, as torch does"
    assert int(o1.state[m1.a.weight]["step"]) == 4


def test_stream_grads_must_be_a_bool():
    with pytest.raises(ValueError, match="stream_grads"):
        DeepOptimizerStates(mlp(), stream_grads="yes")


def test_a_second_final_backward_without_accumulating_is_refused():
    """Streamed gradients would be lost to a second backward that is not under opt.accumulating()."""
    model = mlp()
    opt = DeepOptimizerStates(model, stream_grads=True, schedule="cpu", subgroup_size=2000)
    gen = torch.Generator().manual_seed(0)
    loss_of(model, gen).backward()
    with pytest.raises(RuntimeError, match="accumulating"):
        loss_of(model, gen).backward()
    opt.zero_grad()
    loss_of(model, gen).backward()  # after zero_grad: a new step's gradients
    opt.step()
    loss_of(model, gen).backward()  # after a step too
    opt.step()


def test_the_hugging_face_trainer_refuses_stream_grads():
    from transformers import TrainingArguments

    from deep_optimizer_states.integrations.hf import optimizer_kwargs

    args = TrainingArguments(output_dir="/tmp/unused", report_to=[])
    with pytest.raises(ValueError, match="stream_grads"):
        optimizer_kwargs(args, stream_grads=True)


def test_a_rebuilt_optimizer_streams_alone_and_a_dropped_one_is_freed_with_its_hooks():
    """An optimizer dropped but not yet collected must not take the gradients of its successor."""
    model = mlp()
    refs = []
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        opt = DeepOptimizerStates(model, stream_grads=True, schedule="cpu", subgroup_size=2000)
        for _ in range(2):
            opt.zero_grad()
            loss_of(model, gen).backward()
            assert len(opt.grad_stream.landed) == len(opt.layout.subgroups), "the newest optimizer streams"
            opt.step()
            assert all(int(opt.state[p]["step"]) > 0 for p in model.parameters())
        refs.append(weakref.ref(opt))
        del opt
    gc.collect()
    assert [r() for r in refs] == [None] * 3, "the params' hooks must not keep the optimizer alive"
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters()), "hooks removed with it"


def test_a_forward_out_of_registration_order_and_reads_between_steps():
    """Subgroups complete in whatever order backward reaches their params; a state_dict and state reads
    between steps change nothing."""
    class Reversed(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.first, self.second, self.third = nn.Linear(8, 32), nn.Linear(32, 32), nn.Linear(32, 32)

        def forward(self, x):  # registered first, used last
            return self.first(torch.tanh(self.second(torch.tanh(self.third(x)))).T[:8].T)

    def loss_rev(model, gen):
        return (model(torch.randn(16, 32, generator=gen)) - torch.randn(16, 32, generator=gen)).pow(2).mean()

    (m1, o1), (m2, o2) = _pair(Reversed(), schedule=2, subgroup_size=500, lr=1e-2, max_grad_norm=0.2)
    gen1, gen2 = torch.Generator().manual_seed(2), torch.Generator().manual_seed(2)
    for _ in range(4):
        _step_both(((m1, o1, gen1), (m2, o2, gen2)), loss_rev)
        o1.state_dict()
        _ = [o1.state[p]["exp_avg"].sum() for p in m1.parameters()]
        for p1, p2 in zip(m1.parameters(), m2.parameters()):
            assert torch.equal(o1.master(p1), o2.master(p2))
    assert o1.grad_stream.sent > 0


def test_a_plan_made_at_the_step_starts_with_the_next_backward():
    """A new plan (refined rates on a GPU) comes at the step, after the backward streamed gradients for the
    old one: that step still runs the old placements (not every streamed subgroup forced onto the CPU), the
    next backward streams for the new plan, and every step stays bit-identical to the unstreamed run."""
    model = mlp()
    (m1, o1), (m2, o2) = _pair(model, schedule=2, subgroup_size=64)
    first = list(o1.placements)
    n, k = len(first), first.count(Placement.STAGED)
    assert 0 < k < n
    for opt in (o1, o2):
        later = dataclasses.replace(opt.plan, placements=[Placement.CPU] * n)

        def refresh(*args, opt=opt, later=later):
            opt.planner.current = later
            return later
        opt.planner.refresh = refresh
    gen1, gen2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    ran = []
    for step in range(3):
        for m, o, gen in ((m1, o1, gen1), (m2, o2, gen2)):
            o.zero_grad()
            loss_of(m, gen).backward()
            o.step()
        ran.append((o1.last_update.cpu_subgroups, o1.last_update.staged_subgroups))
        for p1, p2 in zip(m1.parameters(), m2.parameters()):
            assert torch.equal(o1.master(p1), o2.master(p2)), f"step {step}: masters differ"
    assert ran == [(n - k, k), (n, 0), (n, 0)]  # the first plan at the first step, then the new one
    assert o1.grad_stream.sent == (n - k) + 2 * n  # the second and third backward streamed every subgroup


@pytest.mark.parametrize("edit", ["scale_one_grad", "torch_clip_grad_norm"])
def test_gradients_changed_in_place_after_some_went_down_are_refused(edit):
    """Once gradients have gone to the host, an in-place change of the ones still on the device (torch's
    clip_grad_norm_ over the params, a manual scaling) would reach only part of the step's gradients: step()
    refuses it with a way out, and leaves params and states as they were."""
    model = mlp()
    opt = DeepOptimizerStates(model, lr=1e-2, subgroup_size=3000, stream_grads=True)
    opt.schedule = [Placement.CPU if i % 2 else Placement.STAGED for i in range(len(opt.layout.subgroups))]
    loss_of(model, torch.Generator().manual_seed(0)).backward()
    assert opt.grad_stream.landed and any(p.grad is not None for p in model.parameters())
    before = [p.detach().clone() for p in model.parameters()]
    if edit == "scale_one_grad":
        next(p for p in model.parameters() if p.grad is not None).grad.mul_(0.5)
    else:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    with pytest.raises(RuntimeError, match="changed in place after backward.*stream_grads=False"):
        opt.step()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert all(not opt.state[p] or int(opt.state[p]["step"]) == 0 for p in model.parameters())
    opt.zero_grad()  # and the next step trains normally
    loss_of(model, torch.Generator().manual_seed(1)).backward()
    opt.step()
    assert int(opt.state[next(model.parameters())]["step"]) == 1


def test_a_used_zero_element_param_inside_a_subgroup_does_not_send_it_early():
    """An empty param's gradient hook fires too; it belongs to no subgroup, so it must not count towards
    one: else the subgroup went down before a's gradient came, and a stepped on zeros."""
    class Gap(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.a, self.z, self.b = (nn.Parameter(torch.randn(n)) for n in (8, 0, 8))

        def forward(self, x):  # a used first: its gradient comes last
            return (torch.cat([x * self.a, self.z]) * self.b).sum() ** 2

    model = Gap()
    masters = [p.detach().clone().requires_grad_(True) for p in model.parameters()]
    ref = torch.optim.AdamW(masters, lr=1e-2, weight_decay=0.1)
    opt = DeepOptimizerStates(model, lr=1e-2, weight_decay=0.1, schedule="cpu", stream_grads=True,
                              subgroup_size=1000)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        opt.zero_grad()
        ref.zero_grad()
        x = torch.randn(8, generator=gen)
        model(x).backward()
        a, z, b = masters
        ((torch.cat([x * a, z]) * b).sum() ** 2).backward()
        ref.step()
        opt.step()
        for p, m in zip(model.parameters(), masters):
            torch.testing.assert_close(p.detach(), m.detach(), rtol=1e-6, atol=1e-7)


def test_only_empty_params_stream_nothing_and_step():
    model = nn.Linear(0, 0, bias=False)
    opt = DeepOptimizerStates(model, stream_grads=True)
    opt.zero_grad()
    model(torch.zeros(2, 0)).sum().backward()
    opt.step()


def test_norms_are_taken_in_batches_as_subgroups_go_down_and_as_backward_ends(monkeypatch):
    """A norm call per gradient cost backward's launching thread three kernel launches each (H200 call 22):
    the norms are taken in one call per batch, before any gradient of the batch goes down, and those left
    when backward ends are taken then, so every final gradient has its norm before step()."""
    model = mlp()
    opt = DeepOptimizerStates(model, lr=1e-2, subgroup_size=3000, stream_grads=True)
    opt.schedule = [Placement.CPU if i % 2 else Placement.STAGED for i in range(len(opt.layout.subgroups))]
    calls = []
    real = torch._foreach_norm
    monkeypatch.setattr(torch, "_foreach_norm", lambda ts, *a, **k: calls.append(len(ts)) or real(ts, *a, **k))
    loss_of(model, torch.Generator().manual_seed(0)).backward()
    params = list(model.parameters())
    sent = opt.grad_stream.sent
    assert 0 < sent < len(opt.layout.subgroups)
    assert len(calls) <= sent + 1 < len(params) and sum(calls) == len(params)
    assert set(opt.grad_stream.norms) == {id(p) for p in params}
    for p in params:
        if p.grad is not None:
            assert torch.equal(opt.grad_stream.norms[id(p)], real([p.grad], 2, dtype=torch.float32)[0])
    opt.step()


def test_a_hook_run_outside_backward_takes_its_norm_at_once():
    model = mlp()
    opt = DeepOptimizerStates(model, lr=1e-2, stream_grads=True)
    p = next(model.parameters())
    p.grad = torch.randn_like(p)
    opt.grad_stream._on_grad(p)
    torch.testing.assert_close(opt.grad_stream.norms[id(p)], p.grad.norm(), rtol=0, atol=0)


def test_norms_of_mixed_dtypes_are_taken_per_dtype_in_order():
    from deep_optimizer_states.core.grad_scaling import norms_fp32

    gen = torch.Generator().manual_seed(3)
    grads = [torch.randn(n, generator=gen).to(dt) for n, dt in
             [(5, torch.bfloat16), (7, torch.float32), (3, torch.bfloat16), (0, torch.float32)]]
    got = norms_fp32(grads)
    assert [n.dtype for n in got] == [torch.float32] * 4
    for g, n in zip(grads, got):
        assert torch.equal(n, torch._foreach_norm([g], 2, dtype=torch.float32)[0])


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_zero_grad_to_zeros_keeps_a_gradient_for_params_whose_gradients_left(overlap):
    """torch's ``zero_grad(set_to_none=False)`` leaves every param a zero gradient, so a param that gets none
    in the next backward is still stepped (its moments decay, decoupled decay applies). stream_grads gave
    the CPU path's gradients back in backward (``.grad`` None): the same call gives them zeros again, of
    their dtype, so that the steps equal those of the gathered path (held to torch's AdamW elsewhere);
    ``set_to_none=True`` after it leaves none, as torch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).to(torch.bfloat16)
    twin = copy.deepcopy(model)
    ours = DeepOptimizerStates(model, lr=1e-2, schedule="cpu", stream_grads=True, overlap=overlap)
    ref = DeepOptimizerStates(twin, lr=1e-2, schedule="cpu")
    gen = torch.Generator().manual_seed(1)
    for step, (whole, set_to_none) in enumerate([(True, False), (False, False), (False, True), (True, False),
                                                 (False, False)]):
        x = torch.randn(5, 8, generator=gen, dtype=torch.bfloat16)
        for m, o in ((model, ours), (twin, ref)):
            (m(x) if whole else m[0](x)).float().pow(2).mean().backward()  # else the last Linear gets none
            o.step()
        if step == 0:
            assert model[2].weight.grad is None  # given back by stream_grads
        with pytest.warns(UserWarning, match="set_to_none=False") if step == 0 else contextlib.nullcontext():
            ours.zero_grad(set_to_none=set_to_none)
        ref.zero_grad(set_to_none=set_to_none)
        for p, q in zip(model.parameters(), twin.parameters()):
            assert (p.grad is None) == (q.grad is None), step
            if p.grad is not None:
                assert p.grad.dtype == q.grad.dtype and torch.equal(p.grad, q.grad)
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(ours.master(p), ref.master(q)), "a param without a gradient was not stepped as torch"
        assert torch.equal(ours.state[p]["exp_avg_sq"], ref.state[q]["exp_avg_sq"])


def test_a_param_read_in_two_reentrant_checkpoint_segments_is_refused_with_what_to_change():
    """Reentrant activation checkpointing runs a backward per segment: a param read in two of them (weights
    shared across layers) has its gradient accumulated, and its hook run, once per segment, and streaming
    took the first as final. The backward raises, naming the checkpointing and its alternatives, not only
    micro-batches; non-reentrant checkpointing streams it."""
    from torch.utils.checkpoint import checkpoint

    class Looped(nn.Module):
        def __init__(self, reentrant: bool) -> None:
            super().__init__()
            self.reentrant, self.block, self.head = reentrant, nn.Linear(16, 16), nn.Linear(16, 1)

        def forward(self, x):
            for _ in range(2):
                x = checkpoint(lambda h: torch.tanh(self.block(h)), x, use_reentrant=self.reentrant)
            return self.head(x).pow(2).mean()

    x = torch.randn(8, 16, requires_grad=True)  # reentrant checkpointing needs an input that requires grad
    for reentrant in (False, True):
        torch.manual_seed(0)
        model = Looped(reentrant)
        twin = copy.deepcopy(model)
        opt = DeepOptimizerStates(model, lr=1e-2, schedule="cpu", stream_grads=True)
        ref = DeepOptimizerStates(twin, lr=1e-2, schedule="cpu")
        if reentrant:
            with pytest.raises(RuntimeError, match="use_reentrant=False"):
                model(x).backward()
            continue
        for _ in range(3):
            for m, o in ((model, opt), (twin, ref)):
                o.zero_grad()
                m(x).backward()
                o.step()
        assert all(torch.equal(opt.master(p), ref.master(q)) for p, q in zip(model.parameters(), twin.parameters()))


def test_a_second_step_without_a_backward_warns_that_the_streamed_gradients_are_gone():
    """torch steps again with the gradients the params still hold; those stream_grads sent to the host are
    gone from the params (``.grad`` None), so a second ``step()`` with no backward between cannot: it warns
    once, saying to zero the gradients between steps. After ``opt.zero_grad()`` there is nothing to warn of."""
    model = mlp()
    opt = DeepOptimizerStates(model, lr=1e-2, schedule="cpu", stream_grads=True)
    gen = torch.Generator().manual_seed(0)
    loss_of(model, gen).backward()
    opt.step()
    with pytest.warns(RuntimeWarning, match="no backward since the last step"):
        opt.step()
    opt.zero_grad()
    loss_of(model, gen).backward()
    opt.step()
    opt.zero_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()  # nothing to step, nothing gone

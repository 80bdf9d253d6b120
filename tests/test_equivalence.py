"""Our optimizer against torch.optim.AdamW on fp32 masters, step by step, for every schedule (CPU lanes)."""

import copy

import pytest
import torch

from deep_optimizer_states import DeepOptimizerStates, Placement
from deep_optimizer_states.core.engine import DEFAULT_STAGING_SLOTS
from deep_optimizer_states.reference import ReferenceAdamW
from tests.harness import SCHEDULES, loss_of, mlp, tiny_llama, train_and_compare

MODELS = {"mlp": mlp, "llama": tiny_llama}


def _steps(opt) -> int:
    """The step count of the first param (every param here gets a gradient each step)."""
    return int(opt.state[opt.param_groups[0]["params"][0]].get("step", 0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("schedule", SCHEDULES, ids=str)
@pytest.mark.parametrize("kind", MODELS)
def test_matches_adamw_every_schedule(kind, schedule, dtype):
    model = MODELS[kind](dtype)
    size = sum(p.numel() for p in model.parameters()) // 10
    opt = DeepOptimizerStates(model, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1, subgroup_size=size,
                              schedule=schedule)
    assert len(opt.layout.subgroups) >= 10
    if schedule not in ("cpu", "gpu", 1):
        assert {Placement.CPU, Placement.STAGED} == set(opt.placements)
    train_and_compare(model, opt, steps=30)
    expected = {"cpu": 0, "gpu": 1.0, 1: 1.0}.get(schedule)
    if expected is not None:
        assert opt.last_update.staged_subgroups == expected * len(opt.layout.subgroups)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("subgroup_size", [37, 333, 1000, 4000])
@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "adam"])
def test_bit_for_bit_torch_on_the_cpu(subgroup_size, threads, adamw):
    """Params of sizes that are no multiple of the kernel's unit, cut by subgroups anywhere, some without a
    gradient at some steps (so step counts differ between neighbours): the masters equal torch's fused
    AdamW (or Adam) on fp32 params bit for bit, on 1 and on 2 threads (the kernel's parallel chunks)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(0)
        shapes = [(1000,), (37, 13), (517,), (64, 64), (5,), (300, 7)]
        ours_params = [torch.nn.Parameter(torch.randn(s) * 0.1) for s in shapes]
        ref_params = [torch.nn.Parameter(p.detach().clone()) for p in ours_params]
        cls = torch.optim.AdamW if adamw else torch.optim.Adam
        opt = DeepOptimizerStates(ours_params, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, adamw=adamw,
                                  subgroup_size=subgroup_size, schedule="cpu")
        ref = cls(ref_params, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
        gen = torch.Generator().manual_seed(1)
        for step in range(6):
            for k, (p, q) in enumerate(zip(ours_params, ref_params)):
                skip = (k + step) % 4 == 0  # this param has no gradient this step
                g = None if skip else torch.randn(p.shape, generator=gen) * 0.01
                p.grad, q.grad = g, (None if g is None else g.clone())
            opt.step()
            ref.step()
            for p, q in zip(ours_params, ref_params):
                assert torch.equal(opt.master(p), q.detach()), f"step {step}: param of shape {tuple(p.shape)}"
                if q in ref.state:
                    assert torch.equal(opt.state[p]["exp_avg_sq"], ref.state[q]["exp_avg_sq"])
    finally:
        torch.set_num_threads(before)


def test_classic_adam_matches_torch_adam():
    model = mlp()
    opt = DeepOptimizerStates(model.parameters(), lr=1e-2, weight_decay=0.05, adamw=False, subgroup_size=2500,
                              schedule=2)
    train_and_compare(model, opt, steps=30, ref_cls=torch.optim.Adam)


def test_classic_adam_with_its_defaults_matches_torch_adam_with_its_defaults():
    """adamw=False takes torch.optim.Adam's default weight decay (0), not AdamW's (1e-2)."""
    model = mlp()
    opt = DeepOptimizerStates(model.parameters(), lr=1e-2, adamw=False, subgroup_size=2500, schedule=2)
    assert opt.param_groups[0]["weight_decay"] == 0.0
    train_and_compare(model, opt, steps=10, ref_cls=torch.optim.Adam)
    assert DeepOptimizerStates(mlp().parameters()).param_groups[0]["weight_decay"] == 1e-2


def test_param_groups_with_own_lr_and_weight_decay_and_a_scheduler():
    model = tiny_llama()
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = DeepOptimizerStates([{"params": decay, "weight_decay": 0.1},
                               {"params": no_decay, "weight_decay": 0.0, "lr": 5e-3}],
                              lr=2e-3, subgroup_size=4000, schedule=3)
    groups = {sg.group_index for sg in opt.layout.subgroups}
    assert groups == {0, 1}
    for sg in opt.layout.subgroups:  # a subgroup never mixes param groups
        assert all(any(p is q for q in opt.param_groups[sg.group_index]["params"]) for p in sg.bucket.params)

    def sched(o):
        return torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s))

    train_and_compare(model, opt, steps=30, scheduler=sched)
    assert opt.param_groups[1]["lr"] == pytest.approx(5e-3 / 31)


@pytest.mark.parametrize("schedule", ["cpu", 2, "gpu"], ids=str)
def test_global_norm_clipping_equals_torch(schedule):
    model = tiny_llama(torch.bfloat16)
    opt = DeepOptimizerStates(model, lr=1e-3, subgroup_size=5000, schedule=schedule)
    train_and_compare(model, opt, steps=30, max_norm=0.05)  # small: every step is clipped


def test_max_grad_norm_argument_clips_and_reports_the_norm():
    model = mlp()
    opt = DeepOptimizerStates(model, lr=1e-2, subgroup_size=2000, schedule=2, max_grad_norm=0.01)
    ref = ReferenceAdamW(opt)
    gen = torch.Generator().manual_seed(3)
    for _ in range(10):
        opt.zero_grad()
        loss_of(model, gen).backward()
        ref_norm = ref.step(max_norm=0.01)
        opt.step()
        torch.testing.assert_close(opt.last_grad_norm, ref_norm, rtol=1e-6, atol=0)
        ref.assert_matches()


@pytest.mark.parametrize("change", ["nan", "backward", "new_grad"])
def test_gradients_changed_after_clip_grad_norm_are_not_stepped_by_its_norm(change):
    """``opt.clip_grad_norm_`` measures the gradients for the step; if they change before it (an inf/nan
    written in, another backward, a new ``.grad``), that norm is not theirs: a non-finite change skips the
    step as any inf/nan step does (the states stay finite and the checkpoint loads), a finite one is
    refused with what to do, nothing updated."""
    model = mlp()
    opt = DeepOptimizerStates(model, lr=1e-2, subgroup_size=2000, schedule=2)
    gen = torch.Generator().manual_seed(3)
    loss_of(model, gen).backward()
    opt.step()
    before = [opt.master(p).clone() for p in model.parameters()]
    opt.zero_grad()
    loss_of(model, gen).backward()
    opt.clip_grad_norm_(1.0)
    last = list(model.parameters())[-1]
    if change == "nan":
        with torch.no_grad():
            last.grad[0] = float("nan")
        with pytest.warns(RuntimeWarning, match="step skipped"):
            opt.step()
        assert opt.skipped_steps == 1
        opt.load_state_dict(opt.state_dict())  # finite states: its own checkpoint loads
    else:
        if change == "backward":
            loss_of(model, gen).backward()
        else:
            last.grad = last.grad * 2
        with pytest.raises(RuntimeError, match="changed after opt.clip_grad_norm_"):
            opt.step()
    assert all(torch.equal(opt.master(p), b) for p, b in zip(model.parameters(), before)), "nothing updated"


def test_a_gradient_dropped_after_clip_grad_norm_leaves_the_others_clipped_as_torch():
    """torch's clip scales the gradients there and then; one set to None after it is not stepped, the others
    are, clipped by the norm that counted it: the same here (nothing changed in the gradients left)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    twin = copy.deepcopy(model)
    opt = DeepOptimizerStates(model, lr=1e-2, schedule=2, subgroup_size=16)
    ref = torch.optim.AdamW(twin.parameters(), lr=1e-2, fused=True)
    x = torch.randn(4, 6)
    for m, o in ((model, opt), (twin, ref)):
        m(x).pow(2).sum().backward()
        if o is opt:
            opt.clip_grad_norm_(0.01)
        else:
            torch.nn.utils.clip_grad_norm_(twin.parameters(), 0.01)
        m[1].bias.grad = None
        o.step()
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(opt.master(p), q.detach(), rtol=1e-6, atol=0)
    assert not opt.state[model[1].bias]


@pytest.mark.parametrize("schedule", ["cpu", 3], ids=str)
def test_gradient_accumulation_over_four_micro_batches(schedule):
    model = tiny_llama()
    opt = DeepOptimizerStates(model, lr=1e-3, subgroup_size=5000, schedule=schedule)
    train_and_compare(model, opt, steps=30, micro_batches=4)


def test_tied_embeddings_are_updated_once():
    model = tiny_llama(tie=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    params = list(model.parameters())
    opt = DeepOptimizerStates(params + [model.lm_head.weight], lr=1e-3, subgroup_size=5000, schedule=2)
    assert sum(len(b.params) for b in opt.layout.buckets) == len(params)
    train_and_compare(model, opt, steps=30)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_model_zero_grad_to_none_is_recovered():
    """Frameworks call model.zero_grad() (grads to None): fresh grads must land in our buffers."""
    model = mlp()
    opt = DeepOptimizerStates(model, lr=1e-2, subgroup_size=2000, schedule=2)
    ref = ReferenceAdamW(opt)
    gen = torch.Generator().manual_seed(5)
    for _ in range(10):
        model.zero_grad(set_to_none=True)
        assert all(p.grad is None for p in model.parameters())
        loss_of(model, gen).backward()
        ref.step()
        opt.step()
        ref.assert_matches()


def test_frozen_params_are_left_alone():
    model = mlp()
    model[0].weight.requires_grad_(False)
    before = model[0].weight.detach().clone()
    opt = DeepOptimizerStates(model, lr=1e-2, subgroup_size=2000)
    assert all(p is not model[0].weight for b in opt.layout.buckets for p in b.params)
    train_and_compare(model, opt, steps=5)
    assert torch.equal(model[0].weight, before)


def test_fp16_dynamic_loss_scaling_skips_overflow_steps():
    model = mlp(torch.float16)
    opt = DeepOptimizerStates(model, lr=1e-3, subgroup_size=2000, schedule=2)
    assert opt.scaler is not None and opt.scaler.scale == 2.0**16
    ref = ReferenceAdamW(opt)
    gen = torch.Generator().manual_seed(7)
    for step in range(12):
        opt.zero_grad()
        scale = opt.scaler.scale
        opt.scale_loss(loss_of(model, gen)).backward()
        if step in (3, 8):  # an overflow: nothing may change
            next(model.parameters()).grad.view(-1)[5] = float("inf" if step == 3 else "nan")
            masters = [s["master"].clone() for s in opt.state.values()]
            params = [p.detach().clone() for p in model.parameters()]
            steps_before = _steps(opt)
            opt.step()
            assert opt.scaler.scale == scale / 2
            assert _steps(opt) == steps_before
            assert all(torch.equal(a, s["master"]) for a, s in zip(masters, opt.state.values()))
            assert all(torch.equal(a, p) for a, p in zip(params, model.parameters()))
            continue
        ref.step(unscale=1.0 / scale)
        opt.step()
        ref.assert_matches()
    assert opt.scaler.skipped_steps == 2
    assert _steps(opt) == 10


def test_fp16_gradients_that_stay_nonfinite_end_in_a_clear_error_not_a_zero_scale():
    """A NaN that no scale removes (here: in the data) is skipped while the scale backs off, then named once
    the scale would fall below 1 (it used to reach 0 and divide by zero after ~1100 silent steps)."""
    model = mlp(torch.float16)
    opt = DeepOptimizerStates(model, lr=1e-3, subgroup_size=2000, schedule=2, loss_scale=8.0)
    gen = torch.Generator().manual_seed(0)
    with pytest.raises(FloatingPointError, match="inf/nan gradients at every loss scale down to 1"):
        for _ in range(10):
            opt.zero_grad()
            opt.scale_loss(loss_of(model, gen) * float("nan")).backward()
            opt.step()
    assert opt.scaler.scale == 0.5 and opt.skipped_steps == 4 and _steps(opt) == 0


def test_fp16_without_scaled_loss_is_an_error():
    model = mlp(torch.float16)
    opt = DeepOptimizerStates(model, lr=1e-3)
    loss_of(model, torch.Generator().manual_seed(0)).backward()
    with pytest.raises(RuntimeError, match="scale_loss"):
        opt.step()


def test_fp16_second_step_on_the_same_gradients_says_so():
    """A second step() with no backward of a scaled loss since the last is refused, and the message says
    that this is why (the user did call scale_loss, for the first step)."""
    model = mlp(torch.float16)
    opt = DeepOptimizerStates(model, lr=1e-3)
    opt.scale_loss(loss_of(model, torch.Generator().manual_seed(0))).backward()
    opt.step()
    with pytest.raises(RuntimeError, match="a second step.. on the same gradients"):
        opt.step()


def test_module_and_iterable_forms_are_the_same_optimizer():
    a, b = mlp(), mlp()
    oa = DeepOptimizerStates(a, lr=1e-2, subgroup_size=2000)
    ob = DeepOptimizerStates(b.parameters(), lr=1e-2, subgroup_size=2000)
    assert oa.module is a and ob.module is None
    gen_a, gen_b = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
    for _ in range(5):
        for m, o, g in ((a, oa, gen_a), (b, ob, gen_b)):
            o.zero_grad()
            loss_of(m, g).backward()
            o.step()
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


def test_an_error_inside_the_update_propagates_and_training_waits_for_a_checkpoint(monkeypatch):
    """A failing kernel (here: the third CPU AdamW call) surfaces as the step's exception, nothing hangs, and
    the half-applied step (two subgroups updated, no step counted) is neither trained on nor checkpointed:
    step() and state_dict() say to load a checkpoint, and after loading one training equals torch again."""
    import copy

    import deep_optimizer_states.core.engine as engine

    model = mlp()
    opt = DeepOptimizerStates(model, lr=1e-2, subgroup_size=2000, schedule=2)
    weights, saved = copy.deepcopy(model.state_dict()), opt.state_dict()
    real, calls = engine.adam_update, []

    def flaky(*args):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected failure")
        real(*args)

    monkeypatch.setattr(engine, "adam_update", flaky)
    gen = torch.Generator().manual_seed(0)
    loss_of(model, gen).backward()
    with pytest.raises(RuntimeError, match="injected failure"):
        opt.step()
    assert _steps(opt) == 0  # the step did not count
    monkeypatch.setattr(engine, "adam_update", real)
    for refused in (opt.step, opt.state_dict):
        with pytest.raises(RuntimeError, match="failed part-way.*load the last checkpoint"):
            refused()
    model.load_state_dict(weights)
    opt.load_state_dict(saved)
    torch_model = copy.deepcopy(model)
    torch_opt = torch.optim.AdamW(torch_model.parameters(), lr=1e-2)
    for m, o in ((model, opt), (torch_model, torch_opt)):
        o.zero_grad()
        loss_of(m, torch.Generator().manual_seed(1)).backward()
        o.step()
    assert _steps(opt) == 1
    for x, y in zip(model.parameters(), torch_model.parameters()):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7)


def test_cpu_path_in_a_worker_thread_as_on_a_gpu_machine():
    """On a GPU the CPU path runs in the engine's worker thread, where the caller's no_grad does not reach;
    run it there on the CPU too, so that the threaded path is covered without a GPU."""
    from concurrent.futures import ThreadPoolExecutor

    model = tiny_llama()
    opt = DeepOptimizerStates(model, lr=1e-3, subgroup_size=5000, schedule=2)
    opt.engine._worker = ThreadPoolExecutor(1)
    train_and_compare(model, opt, steps=5)
    opt.close()


def test_memory_report_counts_host_states_and_update_buffers():
    model = mlp()
    opt = DeepOptimizerStates(model, lr=1e-3, subgroup_size=2000, schedule="gpu")
    n = sum(p.numel() for p in model.parameters())
    assert opt.memory() == {"host_bytes": 16 * n, "device_resident_bytes": 0, "device_update_bytes": 0,
                            "resident_subgroups": 0, "admitted": 0, "evicted": 0, "failed_admissions": 0,
                            "gpu_budget_bytes": None, "gpu_need_bytes": None, "gpu_ours_at_need_bytes": None}
    loss_of(model, torch.Generator().manual_seed(0)).backward()
    opt.step()
    biggest = max(sg.numel for sg in opt.layout.subgroups)
    assert opt.memory()["device_update_bytes"] == 16 * biggest * min(DEFAULT_STAGING_SLOTS, len(opt.layout.subgroups))

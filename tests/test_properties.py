"""Property-based tests (hypothesis): DeepOptimizerStates in lockstep with torch's own fused optimizer.

Each example builds a few bare ``nn.Parameter``s (0-dim, 1-element, odd and empty shapes; fp32, bf16, fp16;
some frozen) in one to three param groups with their own hyper-parameters, cuts them into tiny subgroups that
straddle params, picks a schedule, clipping, and for every step which params get a fresh gradient, an
accumulated one, none at all (``p.grad = None``: torch leaves such a param entirely alone) or keep what they
have, after ``zero_grad(set_to_none=True/False)`` or none. The reference is ``torch.optim.AdamW`` (or
``torch.optim.Adam`` for ``adamw=False``) with ``fused=True`` over fp32 copies of our masters, fed the same
gradients up-cast to fp32 and clipped with ``torch.nn.utils.clip_grad_norm_``.

A second family of properties: every invalid argument is refused with a ValueError or TypeError that names
the argument - never another exception, never accepted silently.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st
from torch import nn

from deep_optimizer_states import DeepOptimizerStates
from tests.harness import total_norm

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _grads_may_differ_in_dtype() -> bool:
    """Whether this torch lets a param hold a gradient of another dtype (``grad_dtype``: fp32 on bf16); torch
    2.5-2.7 have no such attribute and refuse."""
    p = torch.zeros(1, dtype=torch.bfloat16, requires_grad=True)
    try:
        p.grad_dtype = torch.float32
        p.grad = torch.zeros(1)
        return True
    except RuntimeError:
        return False


FP32_GRADS = _grads_may_differ_in_dtype()  # else no fp32 gradient on a bf16/fp16 param is drawn
SCHEDULES = ["cpu", "gpu", 1, 2, 3, "auto"]
NAN, INF = float("nan"), float("inf")

# Reproducible in CI: the same examples every run, no example database.
PROFILE = dict(deadline=None, derandomize=True, database=None, print_blob=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# ---- strategies -------------------------------------------------------------------------------------------
shapes = st.one_of(
    st.just(()),  # 0-dim scalar
    st.just((1,)),
    st.tuples(st.integers(1, 13)),
    st.tuples(st.integers(1, 5), st.integers(1, 7)),
    st.tuples(st.integers(1, 3), st.integers(1, 3), st.integers(1, 4)),
    st.sampled_from([(0,), (3, 0)]),  # empty params: torch still counts their steps
)
lrs = st.one_of(st.sampled_from([0, 0.0, 1e-3, 0.1]), st.floats(1e-5, 0.5))
betas = st.tuples(st.one_of(st.just(0.0), st.floats(0.0, 0.99)), st.one_of(st.just(0.0), st.floats(0.0, 0.9999)))
epss = st.one_of(st.sampled_from([1e-8, 1e-6, 1e-3, 0.0]), st.floats(1e-10, 0.1))
decays = st.one_of(st.sampled_from([0, 0.0, 0.01, 0.1]), st.floats(0.0, 1.0))
group_overrides = st.fixed_dictionaries({}, optional={"lr": lrs, "betas": betas, "eps": epss, "weight_decay": decays})


def _spec(dtype, fp32_grad):
    return st.fixed_dictionaries({
        "shape": shapes,
        "dtype": st.just(dtype),
        "fp32_grad": st.just(fp32_grad),  # grad_dtype=float32 on a bf16/fp16 param
        "frozen": st.integers(0, 7).map(lambda k: k == 0),  # requires_grad=False: in param_groups, no state
        "scale": st.sampled_from([1e-3, 1.0, 30.0]),  # gradient magnitude
    })


@st.composite
def param_specs(draw, grad_dtype):
    """One param; ``grad_dtype`` None: any dtype and grad dtype, else every gradient has that dtype."""
    if grad_dtype is None:
        dtype = draw(st.sampled_from(DTYPES))
        fp32_grad = FP32_GRADS and dtype != torch.float32 and draw(st.integers(0, 3)) == 0
    elif grad_dtype == torch.float32:  # fp32 gradients on params of any dtype
        dtype = draw(st.sampled_from(DTYPES if FP32_GRADS else [torch.float32]))
        fp32_grad = dtype != torch.float32
    else:
        dtype, fp32_grad = grad_dtype, False
    return draw(_spec(dtype, fp32_grad))


def _grad_dtypes(cfg):
    return {torch.float32 if s["fp32_grad"] else s["dtype"] for specs, _ in cfg["groups"] for s in specs
            if not s["frozen"]}


def configs(mixed: bool):
    """Optimizer configurations whose gradients all share one dtype (``mixed=False``) or do not."""
    specs = (param_specs(None) if mixed else st.shared(st.sampled_from(DTYPES), key="grad dtype").flatmap(param_specs))
    return st.fixed_dictionaries({
        "groups": st.lists(st.tuples(st.lists(specs, min_size=1, max_size=4), group_overrides), min_size=1, max_size=3),
        "adamw": st.booleans(),
        "lr": lrs, "betas": betas, "eps": epss, "weight_decay": decays,
        "subgroup_size": st.integers(1, 12),
        "schedule": st.sampled_from(SCHEDULES),
        "max_grad_norm": st.one_of(st.none(), st.floats(1e-3, 2.0)),
        "steps": st.integers(3, 5),
        "seed": st.integers(0, 2**16),
    }).filter(lambda c: len(_grad_dtypes(c)) > 1 if mixed else len(_grad_dtypes(c)) == 1)  # and one trainable


GRAD_ACTIONS = ["new", "new", "add", "none", "keep", "edit"]
GRAD_LAYOUTS = ["contiguous", "contiguous", "transposed", "strided", "expanded"]


# ---- the lockstep run -------------------------------------------------------------------------------------
def _make_params(cfg, gen):
    """Our params (in the model's dtypes) and fp32 copies for torch, group by group, in the same order."""
    ours, ref, pairs = [], [], []
    for specs, over in cfg["groups"]:
        mine, theirs = [], []
        for s in specs:
            p = nn.Parameter((torch.randn(s["shape"], generator=gen) * 0.5).to(s["dtype"]),
                             requires_grad=not s["frozen"])
            if s["fp32_grad"]:
                p.grad_dtype = torch.float32
            r = nn.Parameter(p.detach().float().clone(), requires_grad=not s["frozen"])
            mine.append(p)
            theirs.append(r)
            if not s["frozen"]:
                pairs.append((p, r, s))
        ours.append({"params": mine, **over})
        ref.append({"params": theirs, **over})
    return ours, ref, pairs


def _grad(p, s, layout, gen):
    """A random gradient for ``p`` in its grad dtype, laid out contiguous, transposed, strided or expanded."""
    dtype = torch.float32 if s["fp32_grad"] else p.dtype
    shape = tuple(p.shape)
    if layout == "transposed" and len(shape) >= 2:
        g = torch.randn(shape[::-1], generator=gen).permute(*reversed(range(len(shape))))
    elif layout == "strided" and len(shape) >= 1:
        g = torch.randn(*shape[:-1], 2 * shape[-1], generator=gen)[..., ::2]
    elif layout == "expanded":
        g = torch.randn((), generator=gen).expand(shape)
    else:
        g = torch.randn(shape, generator=gen)
    return (g * s["scale"]).to(dtype)  # .to keeps the layout (a no-op for fp32)


def _set_grads(data, pairs, gen):
    for p, r, s in pairs:
        action = data.draw(st.sampled_from(GRAD_ACTIONS))
        layout = data.draw(st.sampled_from(GRAD_LAYOUTS))
        if action == "edit":  # an in-place edit of the weight (model.load_state_dict): it becomes the master
            with torch.no_grad():
                p.mul_(0.5).add_(0.25)
                r.copy_(p.float())
            p.grad = _grad(p, s, layout, gen)
        elif action == "none":
            p.grad = None
        elif action == "new" or (action == "add" and p.grad is None):
            p.grad = _grad(p, s, layout, gen)
        elif action == "add":
            g = _grad(p, s, layout, gen)
            if p.grad.is_contiguous():  # accumulate in place, as backward() does
                p.grad.add_(g)
            else:  # an expanded grad cannot be written in place
                p.grad = p.grad + g
        # "keep": whatever zero_grad left (None, zeros) or last step's gradient


def _check(opt, ref, pairs, step):
    for k, (p, r, s) in enumerate(pairs):
        where = f"step {step}, param {k} {tuple(p.shape)} {p.dtype}"
        master = opt.master(p)
        torch.testing.assert_close(master, r.detach(), rtol=1e-6, atol=1e-7, equal_nan=True,
                                   msg=lambda m: f"{where}: master differs from torch\n{m}")
        torch.testing.assert_close(p.detach(), master.to(p.dtype), rtol=0, atol=0, equal_nan=True,
                                   msg=lambda m: f"{where}: param is not its master rounded\n{m}")
        theirs, state = ref.state.get(r), opt.state.get(p)
        # as torch: state only for a param that has taken a step, with step/exp_avg/exp_avg_sq (+ master)
        assert bool(state) == bool(theirs), f"{where}: opt.state has {state and sorted(state)}, torch {theirs}"
        if theirs:
            torch.testing.assert_close(state["master"], master, rtol=0, atol=0, equal_nan=True,
                                       msg=lambda m: f"{where}: opt.state[p]['master'] is not opt.master(p)\n{m}")
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(state[key], theirs[key], rtol=1e-6, atol=1e-7, equal_nan=True,
                                           msg=lambda m: f"{where}: {key} differs from torch\n{m}")
            assert int(state["step"]) == int(theirs["step"]), f"{where}: step {state['step']} != {theirs['step']}"
    ours_sd, theirs_sd = opt.state_dict()["state"], ref.state_dict()["state"]
    assert set(ours_sd) == set(theirs_sd), f"step {step}: state_dict entries {sorted(ours_sd)} != {sorted(theirs_sd)}"
    for i in theirs_sd:
        assert float(ours_sd[i]["step"]) == float(theirs_sd[i]["step"]), f"step {step}: state_dict step of param {i}"


def _run_lockstep(cfg, data):
    gen = torch.Generator().manual_seed(cfg["seed"])
    ours, theirs, pairs = _make_params(cfg, gen)
    fp16 = any(p.dtype == torch.float16 for p, _, _ in pairs)
    hyper = {k: cfg[k] for k in ("lr", "betas", "eps", "weight_decay")}
    opt = DeepOptimizerStates(ours, **hyper, adamw=cfg["adamw"], subgroup_size=cfg["subgroup_size"],
                              schedule=cfg["schedule"], max_grad_norm=cfg["max_grad_norm"],
                              loss_scale=None if fp16 else data.draw(st.sampled_from([None, "auto"])))
    ref = (torch.optim.AdamW if cfg["adamw"] else torch.optim.Adam)(theirs, **hyper, fused=True)
    frozen = [(p, p.detach().clone()) for g in ours for p in g["params"] if not p.requires_grad]
    note(f"subgroups: {[(sg.group_index, sg.start, sg.end) for sg in opt.layout.subgroups]}")
    note(f"placements: {[pl.value for pl in opt.placements]}")
    _check(opt, ref, pairs, 0)
    for step in range(1, cfg["steps"] + 1):
        zero = data.draw(st.sampled_from([True, False, None]), label="zero_grad(set_to_none=...) or none")
        if zero is not None:
            opt.zero_grad(set_to_none=zero)
        _set_grads(data, pairs, gen)
        if data.draw(st.integers(0, 4), label="lr change") == 0:  # an LR scheduler's kind of edit
            gi = data.draw(st.integers(0, len(opt.param_groups) - 1))
            lr = data.draw(lrs)
            opt.param_groups[gi]["lr"] = ref.param_groups[gi]["lr"] = lr
        if data.draw(st.integers(0, 5), label="schedule change") == 0:
            opt.schedule = data.draw(st.sampled_from(SCHEDULES))
        for p, r, _ in pairs:
            r.grad = None if p.grad is None else p.grad.detach().to(torch.float32, copy=True).contiguous()
        grads = [r.grad for _, r, _ in pairs if r.grad is not None]
        ref_norm = total_norm(grads) if grads else None  # fp32, before clipping
        clip_now = data.draw(st.one_of(st.none(), st.floats(1e-3, 2.0)), label="clip_grad_norm_ now")
        clip = clip_now if clip_now is not None else cfg["max_grad_norm"]
        if clip is not None:
            torch.nn.utils.clip_grad_norm_([r for _, r, _ in pairs], clip)
        if clip_now is not None and grads:
            torch.testing.assert_close(opt.clip_grad_norm_(clip_now), ref_norm, rtol=1e-6, atol=1e-12,
                                       msg=lambda m: f"step {step}: clip_grad_norm_'s norm differs\n{m}")
        elif clip_now is not None:
            opt.clip_grad_norm_(clip_now)
        opt.step()
        ref.step()
        if grads:
            torch.testing.assert_close(opt.last_grad_norm, ref_norm, rtol=1e-6, atol=1e-12,
                                       msg=lambda m: f"step {step}: global gradient norm differs\n{m}")
        _check(opt, ref, pairs, step)
    for p, before in frozen:  # requires_grad=False: never touched, no state
        assert torch.equal(p.detach(), before) and not opt.state.get(p)
    opt.close()


@settings(max_examples=60, **PROFILE)
@given(cfg=configs(mixed=False), data=st.data())
def test_matches_torch(cfg, data):
    """Every gradient of the optimizer has one dtype (params may differ: fp32 grads on bf16/fp16 params)."""
    _run_lockstep(cfg, data)


@settings(max_examples=40, **PROFILE)
@given(cfg=configs(mixed=True), data=st.data())
def test_matches_torch_with_mixed_gradient_dtypes(cfg, data):
    """fp32, bf16 and fp16 gradients in one optimizer (e.g. fp32 norms/biases beside bf16 weights)."""
    _run_lockstep(cfg, data)


@pytest.mark.parametrize("low", [torch.bfloat16, torch.float16], ids=str)
def test_global_norm_does_not_depend_on_param_order(low):
    ga = torch.tensor([0.3, -0.2, 0.1])
    gb = torch.tensor([1.1, -0.7, 0.33, 2.01, -1.3]).to(low)
    exact = total_norm([ga, gb.float()])
    for first_fp32 in (False, True):
        a, b = nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(5, dtype=low))
        opt = DeepOptimizerStates([a, b] if first_fp32 else [b, a], subgroup_size=4, schedule="cpu", loss_scale=None)
        a.grad, b.grad = ga.clone(), gb.clone()
        torch.testing.assert_close(opt.clip_grad_norm_(1.0), exact, rtol=1e-6, atol=0,
                                   msg=lambda m: f"fp32 param first={first_fp32}\n{m}")
        opt.close()


# ---- invalid input ----------------------------------------------------------------------------------------
def _floats(lo=None, hi=None, **kw):
    return st.floats(lo, hi, allow_nan=False, **kw)


BAD = {
    "lr": st.one_of(_floats(hi=0.0, exclude_max=True), st.sampled_from([NAN, INF, -INF, "0.1", None]),
                    _floats(1e-6, 1.0).map(torch.tensor)),
    "betas": st.one_of(
        st.tuples(_floats(lo=1.0), _floats(0.0, 0.999)),
        st.tuples(_floats(0.0, 0.999), _floats(lo=1.0)),
        st.tuples(_floats(hi=0.0, exclude_max=True), _floats(0.0, 0.999)),
        st.tuples(_floats(0.0, 0.999), _floats(hi=0.0, exclude_max=True)),
        st.lists(_floats(0.0, 0.999), max_size=5).filter(lambda b: len(b) != 2).map(tuple),  # wrong length
        st.sampled_from([(NAN, 0.999), (0.9, NAN), (0.9, INF), 0.9, None, "ab"]),
    ),
    "eps": st.one_of(_floats(hi=0.0, exclude_max=True), st.sampled_from([NAN, INF, -INF, None, "1e-8"])),
    "weight_decay": st.one_of(_floats(hi=0.0, exclude_max=True), st.sampled_from([NAN, INF, -INF, None])),
    "subgroup_size": st.one_of(st.integers(max_value=0), _floats(0.5, 1e6).filter(lambda x: x != int(x)),
                               st.sampled_from([2.0, 8.0, True, False, "8", None])),
    "schedule": st.one_of(st.integers(max_value=0), _floats(0.5, 10.0),
                          st.sampled_from([NAN, INF, "fast", "", "CPU", "Auto", True, False, None])),
    "max_grad_norm": st.one_of(_floats(hi=0.0), st.sampled_from([NAN, INF, -INF, "1.0"])),
    "nonfinite": st.sampled_from(["ignore", "SKIP", "", None, 1, True]),
    "loss_scale": st.one_of(_floats(hi=0.0), st.sampled_from([NAN, INF, -INF, "sometimes", "", True, False])),
    "staging_slots": st.one_of(st.integers(max_value=0), st.sampled_from([1.5, 2.0, True, None])),
    "amsgrad": st.just(True),
    "maximize": st.just(True),
}
GROUP_KEYS = ("lr", "betas", "eps", "weight_decay")  # also valid per param group and editable between steps


def _assert_refused(kwarg, value, build):
    """``build()`` raises a ValueError/TypeError whose message names ``kwarg``; nothing else is acceptable."""
    try:
        result = build()
    except (ValueError, TypeError) as e:
        assert kwarg in str(e), f"{kwarg}={value!r}: the error does not name the argument: {type(e).__name__}: {e}"
        return
    except Exception as e:  # noqa: BLE001 - any other exception is the failure we look for
        pytest.fail(f"{kwarg}={value!r} raised {type(e).__name__} (not ValueError/TypeError): {e}")
    if isinstance(result, DeepOptimizerStates):
        result.close()
    pytest.fail(f"{kwarg}={value!r} was accepted silently")


# The classic bad values, each its own test (hypothesis may not draw a particular one).
CURATED = {
    "lr": [-1e-3, -1e-12, NAN, INF, -INF, torch.tensor(1e-3), "0.1", None],
    "betas": [(1.0, 0.999), (0.9, 1.0), (1.5, 0.9), (-0.1, 0.999), (0.9, -0.5), (0.9,), (0.9, 0.99, 0.999), (),
              (NAN, 0.999), (0.9, NAN), (0.9, INF), 0.9, None, "ab"],
    "eps": [-1e-8, NAN, INF, -INF, None, "1e-8"],
    "weight_decay": [-0.1, NAN, INF, -INF, None, "0.1"],
    "subgroup_size": [0, -1, -100, 1.5, 2.0, True, False, "8", None],
    "schedule": [0, -1, -3, "fast", "", "CPU", 1.5, 2.0, NAN, True, False, None],
    "max_grad_norm": [0, 0.0, -1.0, NAN, INF, -INF, "1.0"],
    "nonfinite": ["ignore", "SKIP", "", None, 1, True],
    "loss_scale": [0, 0.0, -1.0, NAN, INF, -INF, "sometimes", "", True, False],
    "staging_slots": [0, -1, 1.5, 2.0, True, None],
    "amsgrad": [True],
    "maximize": [True],
}
def _cases():
    for kwarg, values in CURATED.items():
        for value in values:
            yield pytest.param(kwarg, value, id=f"{kwarg}={value!r}")


def _two_params():
    return [nn.Parameter(torch.randn(3, 2)), nn.Parameter(torch.randn(()).to(torch.bfloat16))]


@pytest.mark.parametrize("kwarg, value", list(_cases()))
def test_classic_bad_value_is_a_clear_error(kwarg, value):
    params = _two_params()
    before = [p.detach().clone() for p in params]
    _assert_refused(kwarg, value, lambda: DeepOptimizerStates(params, subgroup_size=4, **{kwarg: value}))
    assert all(torch.equal(a, p) for a, p in zip(before, params)), "a refused optimizer modified the params"
    if kwarg in GROUP_KEYS:
        _refused_in_groups(kwarg, value, 1)


@pytest.mark.parametrize("kwarg", list(BAD))
@settings(max_examples=40, **PROFILE)
@given(data=st.data())
def test_bad_constructor_argument_is_a_clear_error(kwarg, data):
    value = data.draw(BAD[kwarg], label=kwarg)
    params = _two_params()
    before = [p.detach().clone() for p in params]
    _assert_refused(kwarg, value, lambda: DeepOptimizerStates(params, subgroup_size=4, **{kwarg: value}))
    assert all(torch.equal(a, p) for a, p in zip(before, params)), "a refused optimizer modified the params"


def _refused_in_groups(kwarg, value, group):
    """Refused in a param-group dict at construction, and when set into param_groups between steps (by
    step(), before anything changes)."""
    p, q = nn.Parameter(torch.randn(5)), nn.Parameter(torch.randn(2, 2))
    _assert_refused(kwarg, value, lambda: DeepOptimizerStates([{"params": [p]}, {"params": [q], kwarg: value}],
                                                              subgroup_size=3))
    opt = DeepOptimizerStates([{"params": [p]}, {"params": [q]}], subgroup_size=3, schedule=2)
    p.grad, q.grad = torch.randn(5), torch.randn(2, 2)
    opt.step()
    snapshot = [(x.detach().clone(), {k: v.clone() for k, v in opt.state[x].items()}) for x in (p, q)]
    opt.param_groups[group][kwarg] = value
    _assert_refused(kwarg, value, opt.step)
    for x, (val, state) in zip((p, q), snapshot):
        assert torch.equal(x.detach(), val) and all(torch.equal(opt.state[x][k], v) for k, v in state.items())
    opt.close()


@pytest.mark.parametrize("kwarg", GROUP_KEYS)
@settings(max_examples=40, **PROFILE)
@given(data=st.data())
def test_bad_param_group_value_is_a_clear_error(kwarg, data):
    _refused_in_groups(kwarg, data.draw(BAD[kwarg], label=kwarg), data.draw(st.integers(0, 1), label="group"))


@settings(max_examples=40, **PROFILE)
@given(value=BAD["schedule"])
def test_bad_schedule_set_later_is_a_clear_error(value):
    opt = DeepOptimizerStates([nn.Parameter(torch.randn(7))], subgroup_size=2, schedule=3)
    before = opt.placements
    try:
        opt.schedule = value
    except (ValueError, TypeError) as e:
        assert "schedule" in str(e)
    except Exception as e:  # noqa: BLE001
        pytest.fail(f"schedule={value!r} raised {type(e).__name__}: {e}")
    else:
        pytest.fail(f"schedule={value!r} was accepted silently")
    assert opt.placements == before and opt.schedule == 3
    opt.close()


@settings(max_examples=40, **PROFILE)
@given(value=st.one_of(_floats(hi=0.0), st.sampled_from([NAN, INF, -INF])))
def test_bad_clip_grad_norm_argument_is_a_clear_error(value):
    p = nn.Parameter(torch.randn(4))
    opt = DeepOptimizerStates([p], subgroup_size=3)
    p.grad = torch.randn(4)
    _assert_refused("max_norm", value, lambda: opt.clip_grad_norm_(value))
    opt.close()

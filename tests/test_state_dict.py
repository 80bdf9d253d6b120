"""Checkpoints: save mid-run and continue bit-identically; torch AdamW checkpoints load; bad ones are refused."""

import copy
import io

import pytest
import torch

from deep_optimizer_states import DeepOptimizerStates
from tests.harness import loss_of, mlp, steps_beside, tiny_llama, train_and_compare


def _train(model, opt, gen, steps):
    for _ in range(steps):
        opt.zero_grad()
        loss_of(model, gen).backward()
        opt.step()


def _snapshot(opt):
    return [(k, v.clone()) for s in opt.state.values() for k, v in s.items()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("schedule", ["cpu", 3, "gpu"], ids=str)
def test_save_and_load_mid_run_continues_bit_identically(schedule, dtype):
    def make():
        model = tiny_llama(dtype)
        sched = {"lr": 1e-3, "subgroup_size": 6000, "schedule": schedule, "max_grad_norm": 1.0}
        return model, DeepOptimizerStates(model, **sched)

    model_a, opt_a = make()
    gen = torch.Generator().manual_seed(11)
    _train(model_a, opt_a, gen, 10)
    buf = io.BytesIO()
    torch.save({"model": model_a.state_dict(), "opt": opt_a.state_dict(), "rng": gen.get_state()}, buf)
    _train(model_a, opt_a, gen, 10)

    model_b, opt_b = make()  # a fresh process would start here
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    model_b.load_state_dict(ckpt["model"])
    opt_b.load_state_dict(ckpt["opt"])
    gen_b = torch.Generator()
    gen_b.set_state(ckpt["rng"])
    _train(model_b, opt_b, gen_b, 10)

    for pa, pb in zip(model_a.parameters(), model_b.parameters()):
        assert torch.equal(pa, pb)
    for (ka, va), (kb, vb) in zip(_snapshot(opt_a), _snapshot(opt_b)):
        assert ka == kb and torch.equal(va, vb), ka


def test_state_dict_has_torch_layout_with_masters():
    model = mlp(torch.bfloat16)
    opt = DeepOptimizerStates(model, lr=1e-3, subgroup_size=2000)
    _train(model, opt, torch.Generator().manual_seed(0), 3)
    sd = opt.state_dict()
    params = list(model.parameters())
    assert sd["param_groups"][0]["params"] == list(range(len(params)))
    for i, p in enumerate(params):
        entry = sd["state"][i]
        assert float(entry["step"]) == 3
        assert entry["exp_avg"].shape == p.shape and entry["exp_avg"].dtype == torch.float32
        assert entry["master_param"].dtype == torch.float32
        assert torch.equal(entry["master_param"].to(torch.bfloat16), p.detach())


def test_a_torch_adamw_checkpoint_loads_and_continues_identically():
    ref_model, model = mlp(), mlp()
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, fused=True)
    gen = torch.Generator().manual_seed(4)
    _train(ref_model, ref, gen, 5)
    model.load_state_dict(ref_model.state_dict())
    opt = DeepOptimizerStates(model, lr=1e-2, subgroup_size=2000, schedule=2)
    opt.load_state_dict(ref.state_dict())
    state = gen.get_state()
    _train(ref_model, ref, gen, 5)
    gen.set_state(state)
    _train(model, opt, gen, 5)
    for a, b in zip(ref_model.parameters(), model.parameters()):
        assert ((a - b).norm() / a.norm()).item() < 1e-6


def _bad(sd, how):
    sd = {"state": {k: dict(v) for k, v in sd["state"].items()}, "param_groups": [dict(g) for g in sd["param_groups"]],
          "dos": dict(sd["dos"])}
    how(sd)
    return sd


BAD_DICTS = {
    "other model shape": lambda sd: sd["state"][0].update(exp_avg=torch.zeros(3, 3)),
    "fewer params": lambda sd: sd["param_groups"][0].update(params=sd["param_groups"][0]["params"][:-1]),
    "more groups": lambda sd: sd["param_groups"].append(dict(sd["param_groups"][0])),
    "negative lr": lambda sd: sd["param_groups"][0].update(lr=-1.0),
    "not a state_dict": lambda sd: sd.pop("state"),
    "fractional step": lambda sd: sd["state"][1].update(step=torch.tensor(2.5)),
    "negative step": lambda sd: sd["state"][1].update(step=torch.tensor(-1.0)),
    "negative exp_avg_sq": lambda sd: sd["state"][3]["exp_avg_sq"].neg_().sub_(1.0),
    "nan exp_avg": lambda sd: sd["state"][0]["exp_avg"].view(-1).__setitem__(7, float("nan")),
    "inf master": lambda sd: sd["state"][2]["master_param"].view(-1).__setitem__(0, float("inf")),
    "moment not a tensor": lambda sd: sd["state"][2].update(exp_avg_sq=[0.0] * 4),
    "integer moment": lambda sd: sd["state"][0].update(exp_avg=torch.zeros(96, 32, dtype=torch.int32)),
    "step a string": lambda sd: sd["state"][1].update(step="5"),
    "step a bool": lambda sd: sd["state"][1].update(step=True),
    "step inf": lambda sd: sd["state"][1].update(step=float("inf")),
    "skipped steps None": lambda sd: sd["dos"].update(skipped_steps=None),
    "skipped steps negative": lambda sd: sd["dos"].update(skipped_steps=-5),
    "newer format": lambda sd: sd["dos"].update(version=99),
    "not an Adam state_dict (no betas)": lambda sd: [g.pop("betas") for g in sd["param_groups"]],
}


@pytest.mark.parametrize("case", BAD_DICTS)
def test_bad_state_dict_is_refused_and_nothing_changes(case):
    model = mlp()
    opt = DeepOptimizerStates(model, lr=1e-3, subgroup_size=2000)
    _train(model, opt, torch.Generator().manual_seed(0), 2)
    other = mlp(seed=5)
    other_opt = DeepOptimizerStates(other, lr=1e-3, subgroup_size=2000)
    _train(other, other_opt, torch.Generator().manual_seed(1), 3)
    bad = _bad(other_opt.state_dict(), BAD_DICTS[case])
    before, params, groups = _snapshot(opt), [p.clone() for p in model.parameters()], repr(opt.param_groups)
    with pytest.raises(ValueError):
        opt.load_state_dict(bad)
    assert all(torch.equal(a[1], b[1]) for a, b in zip(before, _snapshot(opt)))
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
    assert repr(opt.param_groups) == groups


def test_frameworks_moving_state_tensors_write_into_the_host_buffers():
    """Lightning and Accelerate move every state tensor after a load (``state[p][k] = v.to(device)``): the
    values land in our host buffers, the views stay ours, and later state_dicts are current, not stale."""
    model = tiny_llama()
    opt = DeepOptimizerStates(model, lr=1e-2, subgroup_size=3000, schedule=2)
    ref = train_and_compare(model, opt, steps=2)
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    views = {id(p): opt.layout.views(p) for p in opt.state}
    for p, entry in opt.state.items():  # what lightning.fabric's _optimizer_to_device does
        for key, value in list(entry.items()):
            if key != "step":
                entry[key] = value.clone()  # a device move (to the CPU here: a copy)
    for p in opt.state:
        for key in ("exp_avg", "exp_avg_sq", "master"):
            assert opt.state[p][key].data_ptr() == views[id(p)][key].data_ptr(), "still the host buffer"
    steps_beside(model, opt, ref, torch.Generator().manual_seed(7), 2)
    ref.assert_matches()
    sd = opt.state_dict()
    for i, p in enumerate(model.parameters()):
        assert int(sd["state"][i]["step"]) == 4
        torch.testing.assert_close(sd["state"][i]["master_param"], ref.masters[p].detach(), rtol=1e-6, atol=1e-7)
    p = next(model.parameters())
    with pytest.raises(ValueError, match="shape"):
        opt.state[p]["exp_avg"] = torch.zeros(3)
    opt.state[p]["step"] = torch.tensor(9.0)  # a step count written is the optimizer's
    assert opt.layout.where[id(p)][0].steps[0] == 9
    new = opt.state[p]["master"] + 1.0
    opt.state[p]["master"] = new  # a master written moves the param with it
    torch.testing.assert_close(p.detach(), new)


def test_opt_state_cannot_be_reset_behind_the_host_buffers():
    """torch's ways of dropping state (opt.state.clear(), del, a new dict, a new opt.state) would leave our
    host buffers training on, or a checkpoint without them: each says what to do instead."""
    from collections import defaultdict

    model = mlp()
    opt = DeepOptimizerStates(model, lr=1e-2, subgroup_size=2000, schedule=2)
    loss_of(model, torch.Generator().manual_seed(0)).backward()
    opt.step()
    p = next(model.parameters())
    resets = [lambda: opt.state.clear(), lambda: opt.state.__delitem__(p), lambda: opt.state.pop(p),
              lambda: opt.state.__setitem__(p, {}), lambda: opt.state[p].clear(),
              lambda: opt.state[p].pop("exp_avg"), lambda: setattr(opt, "state", defaultdict(dict))]
    for reset in resets:
        with pytest.raises(RuntimeError, match="cannot be removed or replaced through opt.state"):
            reset()
    with pytest.raises(TypeError, match="assign a tensor of its shape"):
        opt.state[p]["exp_avg"] = None
    assert len(opt.state_dict()["state"]) == len(list(model.parameters()))


@pytest.mark.parametrize("how", ["assign_int", "zero_in_place"])
def test_a_step_count_set_through_opt_state_is_the_one_used(how):
    """opt.state[p]["step"] = 0 (a plain number, as torch allows) or an in-place zero_(): the next update's
    bias correction and the checkpoint both use the new count, as torch's AdamW does."""
    model, twin = mlp(), mlp()
    opt = DeepOptimizerStates(model, lr=1e-2, subgroup_size=2000, schedule="cpu")
    ref = torch.optim.AdamW(twin.parameters(), lr=1e-2, fused=True)
    for m, o in ((model, opt), (twin, ref)):
        for k in range(3):
            o.zero_grad()
            loss_of(m, torch.Generator().manual_seed(k)).backward()
            o.step()
        for q in m.parameters():
            if how == "assign_int" and o is opt:
                o.state[q]["step"] = 0
            else:
                o.state[q]["step"].zero_()
        o.zero_grad()
        loss_of(m, torch.Generator().manual_seed(9)).backward()
        o.step()
    for q in model.parameters():
        assert int(opt.state[q]["step"]) == 1 and int(opt.state_dict()["state"][0]["step"]) == 1
    for a, b in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_params_moved_between_groups_after_construction_are_refused():
    model = mlp()
    params = list(model.parameters())
    opt = DeepOptimizerStates([{"params": params[:3]}, {"params": params[3:], "weight_decay": 0.0}], lr=1e-2)
    opt.param_groups[0]["lr"] = 5e-3  # hyper-parameters may change
    loss_of(model, torch.Generator().manual_seed(0)).backward()
    opt.step()
    opt.param_groups[1]["params"].append(opt.param_groups[0]["params"].pop())
    loss_of(model, torch.Generator().manual_seed(1)).backward()
    with pytest.raises(RuntimeError, match=r"params of param_groups\[0\] changed after DeepOptimizerStates was built"):
        opt.step()


def test_a_malformed_loss_scaler_is_refused_before_anything_is_loaded():
    model = mlp(torch.float16)
    opt = DeepOptimizerStates(model, lr=1e-3, subgroup_size=2000, schedule="cpu")
    opt.scale_loss(loss_of(model, torch.Generator().manual_seed(0))).backward()
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    before = copy.deepcopy(opt.state_dict())
    sd["state"][0]["exp_avg"].fill_(1.0)
    sd["dos"]["loss_scaler"] = {"scale": float("nan"), "clean_steps": 0}
    with pytest.raises(ValueError, match="not a loss scaler's state"):
        opt.load_state_dict(sd)
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], before["state"][0]["exp_avg"])


@pytest.mark.parametrize("bad", [{"skipped_steps": None}, {"clean_steps": 2.5}, {"skipped_steps": "x"}],
                         ids=["skipped_none", "clean_fractional", "skipped_string"])
def test_a_loss_scaler_with_bad_counts_is_refused_before_anything_is_loaded(bad):
    model = mlp(torch.float16)
    opt = DeepOptimizerStates(model, lr=1e-3, subgroup_size=2000, schedule="cpu")
    opt.scale_loss(loss_of(model, torch.Generator().manual_seed(0))).backward()
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    before, scaler = copy.deepcopy(opt.state_dict()), opt.scaler.state_dict()
    sd["state"][0]["exp_avg"].fill_(1.0)
    sd["dos"]["loss_scaler"].update(scale=opt.scaler.scale * 4, **bad)
    with pytest.raises(ValueError, match="loss_scaler"):
        opt.load_state_dict(sd)
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], before["state"][0]["exp_avg"])
    assert opt.scaler.state_dict() == scaler


def test_torch_sgd_state_dict_is_refused_and_an_empty_torch_entry_is_no_state():
    """An SGD state_dict would load as "no state" for every param (moments from zero, SGD's lr): refused.
    torch's AdamW writes {} for a param whose state was read before it had a gradient; that loads, as no
    state, as torch loads it."""
    model = mlp()
    opt = DeepOptimizerStates(model, lr=1e-3, subgroup_size=2000, schedule="cpu")
    _train(model, opt, torch.Generator().manual_seed(0), 2)
    sgd = torch.optim.SGD(mlp().parameters(), lr=0.5)
    with pytest.raises(ValueError, match="not an Adam or AdamW state_dict"):
        opt.load_state_dict(sgd.state_dict())

    twin = copy.deepcopy(model)
    torch_opt = torch.optim.AdamW(twin.parameters(), lr=1e-3)
    last = list(twin.parameters())[-1]
    _ = torch_opt.state[last]  # reading it makes the (empty) entry
    gen = torch.Generator().manual_seed(3)
    torch_opt.zero_grad()
    loss_of(twin, gen).backward()
    last.grad = None  # this param gets no step
    torch_opt.step()
    sd = torch_opt.state_dict()
    assert sd["state"][len(sd["param_groups"][0]["params"]) - 1] == {}
    fresh = DeepOptimizerStates(copy.deepcopy(twin), lr=1e-3, subgroup_size=2000, schedule="cpu")
    fresh.load_state_dict(sd)
    assert not fresh.state[list(fresh.param_groups[0]["params"])[-1]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_loading_the_optimizer_leaves_the_models_weights_as_torch_does(dtype):
    """torch's load_state_dict never writes the params: weights loaded into the model (another checkpoint's,
    a new init) are the ones training goes on from, with the loaded moments. The same checkpoint's weights,
    loaded before or after the optimizer, keep the fp32 masters (their low bits, for bf16)."""
    model = mlp(dtype)
    opt = DeepOptimizerStates(model, lr=1e-2, subgroup_size=2000, schedule="cpu")
    _train(model, opt, torch.Generator().manual_seed(0), 3)
    sd, weights = copy.deepcopy(opt.state_dict()), copy.deepcopy(model.state_dict())
    masters = [opt.master(p).clone() for p in model.parameters()]

    other = mlp(dtype, seed=123).state_dict()
    model.load_state_dict(other)
    opt.load_state_dict(sd)
    assert all(torch.equal(p, other[n]) for n, p in model.named_parameters())
    for group in opt.param_groups:  # a step that moves nothing: the masters it starts from show
        group["lr"] = 0.0
    _train(model, opt, torch.Generator().manual_seed(1), 1)
    assert all(torch.equal(opt.master(p), other[n].float()) for n, p in model.named_parameters())

    for order in ("model_first", "optimizer_first"):
        fresh = mlp(dtype, seed=7)
        fresh_opt = DeepOptimizerStates(fresh, lr=1e-2, subgroup_size=2000, schedule="cpu")
        if order == "model_first":
            fresh.load_state_dict(weights)
        fresh_opt.load_state_dict(copy.deepcopy(sd))
        if order == "optimizer_first":
            assert not torch.equal(next(fresh.parameters()), weights["0.weight"]), "the params were not written"
            fresh_opt.master(next(fresh.parameters()))  # reads before the weights come settle nothing
            fresh_opt.state_dict()
            fresh.load_state_dict(weights)
        assert all(torch.equal(fresh_opt.master(p), m) for p, m in zip(fresh.parameters(), masters)), order


def test_counts_saved_as_numpy_scalars_load_as_torch_loads_them():
    np = pytest.importorskip("numpy")
    model = mlp()
    opt = DeepOptimizerStates(model, lr=1e-3, subgroup_size=2000)
    _train(model, opt, torch.Generator().manual_seed(0), 2)
    sd = copy.deepcopy(opt.state_dict())
    for entry in sd["state"].values():
        entry["step"] = np.int64(2)
    sd["dos"]["skipped_steps"] = np.int64(0)
    fresh = DeepOptimizerStates(copy.deepcopy(model), lr=1e-3, subgroup_size=2000)
    fresh.load_state_dict(sd)
    assert all(int(s["step"]) == 2 for s in fresh.state.values())


def test_a_torch_checkpoint_loaded_after_ours_leaves_no_mark_that_hides_a_weight_edit():
    """Our state_dict's masters wait for the next step's recheck (the model's weights may be loaded after);
    a torch checkpoint loaded next takes the masters from the params, which supersedes that mark: a weight
    edit after it is the master at once (``master()``, ``state_dict()``), as without the first load."""
    from torch import nn

    for ours_first in (False, True):
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        twin = copy.deepcopy(model)
        opt = DeepOptimizerStates(model, lr=1e-2, schedule="cpu")
        torch_opt = torch.optim.AdamW(twin.parameters(), lr=1e-2)
        for m, o in ((model, opt), (twin, torch_opt)):
            m(torch.ones(3, 4)).sum().backward()
            o.step()
        if ours_first:
            opt.load_state_dict(copy.deepcopy(opt.state_dict()))
        opt.load_state_dict(copy.deepcopy(torch_opt.state_dict()))
        edited = torch.full((2, 4), 0.5)
        model.load_state_dict({"weight": edited, "bias": torch.zeros(2)})
        assert torch.equal(opt.master(model.weight), edited), ours_first
        assert torch.equal(opt.state_dict()["state"][0]["master_param"], edited), ours_first

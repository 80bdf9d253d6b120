"""Bad input gets a clear error that says what to change, before anything is allocated or modified."""

import pytest
import torch
from torch import nn

from deep_optimizer_states import DeepOptimizerStates
from deep_optimizer_states.core.schedule import Placement, placements
from tests.harness import loss_of, mlp


@pytest.mark.parametrize("kwargs, match", [
    ({"subgroup_size": 0}, "subgroup_size must be an int > 0"),
    ({"subgroup_size": -5}, "subgroup_size must be an int > 0"),
    ({"subgroup_size": 1.5}, "subgroup_size must be an int > 0"),
    ({"schedule": 0}, "k must be >= 1"),
    ({"schedule": -2}, "k must be >= 1"),
    ({"schedule": "fast"}, "schedule must be"),
    ({"schedule": 2.0}, "schedule must be"),
    ({"lr": -1e-3}, "lr must be a finite float >= 0"),
    ({"lr": float("nan")}, "lr must be a finite float >= 0"),
    ({"eps": -1e-8}, "eps must be"),
    ({"weight_decay": -0.1}, "weight_decay must be"),
    ({"betas": (1.0, 0.999)}, r"betas must be two floats in \[0, 1\)"),
    ({"betas": (0.9, -0.1)}, r"betas must be two floats in \[0, 1\)"),
    ({"betas": (0.9,)}, r"betas must be two floats in \[0, 1\)"),
    ({"max_grad_norm": 0.0}, "max_grad_norm must be"),
    ({"staging_slots": 0}, "staging_slots must be"),
    ({"loss_scale": "sometimes"}, "loss_scale must be"),
    ({"device": "meta"}, "device='meta' but the params are on cpu"),
])
def test_bad_config_values(kwargs, match):
    model = mlp()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=match):
        DeepOptimizerStates(model, **kwargs)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_params_on_mixed_devices():
    a = nn.Parameter(torch.zeros(4))
    b = nn.Parameter(torch.zeros(4, device="meta"))
    with pytest.raises(ValueError, match="several devices"):
        DeepOptimizerStates([a, b])


@pytest.mark.parametrize("dtype", [torch.int64, torch.int8, torch.float64, torch.complex64])
def test_unsupported_param_dtypes(dtype):
    bad = torch.zeros(4, dtype=dtype, requires_grad=dtype.is_floating_point or dtype.is_complex)
    with pytest.raises(TypeError, match="supports float32, bfloat16 and float16"):
        DeepOptimizerStates([nn.Parameter(torch.zeros(4)), bad])


def test_a_frozen_quantised_param_of_the_model_is_left_out():
    """Given the model, a frozen int8 weight (a quantised base under a LoRA) is not the optimizer's: left out,
    where the same tensor given explicitly as a param is refused (above)."""
    model = mlp()
    model[0].weight.requires_grad_(False)
    model[0].register_parameter("qweight", nn.Parameter(torch.zeros(4, dtype=torch.int8), requires_grad=False))
    opt = DeepOptimizerStates(model, lr=1e-2, schedule="cpu")
    assert all(p.is_floating_point() for g in opt.param_groups for p in g["params"])
    loss_of(model, torch.Generator().manual_seed(0)).backward()
    opt.step()


def test_unsupported_dtype_is_named_with_the_module_form():
    model = mlp()
    model[0].bias = nn.Parameter(torch.zeros(96, dtype=torch.float64))
    with pytest.raises(TypeError, match="param 0.bias has dtype torch.float64"):
        DeepOptimizerStates(model)


def test_empty_or_all_frozen():
    with pytest.raises(ValueError):
        DeepOptimizerStates([])
    with pytest.raises(ValueError, match="no trainable params"):
        DeepOptimizerStates([nn.Parameter(torch.zeros(3), requires_grad=False)])


def test_not_enough_host_memory_says_how_much(monkeypatch):
    monkeypatch.setenv("DOS_HOST_MEMORY_GB", "0.0001")
    model = mlp()
    with pytest.raises(MemoryError, match=r"0\.00 GB needed, 0\.00 GB available|GB needed, .* GB available"):
        DeepOptimizerStates(nn.Linear(4000, 4000))
    with pytest.raises(ValueError, match="DOS_HOST_MEMORY_GB"):
        monkeypatch.setenv("DOS_HOST_MEMORY_GB", "lots")
        DeepOptimizerStates(model)


def test_host_memory_check_uses_the_real_need(monkeypatch):
    layer = nn.Linear(1000, 1000)  # 1,001,000 params -> 16 bytes each on the host, about 16 MB
    monkeypatch.setenv("DOS_HOST_MEMORY_GB", "0.015")
    with pytest.raises(MemoryError, match="0.02 GB needed, 0.01 GB available"):
        DeepOptimizerStates(layer)
    monkeypatch.setenv("DOS_HOST_MEMORY_GB", "0.02")
    DeepOptimizerStates(layer)


def test_bad_hyper_parameter_set_between_steps_is_refused_before_any_update():
    model = mlp()
    opt = DeepOptimizerStates(model, lr=1e-3, subgroup_size=2000)
    loss_of(model, torch.Generator().manual_seed(0)).backward()
    opt.param_groups[0]["lr"] = -0.5
    masters = [s["master"].clone() for s in opt.state.values()]
    with pytest.raises(ValueError, match="lr must be"):
        opt.step()
    assert all(torch.equal(a, s["master"]) for a, s in zip(masters, opt.state.values()))
    opt.param_groups[0]["lr"] = 1e-3
    opt.step()


def test_add_param_group_after_construction():
    opt = DeepOptimizerStates(mlp())
    with pytest.raises(RuntimeError, match="add_param_group after construction"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(3))]})


def test_params_in_two_groups():
    p = nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="more than one parameter group"):
        DeepOptimizerStates([{"params": [p]}, {"params": [p]}])


def test_clip_grad_norm_rejects_bad_max_norm():
    opt = DeepOptimizerStates(mlp())
    for bad in (0.0, -1.0, float("inf")):
        with pytest.raises(ValueError, match="max_norm must be"):
            opt.clip_grad_norm_(bad)


def test_placements_for_each_schedule():
    S, C = Placement.STAGED, Placement.CPU
    assert placements("cpu", 4) == [C] * 4
    assert placements("gpu", 4) == [S] * 4
    assert placements(1, 3) == [S] * 3
    assert placements(3, 7) == [S, C, C, S, C, C, S]
    auto = placements("auto", 16)
    assert auto.count(S) == 8 and auto[0] is S and auto == placements(2, 16)


@pytest.mark.parametrize("kwargs,message", [({"schedule": "GPU"}, "schedule"),
                                            ({"schedule": ["cpu", "staged"]}, "2 placements for 3 subgroups"),
                                            ({"gpu_memory_budget": 2.0}, "gpu_memory_budget")])
def test_a_bad_schedule_or_budget_is_refused_before_host_memory_is_pinned(kwargs, message, monkeypatch):
    from deep_optimizer_states.core import layout

    def no_pinning(*args, **kw):
        raise AssertionError("host buffers were allocated before the bad value was refused")

    model = mlp()
    with monkeypatch.context() as patch:
        patch.setattr(layout, "host_empty_many", no_pinning)
        with pytest.raises(ValueError, match=message):
            DeepOptimizerStates(model, subgroup_size=5000, **kwargs)
    count = len(DeepOptimizerStates(model, subgroup_size=5000).layout.subgroups)
    assert count == 3, "the count checked before pinning is the layout's"
    DeepOptimizerStates(model, subgroup_size=5000, schedule=["cpu", "staged", "cpu"])


@pytest.mark.parametrize("kwargs,message", [
    ({"stream_grads": "yes"}, "stream_grads must be True or False"),
    ({"overlap": 1}, "overlap must be True or False"),
    ({"prefetch": True}, "prefetch=True needs stream_grads=True"),
    ({"speculate": -1, "stream_grads": True}, "speculate must be True, False or an int >= 0"),
    ({"speculate": True}, "speculate needs stream_grads=True"),
    ({"bf16_cpu_path": "on"}, "bf16_cpu_path must be True or False"),
    ({"nonfinite": "ignore"}, "nonfinite must be one of"),
    ({"max_grad_norm": float("inf")}, "max_grad_norm must be a finite float"),
    ({"staging_slots": True}, "staging_slots must be an int >= 1"),
    ({"overlap": True, "as_params": True}, "overlap=True needs the model"),
])
def test_every_option_is_refused_before_host_memory_is_pinned(kwargs, message, monkeypatch):
    from deep_optimizer_states.core import layout

    def no_pinning(*args, **kw):
        raise AssertionError("host buffers were allocated before the bad value was refused")

    model = mlp()
    kwargs = dict(kwargs)
    params = model.parameters() if kwargs.pop("as_params", False) else model
    with monkeypatch.context() as patch:
        patch.setattr(layout, "host_empty_many", no_pinning)
        with pytest.raises(ValueError, match=message):
            DeepOptimizerStates(params, **kwargs)


def test_params_sharing_memory_are_refused_and_disjoint_views_are_not():
    buffer = torch.zeros(10)
    overlapping = [nn.Parameter(buffer), nn.Parameter(buffer[2:].view(2, 4))]
    with pytest.raises(ValueError, match="share memory"):
        DeepOptimizerStates(overlapping)
    DeepOptimizerStates([nn.Parameter(buffer[:5]), nn.Parameter(buffer[5:])])


def test_a_param_reshaped_after_construction_is_refused():
    """Same numel, other shape: the moments would meet other elements (torch's AdamW fails on the sizes)."""
    model = nn.Linear(4, 3)
    opt = DeepOptimizerStates(model, schedule="cpu")
    with torch.no_grad():
        model.weight.data = model.weight.data.t().contiguous()
    model.weight.grad = torch.ones_like(model.weight)
    with pytest.raises(RuntimeError, match="shape changed"):
        opt.step()


@pytest.mark.parametrize("threads", [0, -2, 1.5, True, "4"])
def test_bad_cpu_path_thread_counts_are_refused(threads):
    from deep_optimizer_states.core.engine import Engine

    with pytest.raises(ValueError, match="threads must be an int >= 1"):
        Engine(torch.device("cpu")).set_cpu_threads(threads)


def test_cpu_path_threads_without_a_gpu_are_the_callers():
    from deep_optimizer_states.core.engine import Engine

    engine, before = Engine(torch.device("cpu")), torch.get_num_threads()
    try:
        engine.set_cpu_threads(1)
        assert engine.cpu_threads() == 1 == torch.get_num_threads()
    finally:
        torch.set_num_threads(before)

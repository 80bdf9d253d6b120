"""``bf16_cpu_path``: bf16 gradients down, bf16 params up, the bf16 kernel between; bit for bit the fp32 path."""

import pytest
import torch

from deep_optimizer_states import DeepOptimizerStates
from deep_optimizer_states.core import cpu_adamw
from tests.harness import mlp, needs_compiler, tiny_llama, train_and_compare, without_stand_down

pytestmark = needs_compiler


SHAPES = [(1000,), (37, 13), (517,), (64, 64), (5,), (300, 7)]  # no multiple of the kernel's unit: cut anywhere


def _bf16_params(seed: int, shapes: list[tuple[int, ...]]) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter((torch.randn(s, generator=gen) * 0.1).bfloat16()) for s in shapes]


def _assert_equal_to_the_fp32_path(shapes: list[tuple[int, ...]], subgroup_size: int, adamw: bool = True,
                                   clip: float | None = None) -> None:
    """Same params, same gradients (some params without one at some steps, so spans and step counts differ
    between neighbours): masters, moments and the bf16 params equal the default path's after each step."""
    assert cpu_adamw.load() is not None
    params = {lean: _bf16_params(0, shapes) for lean in (False, True)}
    opts = {lean: DeepOptimizerStates(params[lean], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, adamw=adamw,
                                      subgroup_size=subgroup_size, schedule="cpu", max_grad_norm=clip,
                                      bf16_cpu_path=lean) for lean in (False, True)}
    gen = torch.Generator().manual_seed(1)
    for step in range(6):
        for k, p in enumerate(params[False]):
            grad = None if (k + step) % 4 == 0 else (torch.randn(p.shape, generator=gen) * 0.1).bfloat16()
            for lean in (False, True):
                params[lean][k].grad = None if grad is None else grad.clone()
        for opt in opts.values():
            opt.step()
        for p, q in zip(params[False], params[True]):
            assert torch.equal(p, q), f"step {step}: param of shape {tuple(p.shape)}"
            assert torch.equal(opts[False].master(p), opts[True].master(q))
            if "exp_avg" in opts[False].state[p]:
                for key in ("exp_avg", "exp_avg_sq"):
                    assert torch.equal(opts[False].state[p][key], opts[True].state[q][key])
    # the same subgroups moved half the bytes: bf16 up and down, the kernel's path was taken
    assert 2 * opts[True].last_update.h2d_bytes == opts[False].last_update.h2d_bytes > 0


@pytest.mark.parametrize("clip", [None, 0.05])
@pytest.mark.parametrize("subgroup_size", [37, 1000, 4000])
@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "adam"])
def test_equals_the_fp32_cpu_path_bit_for_bit(adamw, subgroup_size, clip):
    _assert_equal_to_the_fp32_path(SHAPES, subgroup_size, adamw, clip)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_param_the_kernels_threads_share_equals_the_fp32_cpu_path(threads):
    """A param of several of the kernel's chunks, in one subgroup with small ones: its threads take the
    chunks as each comes free, and every bit is still the fp32 path's."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _assert_equal_to_the_fp32_path([(37, 13), (3 * cpu_adamw.CHUNK // 256 + 9, 256), (1000,)], 200_000,
                                       clip=0.05)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("kind", ["mlp", "llama"])
def test_matches_torch_adamw_on_fp32_masters(kind):
    model = {"mlp": mlp, "llama": tiny_llama}[kind](torch.bfloat16)
    size = sum(p.numel() for p in model.parameters()) // 10
    opt = DeepOptimizerStates(model, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1, subgroup_size=size,
                              schedule="cpu", max_grad_norm=1.0, bf16_cpu_path=True)
    train_and_compare(model, opt, steps=12)
    assert opt.last_update.h2d_bytes == 2 * sum(p.numel() for p in model.parameters())


def test_fp32_params_keep_torchs_kernel():
    """The bf16 path is for bf16 params: fp32 ones take the fp32 path (4 bytes each way), still exact."""
    model = mlp(torch.float32)
    opt = DeepOptimizerStates(model, lr=3e-3, subgroup_size=2500, schedule="cpu", bf16_cpu_path=True)
    train_and_compare(model, opt, steps=5)
    assert opt.last_update.h2d_bytes == 4 * sum(p.numel() for p in model.parameters())


def test_a_bad_setting_is_refused():
    with pytest.raises(ValueError, match="bf16_cpu_path must be True or False"):
        DeepOptimizerStates(mlp(torch.bfloat16), bf16_cpu_path=1)


@pytest.mark.parametrize("clip", [None, 0.05])
@pytest.mark.parametrize("mode", ["stream", "stream+overlap", "stream+speculate"])
def test_streamed_gradients_land_in_bf16_and_give_the_fp32_paths_results(mode, clip, monkeypatch):
    """With stream_grads the CPU path's gradients go down in bf16 during backward (their norms taken on the
    GPU as before), the clip factor is applied in the kernel instead of a pass over fp32 gradients, and an
    update run ahead (speculate) takes the kernel too: every step equals the default path's, bit for bit."""
    kwargs = {"stream_grads": True, "overlap": "overlap" in mode, "speculate": "speculate" in mode}
    without_stand_down(monkeypatch)  # clipped: the kernel's updates ahead run, then are undone
    models = {lean: tiny_llama(torch.bfloat16, seed=5) for lean in (False, True)}
    size = sum(p.numel() for p in models[False].parameters()) // 10
    opts = {lean: DeepOptimizerStates(models[lean], lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1, subgroup_size=size,
                                      schedule="cpu", max_grad_norm=clip, bf16_cpu_path=lean, **kwargs)
            for lean in (False, True)}
    gen = torch.Generator().manual_seed(2)
    for step in range(6):
        ids = torch.randint(0, 128, (2, 16), generator=gen)
        for lean in (False, True):
            opts[lean].zero_grad()
            models[lean](input_ids=ids, labels=ids).loss.backward()
            opts[lean].step()
            opts[lean].synchronize()
        for (name, p), q in zip(models[False].named_parameters(), models[True].parameters()):
            assert torch.equal(p, q), f"step {step}: {name}"
            assert torch.equal(opts[False].master(p), opts[True].master(q)), f"step {step}: {name}"
    assert 2 * opts[True].last_update.h2d_bytes == opts[False].last_update.h2d_bytes > 0
    if "speculate" in mode and clip is None:
        assert opts[True].speculation.kept > 0  # the kernel ran ahead, and was kept
    if "speculate" in mode and clip is not None:
        assert opts[True].speculation.undone > 0  # ... and was undone from what it kept aside in its pass


def test_updates_run_ahead_in_several_spans_are_kept_or_undone_bit_for_bit(monkeypatch):
    """The kernel keeps aside the spans it updates, one call each; a param that missed a step has another
    step count, so its span is a call of its own. Steps whose loss is scaled up clip, and their update run
    ahead is undone: the whole subgroup must come back as it was; the others are kept."""
    def make():
        torch.manual_seed(3)
        return torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.Linear(40, 40), torch.nn.Linear(40, 8)).bfloat16()

    without_stand_down(monkeypatch)  # the steps that clip undo what the kernel kept aside
    models = [make(), make()]
    opts = [DeepOptimizerStates(m, lr=1e-2, weight_decay=0.1, schedule="cpu", subgroup_size=10_000,
                                max_grad_norm=1.0, bf16_cpu_path=True, stream_grads=True, speculate=spec)
            for m, spec in zip(models, (True, False))]
    assert len(opts[0].layout.subgroups) == 1
    gen = torch.Generator().manual_seed(4)
    for step, scale in enumerate([1e-3, 1e-3, 1e3, 1e-3, 1e-3, 1e3]):
        x = torch.randn(16, 24, generator=gen).bfloat16()
        for m, o in zip(models, opts):
            o.zero_grad()
            h = torch.relu(m[0](x))
            (m[2](m[1](h) if step else h).float().pow(2).mean() * scale).backward()  # m[1] misses step 0
            o.step()
        for p, q in zip(*(m.parameters() for m in models)):
            assert torch.equal(opts[0].master(p), opts[1].master(q)), f"step {step}"
            for key in ("exp_avg", "exp_avg_sq", "step"):
                a, b = opts[0].state[p].get(key), opts[1].state[q].get(key)
                assert (a is None and b is None) or torch.equal(a, b), f"step {step}: {key}"
    assert opts[0].speculation.kept == opts[0].speculation.undone == 2

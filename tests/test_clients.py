"""Real clients of the optimizer on the CPU: safetensors, Accelerate, the transformers Trainer, and the ways
users poke at a model and an optimizer (load_state_dict, dtype casts, replaced params, deepcopy, hooks, NaNs,
torch checkpoints). Every check compares against torch's own AdamW / Adam or the state before the action."""

from __future__ import annotations

import copy
import dataclasses
import gc
import inspect
import math
import os
import pickle
import threading
import warnings
import weakref

import pytest
import torch
from torch import nn

from deep_optimizer_states import DeepOptimizerStates
from tests.harness import TokenData, assert_same_params, loss_of, mlp, params_of, skip_unless_trainer_resumes
from tests.harness import tiny_llama as _tiny_llama

LR = 1e-3


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models: one intra-op thread is faster than two fighting over a busy CI machine. Afterwards the
    Accelerate singletons this module configured are reset for the modules that follow."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
    try:
        from accelerate.state import AcceleratorState, GradientState
    except ImportError:
        return
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def tiny_llama(*args, **kwargs) -> nn.Module:
    pytest.importorskip("transformers")
    return _tiny_llama(*args, **kwargs)


# ---- helpers ------------------------------------------------------------------------------------------------
def batches(count: int, seed: int = 1, batch: int = 2, seq: int = 16) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (batch, seq), generator=gen) for _ in range(count)]


def lm_step(model: nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor, max_norm: float | None = None):
    opt.zero_grad()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    if max_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    opt.step()
    return loss.detach()


def snapshot_state(opt: DeepOptimizerStates) -> dict:
    """A deep copy of everything the optimizer keeps per param (moments, masters, step counts)."""
    return {id(p): {k: v.detach().clone() for k, v in s.items()} for p, s in opt.state.items()}


def assert_state_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].keys() == b[k].keys()
        for key in a[k]:
            assert torch.equal(a[k][key], b[k][key]), f"state {key} changed"


# ---- 1. safetensors -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tie", [False, True])
def test_safetensors_save_model_load_model_round_trip(tie, tmp_path):
    st = pytest.importorskip("safetensors.torch")
    from safetensors import safe_open

    model = tiny_llama(tie=tie)
    opt = DeepOptimizerStates(model, lr=LR, schedule=2)
    for ids in batches(3):
        lm_step(model, opt, ids)
    path = str(tmp_path / "model.safetensors")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        st.save_model(model, path)  # raises on shared tensors it cannot dedup
    assert not [w for w in caught if "share" in str(w.message).lower()], [str(w.message) for w in caught]
    with safe_open(path, "pt") as f:
        keys = set(f.keys())
    # the same keys a model without an optimizer saves: every param its own tensor (tied ones once)
    plain = str(tmp_path / "plain.safetensors")
    st.save_model(tiny_llama(tie=tie), plain)
    with safe_open(plain, "pt") as f:
        assert keys == set(f.keys())
    assert len(keys) == len(list(model.parameters()))
    saved = params_of(model)
    fresh = tiny_llama(tie=tie, seed=9)
    missing, unexpected = st.load_model(fresh, path)
    assert not unexpected
    assert set(missing) <= ({"lm_head.weight", "model.embed_tokens.weight"} - keys if tie else set())
    assert_same_params(params_of(fresh), saved)
    # the optimizer keeps training after the save (nothing it relies on was touched)
    lm_step(model, opt, batches(1, seed=7)[0])
    assert not torch.equal(model.model.embed_tokens.weight, saved["model.embed_tokens.weight"])


# ---- 2. Accelerate --------------------------------------------------------------------------------------------
def _accelerator():
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    return accelerate.Accelerator(cpu=True)


def _acc_steps(acc, model, opt, ids_list):
    for ids in ids_list:
        loss = model(input_ids=ids, labels=ids).loss
        acc.backward(loss)
        opt.step()
        opt.zero_grad()


def test_accelerate_prepare_train_save_load_state_and_save_model(tmp_path):
    pytest.importorskip("accelerate")
    pytest.importorskip("safetensors")
    from safetensors import safe_open

    data = batches(6, seed=3)
    # torch's fused AdamW on fp32, through Accelerate
    acc_t = _accelerator()
    model_t = tiny_llama()
    model_t, opt_t = acc_t.prepare(model_t, torch.optim.AdamW(model_t.parameters(), lr=LR, fused=True))
    _acc_steps(acc_t, model_t, opt_t, data)

    acc = _accelerator()
    model = tiny_llama()
    model, opt = acc.prepare(model, DeepOptimizerStates(model, lr=LR, schedule="cpu"))
    _acc_steps(acc, model, opt, data[:3])
    acc.save_state(str(tmp_path / "state"))
    _acc_steps(acc, model, opt, data[3:])
    uninterrupted = params_of(model)
    assert_same_params(uninterrupted, params_of(model_t), exact=False, rtol=1e-6)

    # resume from save_state into a fresh model (other init) and a fresh optimizer, prepared the same way
    acc2 = _accelerator()
    model2 = tiny_llama(seed=5)
    model2, opt2 = acc2.prepare(model2, DeepOptimizerStates(model2, lr=LR, schedule="cpu"))
    acc2.load_state(str(tmp_path / "state"))
    _acc_steps(acc2, model2, opt2, data[3:])
    assert_same_params(params_of(model2), uninterrupted, exact=True)
    for (p, s), (p2, s2) in zip(opt.optimizer.state.items(), opt2.optimizer.state.items()):
        for key in ("step", "exp_avg", "exp_avg_sq", "master"):
            assert torch.equal(s[key], s2[key]), key

    # save_model: one tensor per param (no shared storage dropped or refused)
    acc2.save_model(model2, str(tmp_path / "export"))
    saved = {k: v.detach() for k, v in acc2.unwrap_model(model2).state_dict().items()}
    files = [f for f in os.listdir(tmp_path / "export") if f.endswith(".safetensors")]
    assert files, os.listdir(tmp_path / "export")
    keys = set()
    for f in files:
        with safe_open(str(tmp_path / "export" / f), "pt") as fh:
            keys |= set(fh.keys())
            for k in fh.keys():
                assert torch.equal(fh.get_tensor(k), saved[k]), k
    assert len(keys) == len(list(model2.parameters())) == len(model2.state_dict())



def test_accelerate_prepare_moves_no_optimizer_state(monkeypatch):
    """Accelerate's prepare round-trips the optimizer's state_dict through its device. A fresh optimizer has
    no per-param state yet (as torch's), so nothing offloaded is copied there; a Trainer loads its
    checkpoint's optimizer state after prepare, into the host buffers."""
    accelerate = pytest.importorskip("accelerate")
    import accelerate.optimizer as acc_opt

    moved = []
    real = acc_opt.move_to_device

    def counting(state, device):
        if isinstance(state, torch.Tensor):
            moved.append(tuple(state.shape))
        return real(state, device)

    monkeypatch.setattr(acc_opt, "move_to_device", counting)
    model = tiny_llama()
    opt = DeepOptimizerStates(model, lr=1e-3, schedule="cpu")
    acc = _accelerator()
    model, prepared = acc.prepare(model, opt)
    assert isinstance(prepared, accelerate.optimizer.AcceleratedOptimizer)
    assert [s for s in moved if s] == [], "no state tensor of the optimizer goes through the device"
    assert opt.master(next(iter(opt.param_groups[0]["params"]))).device.type == "cpu"

# ---- 3. transformers Trainer ----------------------------------------------------------------------------------
def _train(out_dir, make_opt, max_steps=6, resume=None, model_seed=0, **extra):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    fields = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    if "save_safetensors" in fields:  # transformers >= 5 always saves safetensors and dropped the argument
        extra["save_safetensors"] = True
    args = transformers.TrainingArguments(
        output_dir=str(out_dir), per_device_train_batch_size=2, gradient_accumulation_steps=2, max_grad_norm=0.5,
        max_steps=max_steps, save_steps=3, logging_steps=1, report_to=[], use_cpu=True, seed=42,
        lr_scheduler_type="linear", learning_rate=LR, disable_tqdm=True, **extra)
    model = tiny_llama(seed=model_seed)
    initial = params_of(model)
    opt = make_opt(model)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=TokenData(), optimizers=(opt, None))
    trainer.train(resume_from_checkpoint=resume)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return params_of(model), losses, initial, opt


def _ours(model):
    return DeepOptimizerStates(model, lr=LR, schedule=2)


def _torch(model):
    return torch.optim.AdamW(model.parameters(), lr=LR, fused=True)


@pytest.fixture(scope="module")
def trainer_runs(tmp_path_factory):
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("trainer")
    ours = _train(root / "ours", _ours)
    ref = _train(root / "torch", _torch, save_only_model=True)  # its checkpoint-3 serves the save_only_model test
    return root, ours, ref


def test_trainer_trains_and_equals_torch_adamw(trainer_runs):
    _, (final, losses, initial, opt), (ref_final, ref_losses, _, _) = trainer_runs
    assert len(losses) == 6 and all(map(lambda x: x == x and abs(x) != float("inf"), losses))
    assert losses[-1] != losses[0]
    assert opt.state[next(iter(opt.state))]["step"].item() == 6
    assert not torch.equal(final["lm_head.weight"], initial["lm_head.weight"])
    assert_same_params(final, ref_final, exact=False, rtol=1e-5)
    assert losses == pytest.approx(ref_losses, rel=1e-5)


def test_trainer_resume_from_checkpoint_is_bit_identical(trainer_runs):
    skip_unless_trainer_resumes()
    root, (final, losses, _, _), (ref_final, _, _, _) = trainer_runs
    ckpt = root / "ours" / "checkpoint-3"
    assert (ckpt / "optimizer.pt").is_file() and (ckpt / "model.safetensors").is_file()
    resumed, resumed_losses, initial, opt = _train(root / "ours_resumed", _ours, resume=str(ckpt), model_seed=7)
    assert opt.state[next(iter(opt.state))]["step"].item() == 6
    assert_same_params(resumed, final, exact=True)
    assert resumed_losses[3:] == losses[3:]  # the log history up to step 3 comes from the checkpoint


def test_trainer_resume_from_a_save_only_model_checkpoint_starts_from_its_weights(trainer_runs, tmp_path):
    ckpt = trainer_runs[0] / "torch" / "checkpoint-3"  # written with save_only_model=True
    assert not (ckpt / "optimizer.pt").exists()
    from safetensors.torch import load_file

    ckpt_weights = load_file(str(ckpt / "model.safetensors"))
    # one more step from the checkpoint, with a fresh optimizer: ours and torch's
    ours, _, initial, opt = _train(tmp_path / "ours", _ours, max_steps=4, resume=str(ckpt), save_only_model=True)
    ref, _, _, _ = _train(tmp_path / "torch", _torch, max_steps=4, resume=str(ckpt), save_only_model=True)
    assert_same_params(ours, ref, exact=False, rtol=1e-5)
    assert opt.state[next(iter(opt.state))]["step"].item() == 1  # a fresh optimizer, one step
    from_ckpt = max((ours[n] - ckpt_weights[n]).abs().max().item() for n in ours)
    from_init = max((ours[n] - initial[n]).abs().max().item() for n in ours)
    print(f"max |resumed - checkpoint| {from_ckpt:.2e}, max |resumed - initial| {from_init:.2e}")
    assert from_ckpt < from_init / 2, (from_ckpt, from_init)


def test_trainer_style_load_state_dict_after_building_the_optimizer():
    """What users do by hand: build model and optimizer, then load the weights, then train."""
    pretrained = tiny_llama(seed=3).state_dict()
    model, ref_model = tiny_llama(), tiny_llama()
    opt = DeepOptimizerStates(model, lr=LR, schedule=2)
    model.load_state_dict(pretrained)
    ref_model.load_state_dict(pretrained)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=LR, fused=True)
    for ids in batches(2, seed=4):
        lm_step(model, opt, ids, max_norm=0.5)
        lm_step(ref_model, ref, ids, max_norm=0.5)
    assert_same_params(params_of(model), params_of(ref_model), exact=False, rtol=1e-6)


# ---- 4. in-place edits after construction ---------------------------------------------------------------------
def _edit(model: nn.Module, weights: dict[str, torch.Tensor], how: str) -> None:
    if how == "load_state_dict":
        model.load_state_dict(weights)
        return
    with torch.no_grad():
        for n, p in model.named_parameters():
            if how == "copy_":
                p.copy_(weights[n])
            elif how == "data_assign":  # a new tensor behind the same Parameter
                p.data = weights[n].clone()
            else:  # "data_copy_": in place through .data, which has its own version counter
                p.data.copy_(weights[n])


@pytest.mark.parametrize("step_first", [True, False], ids=["after_a_step", "before_any_step"])
@pytest.mark.parametrize("how", ["load_state_dict", "copy_", "data_assign", "data_copy_"])
def test_weights_edited_after_construction_are_the_new_masters(how, step_first):
    model, ref_model = tiny_llama(), tiny_llama()
    initial = params_of(model)
    opt = DeepOptimizerStates(model, lr=LR, schedule="cpu")
    ref = torch.optim.AdamW(ref_model.parameters(), lr=LR, fused=True)
    if step_first:  # the optimizer has written the params once already
        lm_step(model, opt, batches(1, seed=2)[0])
        lm_step(ref_model, ref, batches(1, seed=2)[0])
    gen = torch.Generator().manual_seed(3)
    pretrained = {n: v + 0.05 * torch.randn(v.shape, generator=gen) for n, v in initial.items()}
    _edit(model, pretrained, how)
    _edit(ref_model, pretrained, how)
    ids = batches(1, seed=5)[0]
    lm_step(model, opt, ids)
    lm_step(ref_model, ref, ids)
    after = params_of(model)
    by_name = dict(model.named_parameters())
    for n in after:
        to_pre = (after[n] - pretrained[n]).abs().max().item()
        to_init = (after[n] - initial[n]).abs().max().item()
        assert to_pre < 2.5 * LR < to_init, (n, to_pre, to_init)
        assert torch.equal(opt.state[by_name[n]]["master"], after[n])
    assert_same_params(after, params_of(ref_model), exact=False, rtol=1e-6)


@pytest.mark.parametrize("schedule", ["cpu", 2])
def test_one_weight_edited_through_data_between_steps_is_taken_and_the_rest_keep_their_fp32_masters(schedule):
    """``p.data[...] = v`` moves no version the param shares: the changed norm shows the edit. Only that param
    takes its (bf16-rounded) weights as masters; every other param keeps its fp32 master bits."""
    model = tiny_llama().to(torch.bfloat16)
    opt = DeepOptimizerStates(model, lr=LR, schedule=schedule)
    lm_step(model, opt, batches(1)[0])
    masters = {n: opt.master(p).clone() for n, p in model.named_parameters()}
    edited = model.lm_head.weight
    edited.data[0, 0] = 0.75
    ids = batches(1, seed=2)[0]
    model(input_ids=ids, labels=ids).loss.backward()
    assert opt.layout.take_edits() == ["lm_head.weight"]
    assert opt.master(edited)[0, 0].item() == 0.75
    for n, p in model.named_parameters():
        if p is not edited:
            assert torch.equal(opt.master(p), masters[n]), f"{n}: its fp32 master must not be touched"
    opt.step()
    assert opt.layout.take_edits() == [], "our own writes are not edits"


@pytest.mark.parametrize("how", ["model_reloaded", "ema_swapped", "optimizer_loaded_first"])
def test_bf16_weights_written_back_unchanged_keep_their_fp32_masters(how):
    """Writing a bf16 param back with the value it has (the model's own state_dict loaded again, EMA weights
    swapped in and back out, a resume that loads the optimizer before the model) bumps its version but is
    no edit: the fp32 masters keep their low bits and training goes on exactly as without the write."""
    def run(touch: bool) -> tuple[dict, dict]:
        model = tiny_llama().to(torch.bfloat16)
        opt = DeepOptimizerStates(model, lr=LR, schedule=2)
        for ids in batches(3):
            lm_step(model, opt, ids)
        if touch and how == "model_reloaded":
            model.load_state_dict(copy.deepcopy(model.state_dict()))
        elif touch and how == "ema_swapped":
            kept = copy.deepcopy(model.state_dict())
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(0.5)  # evaluate with other weights ...
            model.load_state_dict(kept)  # ... and put the trained ones back
        elif touch:
            weights, state = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
            model, opt = tiny_llama().to(torch.bfloat16), None
            opt = DeepOptimizerStates(model, lr=LR, schedule=2)
            opt.load_state_dict(state)
            model.load_state_dict(weights)
        for ids in batches(3, seed=7):
            lm_step(model, opt, ids)
        return params_of(model), {n: opt.master(p).clone() for n, p in model.named_parameters()}

    (params_a, masters_a), (params_b, masters_b) = run(False), run(True)
    for n in params_a:
        assert torch.equal(params_a[n], params_b[n]), n
        assert torch.equal(masters_a[n], masters_b[n]), n
    assert any(not torch.equal(m, m.bfloat16().float()) for m in masters_b.values())  # low bits are there


# ---- 5. dtype changes and replaced params ---------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float16, torch.float64])
def test_model_cast_after_construction_is_refused_by_name(dtype):
    model = tiny_llama()
    opt = DeepOptimizerStates(model, lr=LR, schedule="cpu")
    lm_step(model, opt, batches(1)[0])
    state = snapshot_state(opt)
    model.to(dtype)
    before = params_of(model)
    ids = batches(1, seed=2)[0]
    model(input_ids=ids, labels=ids).loss.backward()
    with pytest.raises(RuntimeError, match=r"param model\.embed_tokens\.weight: its dtype changed"):
        opt.step()
    assert_same_params(params_of(model), before)
    assert_state_equal(snapshot_state(opt), state)


def test_replaced_parameter_is_refused_by_name():
    model = tiny_llama()
    opt = DeepOptimizerStates(model, lr=LR, schedule="cpu")
    lm_step(model, opt, batches(1)[0])
    model.lm_head.weight = nn.Parameter(torch.randn_like(model.lm_head.weight))
    ids = batches(1, seed=2)[0]
    model(input_ids=ids, labels=ids).loss.backward()
    with pytest.raises(RuntimeError, match=r"param lm_head\.weight is no longer a param of the model"):
        opt.step()


# ---- 6. no leaks when optimizers are built again and again --------------------------------------------------
def _hooks(p: torch.Tensor) -> int:
    return len(getattr(p, "_post_accumulate_grad_hooks", None) or {}) + len(p._backward_hooks or {})


@pytest.mark.parametrize("how", ["drop", "with", "close"])
def test_building_ten_times_leaks_nothing(how):
    model = mlp()
    gc.collect()
    threads = threading.active_count()
    refs = []

    def train(opt, i):
        opt.zero_grad()
        loss_of(model, torch.Generator().manual_seed(i)).backward()
        opt.step()

    for i in range(10):
        if how == "with":
            with DeepOptimizerStates(model, lr=LR, schedule=2, subgroup_size=3000) as opt:
                train(opt, i)
            for use in (opt.step, lambda: setattr(opt, "schedule", "cpu"),
                        lambda: opt.every_state_shown().__enter__()):
                with pytest.raises(RuntimeError, match="closed"):
                    use()
        else:
            opt = DeepOptimizerStates(model, lr=LR, schedule=2, subgroup_size=3000)
            train(opt, i)
            if how == "close":
                opt.close()
                opt.close()  # twice is fine
        refs.append(weakref.ref(opt))
        del opt
        assert all(_hooks(p) == 0 for p in model.parameters())
        assert threading.active_count() <= threads
    gc.collect()  # once: a full collection is slow with transformers loaded
    assert [r() for r in refs] == [None] * 10, "optimizers still referenced after del + gc.collect()"
    assert threading.active_count() <= threads


# ---- 7. copy / pickle -----------------------------------------------------------------------------------------
def test_deepcopy_and_pickle_refuse_with_a_pointer_to_state_dict():
    opt = DeepOptimizerStates(mlp(), lr=LR)
    with pytest.raises(TypeError, match="state_dict"):
        copy.deepcopy(opt)
    with pytest.raises(TypeError, match="state_dict"):
        pickle.dumps(opt)
    with pytest.raises(TypeError, match="state_dict"):
        copy.copy(opt)


# ---- 8. named params, frozen and tied -------------------------------------------------------------------------
@pytest.mark.parametrize("form", ["named_parameters", "list_with_duplicates"])
def test_named_params_with_a_frozen_and_a_tied_param(form):
    model, ref_model = tiny_llama(tie=True), tiny_llama(tie=True)
    for m in (model, ref_model):
        m.model.norm.weight.requires_grad_(False)
        assert m.lm_head.weight is m.model.embed_tokens.weight
    frozen = model.model.norm.weight.detach().clone()
    if form == "named_parameters":
        opt = DeepOptimizerStates(model.named_parameters(), lr=LR, schedule=2)
    else:
        named = list(model.named_parameters(remove_duplicate=False))
        assert len(named) == len(list(model.parameters())) + 1
        opt = DeepOptimizerStates(named, lr=LR, schedule=2)
    assert len(opt.param_groups[0]["params"]) == len(list(model.parameters()))
    ref = torch.optim.AdamW(ref_model.parameters(), lr=LR, fused=True)  # deduplicated
    for ids in batches(4, seed=8):
        lm_step(model, opt, ids)
        lm_step(ref_model, ref, ids)
    assert torch.equal(model.model.norm.weight, frozen)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert_same_params(params_of(model), params_of(ref_model), exact=False, rtol=1e-6)
    tied = model.model.embed_tokens.weight
    assert opt.state[tied]["step"].item() == 4


# ---- 9. sparse embeddings -------------------------------------------------------------------------------------
def test_sparse_embedding_is_refused_at_construction():
    model = nn.Sequential(nn.Embedding(16, 8, sparse=True), nn.Linear(8, 2))
    with pytest.raises(ValueError, match="sparse"):
        DeepOptimizerStates(model)


# ---- 10. NaN policy -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["skip", "raise"])
def test_nonfinite_gradient_skips_or_raises_and_changes_nothing(policy):
    model, ref_model = tiny_llama(), tiny_llama()
    opt = DeepOptimizerStates(model, lr=LR, schedule=2, max_grad_norm=1.0, nonfinite=policy)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=LR, fused=True)
    data = batches(4, seed=9)
    for ids in data[:2]:
        lm_step(model, opt, ids)
        lm_step(ref_model, ref, ids, max_norm=1.0)
    before, state = params_of(model), snapshot_state(opt)
    opt.zero_grad()
    model(input_ids=data[2], labels=data[2]).loss.backward()
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight.grad[3, 5] = float("nan")
    if policy == "skip":
        with pytest.warns(RuntimeWarning, match="skipped"):
            opt.step()
        assert opt.skipped_steps == 1
    else:
        with pytest.raises(FloatingPointError):
            opt.step()
        assert opt.skipped_steps == 0
    assert_same_params(params_of(model), before)
    assert_state_equal(snapshot_state(opt), state)
    # the next clean step trains normally: as torch, which never saw the bad batch
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lm_step(model, opt, data[3])
    lm_step(ref_model, ref, data[3], max_norm=1.0)
    assert_same_params(params_of(model), params_of(ref_model), exact=False, rtol=1e-6)


@pytest.mark.parametrize("stream", [False, True], ids=["gathered", "streamed"])
@pytest.mark.parametrize("schedule", ["cpu", 2], ids=str)
def test_huge_finite_gradients_step_as_torch_does(schedule, stream):
    """Finite gradients of 1e18 overflow the fp32 global norm (inf), yet hold no inf/nan: torch's AdamW steps
    on them (Adam does not care about the gradient's scale), and so do we."""
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8))
    twin = copy.deepcopy(model)
    opt = DeepOptimizerStates(model, lr=1e-2, subgroup_size=1000, schedule=schedule, stream_grads=stream)
    ref = torch.optim.AdamW(twin.parameters(), lr=1e-2, fused=True)
    for step in range(3):
        opt.zero_grad()
        ref.zero_grad()
        (model(torch.ones(2, 64)).sum() * 1e18).backward()
        (twin(torch.ones(2, 64)).sum() * 1e18).backward()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            opt.step()
        ref.step()
        assert opt.skipped_steps == 0 and not math.isfinite(float(opt.last_grad_norm))
        assert_same_params(params_of(model), params_of(twin), exact=False, rtol=1e-6)


def test_a_numpy_float32_lr_from_a_scheduler_is_taken_as_torch_takes_it():
    np = pytest.importorskip("numpy")
    model = mlp()
    twin = copy.deepcopy(model)
    opt = DeepOptimizerStates(model, lr=1e-2, subgroup_size=2000, schedule=2)
    ref = torch.optim.AdamW(twin.parameters(), lr=1e-2, fused=True)
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: np.float32(0.9) ** s) for o in (opt, ref)]
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        for o, m in ((opt, model), (ref, twin)):
            o.zero_grad()
        state = gen.get_state()
        loss_of(model, gen).backward()
        gen.set_state(state)
        loss_of(twin, gen).backward()
        opt.step()
        ref.step()
        for s in scheds:
            s.step()
    assert isinstance(opt.param_groups[0]["lr"], np.floating)
    assert_same_params(params_of(model), params_of(twin), exact=False, rtol=1e-6)


# ---- 11. zero_grad --------------------------------------------------------------------------------------------
def test_zero_grad_clears_user_grads_and_set_to_none_false_keeps_zeros():
    model, ref_model = tiny_llama(), tiny_llama()
    opt = DeepOptimizerStates(model, lr=LR, schedule=2)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=LR, fused=True)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    data = batches(3, seed=10)
    for k, ids in enumerate(data):
        for m in (model, ref_model):
            m(input_ids=ids, labels=ids).loss.backward()
        for (n, p), q in zip(model.named_parameters(), ref_model.parameters()):
            assert torch.equal(p.grad, q.grad), n  # not polluted by the user's ones or an earlier step
        opt.step()
        ref.step()
        ref.zero_grad()
        opt.zero_grad(set_to_none=False)
        assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
        if k == 0:  # a user grad after a zero_grad(set_to_none=False) is cleared by the next zero_grad too
            for p in model.parameters():
                p.grad.fill_(1.0)
            opt.zero_grad()
            assert all(p.grad is None for p in model.parameters())
    assert_same_params(params_of(model), params_of(ref_model), exact=False, rtol=1e-6)


# ---- 12. state_dict hooks -------------------------------------------------------------------------------------
def test_state_dict_and_load_state_dict_hooks_are_called():
    model = mlp()
    opt = DeepOptimizerStates(model, lr=LR)
    gen = torch.Generator().manual_seed(0)
    loss_of(model, gen).backward()
    calls = []
    opt.register_state_dict_pre_hook(lambda o: calls.append(("sd_pre", o)))

    def sd_post(o, sd):
        calls.append(("sd_post", o))
        return {**sd, "extra": 1}

    opt.register_state_dict_post_hook(sd_post)

    def load_pre(o, sd):
        calls.append(("load_pre", o))
        return {k: v for k, v in sd.items() if k != "extra"}

    opt.register_load_state_dict_pre_hook(load_pre)
    opt.register_load_state_dict_post_hook(lambda o: calls.append(("load_post", o)))
    opt.register_step_pre_hook(lambda o, args, kwargs: calls.append(("step_pre", o)))
    opt.register_step_post_hook(lambda o, args, kwargs: calls.append(("step_post", o)))
    opt.step()
    sd = opt.state_dict()
    assert sd["extra"] == 1
    opt.load_state_dict(sd)
    assert [c[0] for c in calls] == ["step_pre", "step_post", "sd_pre", "sd_post", "load_pre", "load_post"]
    assert all(o is opt for _, o in calls)


# ---- 13. a torch.optim.Adam (L2) checkpoint -------------------------------------------------------------------
@pytest.mark.skipif("decoupled_weight_decay" not in inspect.signature(torch.optim.Adam).parameters,
                    reason="torch < 2.6: Adam's state_dict does not say it is L2 (its param_groups are AdamW's)")
def test_torch_adam_l2_checkpoint_keeps_classic_adam_and_torch_kwargs_are_accepted():
    model_t = mlp()
    ref = torch.optim.Adam(model_t.parameters(), lr=LR, weight_decay=0.1, fused=True)

    def step(model, opt, seed):
        opt.zero_grad()
        loss_of(model, torch.Generator().manual_seed(seed)).backward()
        opt.step()

    for i in range(2):
        step(model_t, ref, i)
    assert ref.state_dict()["param_groups"][0].get("decoupled_weight_decay") is False
    model = mlp()
    model.load_state_dict(model_t.state_dict())
    opt = DeepOptimizerStates(model, lr=LR, weight_decay=0.1, foreach=False, fused=None, schedule=2)  # AdamW
    opt.load_state_dict(ref.state_dict())
    for i in range(2, 5):
        step(model_t, ref, i)
        step(model, opt, i)
    assert_same_params(params_of(model), params_of(model_t), exact=False, rtol=1e-6)


def test_foreach_false_fused_none_is_accepted_and_trains_like_torch():
    model, ref_model = mlp(), mlp()
    opt = DeepOptimizerStates(list(model.parameters()), lr=LR, foreach=False, fused=None)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=LR, fused=True)
    for i in range(3):
        for m, o in ((model, opt), (ref_model, ref)):
            o.zero_grad()
            loss_of(m, torch.Generator().manual_seed(i)).backward()
            o.step()
    assert_same_params(params_of(model), params_of(ref_model), exact=False, rtol=1e-6)


# ---- 14. a torch AdamW checkpoint with a param that has no state yet -----------------------------------------
def test_torch_adamw_checkpoint_with_a_stateless_param_loads_and_continues_like_torch():
    model_t = mlp()
    ref = torch.optim.AdamW(model_t.parameters(), lr=LR, fused=True)
    late = model_t[-1].bias  # gets no gradient during the first steps
    for i in range(2):
        ref.zero_grad()
        loss_of(model_t, torch.Generator().manual_seed(i)).backward()
        late.grad = None
        ref.step()
    sd = ref.state_dict()
    index = [p is late for p in model_t.parameters()].index(True)
    assert index not in sd["state"] and len(sd["state"]) == len(list(model_t.parameters())) - 1
    model = mlp()
    model.load_state_dict(model_t.state_dict())
    opt = DeepOptimizerStates(model, lr=LR, schedule=2)
    opt.load_state_dict(sd)
    assert opt.state_dict()["state"].keys() == sd["state"].keys()
    for i in range(2, 5):
        for m, o in ((model, opt), (model_t, ref)):
            o.zero_grad()
            loss_of(m, torch.Generator().manual_seed(i)).backward()
            o.step()
    assert_same_params(params_of(model), params_of(model_t), exact=False, rtol=1e-6)
    assert opt.state[model[-1].bias]["step"].item() == ref.state[late]["step"].item() == 3


def test_master_and_state_dict_see_an_edit_before_the_next_step():
    """A checkpoint taken right after loading weights must hold the loaded weights as masters."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = DeepOptimizerStates(model, lr=1e-3, schedule="cpu")
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    with torch.no_grad():
        model.weight.fill_(0.5)
    assert torch.equal(opt.master(model.weight), torch.full((3, 4), 0.5))
    assert torch.equal(opt.state_dict()["state"][0]["master_param"], torch.full((3, 4), 0.5))


@pytest.mark.parametrize("read", ["one", "all"])
def test_opt_state_sees_an_edit_before_the_next_step_and_a_write_back_keeps_it(read):
    """Lightning and Accelerate write every state tensor back after loading (``state[k] = state[k].to(dev)``):
    a master read through ``opt.state`` after the weights were loaded must be the loaded weights, else the
    write-back would undo the load. One param's states read, or all of them (``items()``)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    opt = DeepOptimizerStates(model, lr=1e-3, schedule="cpu")
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    loaded = {k: torch.full_like(v, 0.5) for k, v in model.state_dict().items()}
    model.load_state_dict(loaded)
    p = model[0].weight
    states = [opt.state[p]] if read == "one" else [s for _, s in opt.state.items()]
    assert torch.equal(states[0]["master"], torch.full((3, 4), 0.5))
    for state in states:
        for key, value in list(state.items()):
            if isinstance(value, torch.Tensor):
                state[key] = value.clone()
    assert all(torch.equal(v, loaded[k]) for k, v in model.state_dict().items()), "the load was undone"
    assert torch.equal(opt.master(model[1].bias), torch.full((2,), 0.5))


def test_a_clip_requested_before_zero_grad_does_not_clip_the_next_step():
    torch.manual_seed(0)
    model, ref_model = nn.Linear(4, 3), nn.Linear(4, 3)
    ref_model.load_state_dict(model.state_dict())
    opt = DeepOptimizerStates(model, lr=1e-2, schedule="cpu")
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, fused=True)
    x = torch.randn(2, 4)
    model(x).sum().backward()
    opt.clip_grad_norm_(1e-3)
    opt.zero_grad()
    for m, o in ((model, opt), (ref_model, ref)):
        m(x).pow(2).sum().backward()
        o.step()
    torch.testing.assert_close(model.weight, ref_model.weight, rtol=1e-6, atol=0)


def test_a_param_made_non_contiguous_is_refused_by_name():
    model = nn.Linear(4, 3)
    opt = DeepOptimizerStates(model, lr=1e-3, schedule="cpu")
    with torch.no_grad():
        model.weight.data = model.weight.data.t().contiguous().t()
    model.weight.grad = torch.ones(3, 4)
    with pytest.raises(RuntimeError, match="weight.*no longer contiguous"):
        opt.step()


def test_opt_state_refuses_a_copy_and_an_entry_copies_as_before():
    model = mlp()
    opt = DeepOptimizerStates(model, lr=LR)
    loss_of(model, torch.Generator().manual_seed(0)).backward()
    opt.step()
    with pytest.raises(TypeError, match="state_dict"):
        copy.deepcopy(opt.state)
    p = next(model.parameters())
    entry = copy.deepcopy(opt.state[p])  # tensors copied, nothing else (not the param, not its bucket)
    assert torch.equal(entry["exp_avg"], opt.state[p]["exp_avg"])
    assert entry["exp_avg"].data_ptr() != opt.state[p]["exp_avg"].data_ptr()
    before = p.detach().clone()
    entry["master"] = entry["master"] * 2  # a write into the copy
    assert torch.equal(p.detach(), before), "a copy's write must not reach the model"

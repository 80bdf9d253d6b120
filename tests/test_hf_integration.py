"""The Hugging Face Trainer integration (deep_optimizer_states.integrations.hf) on the CPU: DOSTrainer and
Trainer(optimizer_cls_and_kwargs=...) train like the Trainer with torch's fused AdamW over the same param
groups (weight decay on weights, none on biases and norms), with gradient accumulation and the Trainer's own
clipping; a checkpoint resumes bit for bit."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from deep_optimizer_states import DeepOptimizerStates  # noqa: E402
from deep_optimizer_states.integrations.hf import (  # noqa: E402
    DOSTrainer, optimizer_cls_and_kwargs, optimizer_kwargs)
from tests.harness import TokenData, assert_same_params, params_of, skip_unless_trainer_resumes  # noqa: E402

LR = 1e-3
WEIGHT_DECAY = 0.1
BETAS = (0.9, 0.95)
EPS = 1e-7


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models: one intra-op thread. Afterwards the Accelerate singletons the Trainers configured are reset
    for the modules that follow."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
    _reset_accelerate()


def _reset_accelerate() -> None:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


# ---- helpers --------------------------------------------------------------------------------------------------
def tiny_llama(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=128, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg).to(dtype=dtype)


def training_args(out_dir, max_steps: int = 6, **extra) -> "transformers.TrainingArguments":
    fields = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    if "save_safetensors" in fields:  # transformers >= 5 always saves safetensors and dropped the argument
        extra["save_safetensors"] = True
    kwargs = dict(
        output_dir=str(out_dir), per_device_train_batch_size=2, gradient_accumulation_steps=2, max_grad_norm=0.5,
        max_steps=max_steps, save_steps=3, logging_steps=1, report_to=[], use_cpu=True, seed=42,
        lr_scheduler_type="linear", learning_rate=LR, weight_decay=WEIGHT_DECAY, adam_beta1=BETAS[0],
        adam_beta2=BETAS[1], adam_epsilon=EPS, disable_tqdm=True)
    return transformers.TrainingArguments(**{**kwargs, **extra})


@dataclasses.dataclass
class Run:
    final: dict
    initial: dict
    losses: list
    grad_norms: list
    trainer: "transformers.Trainer"

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer the Trainer stepped, out of Accelerate's AcceleratedOptimizer."""
        opt = self.trainer.optimizer
        while hasattr(opt, "optimizer") and not isinstance(opt, DeepOptimizerStates):
            opt = opt.optimizer
        return opt


def train(out_dir, how: str, resume=None, model_seed: int = 0, max_steps: int = 6, **extra) -> Run:
    _reset_accelerate()
    args = training_args(out_dir, max_steps=max_steps, **extra)
    model = tiny_llama(seed=model_seed)
    initial = params_of(model)
    common = dict(model=model, args=args, train_dataset=TokenData())
    if how == "torch":  # the stock Trainer's grouping, torch's fused AdamW
        trainer = transformers.Trainer(**common, optimizer_cls_and_kwargs=(torch.optim.AdamW, dict(
            lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon,
            weight_decay=args.weight_decay, fused=True)))
    elif how == "dos_trainer":
        trainer = DOSTrainer(**common, dos_kwargs={"schedule": 2, "subgroup_size": 20_000})
    elif how == "dos_trainer_stream":
        trainer = DOSTrainer(**common, dos_kwargs={"schedule": 2, "subgroup_size": 20_000, "stream_grads": True})
    elif how == "dos_trainer_overlap":
        trainer = DOSTrainer(**common, dos_kwargs={"schedule": 2, "subgroup_size": 20_000, "overlap": True})
    elif how == "cls_and_kwargs":
        trainer = transformers.Trainer(**common, optimizer_cls_and_kwargs=optimizer_cls_and_kwargs(
            args, schedule="cpu", subgroup_size=20_000))
    else:
        raise ValueError(how)
    trainer.train(resume_from_checkpoint=resume)
    history = trainer.state.log_history
    return Run(params_of(model), initial, [h["loss"] for h in history if "loss" in h],
               [h["grad_norm"] for h in history if "grad_norm" in h], trainer)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return root, {how: train(root / how, how) for how in ("torch", "dos_trainer", "cls_and_kwargs")}


def _groups_by_name(opt: torch.optim.Optimizer, model: nn.Module) -> list[tuple[set, dict]]:
    names = {id(p): n for n, p in model.named_parameters()}
    return [({names[id(p)] for p in g["params"]}, {k: g[k] for k in ("lr", "betas", "eps", "weight_decay")})
            for g in opt.param_groups]


# ---- 1. DOSTrainer ----------------------------------------------------------------------------------------------
def test_dos_trainer_matches_trainer_with_torch_fused_adamw(runs):
    _, r = runs
    ours, ref = r["dos_trainer"], r["torch"]
    assert len(ours.losses) == 6 and all(map(lambda x: x == x and abs(x) != float("inf"), ours.losses))
    assert max(ref.grad_norms) > 0.5, "the Trainer's clipping must have been active for this comparison"
    assert not torch.equal(ours.final["lm_head.weight"], ours.initial["lm_head.weight"])
    assert_same_params(ours.final, ref.final, exact=False, rtol=1e-5)
    assert ours.losses == pytest.approx(ref.losses, rel=1e-5)
    assert ours.grad_norms == pytest.approx(ref.grad_norms, rel=1e-5)
    # the same param groups as the base Trainer: weights decay, biases and norms do not; hyper-parameters
    # from the TrainingArguments (lr: the linear schedule's last value, as torch's)
    groups = _groups_by_name(ours.optimizer, ours.trainer.model)
    ref_groups = _groups_by_name(ref.optimizer, ref.trainer.model)
    assert groups == ref_groups
    assert [g["weight_decay"] for _, g in groups] == [WEIGHT_DECAY, 0.0]
    assert groups[0][1]["betas"] == BETAS and groups[0][1]["eps"] == EPS
    assert {"model.norm.weight", "model.layers.0.input_layernorm.weight"} <= groups[1][0]
    assert "lm_head.weight" in groups[0][0]


def test_dos_trainer_with_streamed_gradients_matches_torch(runs, tmp_path):
    """stream_grads under the Trainer: the non-final micro-batch accumulates, the last one streams, and the
    clipping (max_grad_norm 0.5, active) moves into the optimizer; the result is torch's fused AdamW's."""
    _, r = runs
    ours, ref = train(tmp_path, "dos_trainer_stream"), r["torch"]
    opt = ours.optimizer
    assert opt.grad_stream.sent > 0 and opt.max_grad_norm == 0.5 and ours.trainer.args.max_grad_norm == 0
    assert int(opt.state[next(iter(opt.state))]["step"]) == 6
    assert_same_params(ours.final, ref.final, exact=False, rtol=1e-5)
    assert ours.losses == pytest.approx(ref.losses, rel=1e-5)
    assert len(ours.grad_norms) == 6, "the optimizer's norm is logged (the params' .grad are partly gone)"
    assert ours.grad_norms == pytest.approx(ref.grad_norms, rel=1e-5)


def test_dos_trainer_with_streamed_gradients_skips_a_step_with_an_inf_gradient(tmp_path):
    """An inf in one gradient: the step is skipped (nonfinite="skip"), as without stream_grads, and the
    Trainer's own norm logging (which would scale the remaining .grad by inf/inf in place) stays out."""
    _reset_accelerate()
    args = training_args(tmp_path, max_steps=3, gradient_accumulation_steps=1)
    model = tiny_llama()
    trainer = DOSTrainer(model=model, args=args, train_dataset=TokenData(),
                         dos_kwargs={"schedule": 2, "subgroup_size": 20_000, "stream_grads": True})
    armed = {"on": False}

    class Arm(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            armed["on"] = state.global_step == 1

    trainer.add_callback(Arm())
    model.lm_head.weight.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), float("inf")) if armed["on"]
                                       else g)
    with pytest.warns(RuntimeWarning, match="step skipped"):
        trainer.train()
    opt = trainer.optimizer
    while not isinstance(opt, DeepOptimizerStates):
        opt = opt.optimizer
    assert opt.skipped_steps == 1
    norms = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    assert norms[1] == float("inf") and all(n < float("inf") for n in (norms[0], norms[2]))


def test_dos_trainer_with_overlap_trains_bit_for_bit_like_without(runs, tmp_path):
    """overlap=True under the Trainer: its model.zero_grad(), scheduler step, clipping of the next step's
    gradients, logging and checkpoints (model and optimizer state_dict every 3 steps) around an update left
    running; every loss, grad norm and final weight equal to the DOSTrainer's without overlap."""
    _, r = runs
    ours, ref = train(tmp_path, "dos_trainer_overlap"), r["dos_trainer"]
    assert ours.optimizer.overlapper is not None and ours.optimizer.module is ours.trainer.model
    assert not ours.optimizer.overlapper.busy, "train() returns after the last update"
    assert ours.losses == ref.losses and ours.grad_norms == ref.grad_norms
    assert_same_params(ours.final, ref.final)


# ---- 2. Trainer(optimizer_cls_and_kwargs=...) -------------------------------------------------------------------
def test_optimizer_cls_and_kwargs_trains_like_torch_fused_adamw(runs):
    _, r = runs
    ours, ref = r["cls_and_kwargs"], r["torch"]
    assert_same_params(ours.final, ref.final, exact=False, rtol=1e-5)
    assert ours.losses == pytest.approx(ref.losses, rel=1e-5)
    assert _groups_by_name(ours.optimizer, ours.trainer.model) == _groups_by_name(ref.optimizer, ref.trainer.model)


def test_optimizer_cls_and_kwargs_takes_the_training_arguments(tmp_path):
    args = training_args(tmp_path)
    cls, kwargs = optimizer_cls_and_kwargs(args, schedule="cpu")
    assert cls is DeepOptimizerStates
    assert kwargs == {"lr": LR, "betas": BETAS, "eps": EPS, "weight_decay": WEIGHT_DECAY, "schedule": "cpu"}
    assert "max_grad_norm" not in kwargs  # the Trainer clips
    with pytest.raises(ValueError, match="clip twice"):
        optimizer_cls_and_kwargs(args, max_grad_norm=1.0)
    unclipped = training_args(tmp_path, max_grad_norm=0.0)
    assert optimizer_kwargs(unclipped, max_grad_norm=1.0)["max_grad_norm"] == 1.0
    with pytest.raises(ValueError, match="clip twice"):
        DOSTrainer(model=tiny_llama(), args=args, train_dataset=TokenData(), dos_kwargs={"max_grad_norm": 1.0})
    with pytest.raises(ValueError, match="dos_kwargs"):
        DOSTrainer(model=tiny_llama(), args=args, train_dataset=TokenData(),
                   optimizer_cls_and_kwargs=optimizer_cls_and_kwargs(args))


# ---- 3. checkpoint and resume -----------------------------------------------------------------------------------
def test_dos_trainer_resume_from_checkpoint_is_bit_identical(runs):
    skip_unless_trainer_resumes()
    root, r = runs
    full = r["dos_trainer"]
    ckpt = root / "dos_trainer" / "checkpoint-3"
    assert (ckpt / "optimizer.pt").is_file() and (ckpt / "model.safetensors").is_file()
    resumed = train(root / "resumed", "dos_trainer", resume=str(ckpt), model_seed=7)  # another init: from ckpt
    opt = resumed.optimizer
    assert isinstance(opt, DeepOptimizerStates)
    assert opt.state[next(iter(opt.state))]["step"].item() == 6
    assert_same_params(resumed.final, full.final, exact=True)
    assert resumed.losses[3:] == full.losses[3:]  # the log history up to step 3 comes from the checkpoint
    for s, s2 in zip(full.optimizer.state.values(), opt.state.values()):
        for key in ("step", "exp_avg", "exp_avg_sq", "master"):
            assert torch.equal(s[key], s2[key]), key


# ---- 4. the optimizer the Trainer used --------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["dos_trainer", "cls_and_kwargs"])
def test_the_trainer_stepped_a_deep_optimizer_states(runs, how):
    accelerate = pytest.importorskip("accelerate")
    run = runs[1][how]
    assert isinstance(run.trainer.optimizer, accelerate.optimizer.AcceleratedOptimizer)
    opt = run.trainer.optimizer.optimizer
    assert isinstance(opt, DeepOptimizerStates)
    assert opt.schedule == (2 if how == "dos_trainer" else "cpu")
    assert len(opt.layout.subgroups) > 1  # subgroup_size reached the constructor
    assert opt.skipped_steps == 0
    assert all(s["step"].item() == 6 for s in opt.state.values())
    assert len(opt.state) == len(list(run.trainer.model.parameters()))
    # the Trainer's scheduler drove our param groups' lr (linear: 0 after the last of the 6 steps)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.0)


# ---- bf16 autocast over fp32 params; fp16 params refused ----------------------------------------------------------
def test_dos_trainer_with_bf16_autocast_matches_torch(tmp_path):
    ref = train(tmp_path / "torch", "torch", max_steps=2, bf16=True)
    ours = train(tmp_path / "ours", "dos_trainer", max_steps=2, bf16=True)
    assert_same_params(ours.final, ref.final, exact=False, rtol=1e-5)
    assert not torch.equal(ours.final["lm_head.weight"], ours.initial["lm_head.weight"])


# ---- fp16 params: refused with a clear error ----------------------------------------------------------------------
def test_fp16_params_under_the_trainer_raise_a_clear_error(tmp_path):
    _reset_accelerate()
    model = tiny_llama(dtype=torch.float16)
    trainer = DOSTrainer(model=model, args=training_args(tmp_path, max_steps=1), train_dataset=TokenData(),
                         dos_kwargs={"schedule": "cpu"})
    with pytest.raises(RuntimeError, match="scale_loss"):
        trainer.train()


def test_dos_trainer_with_streamed_gradients_leaves_the_callers_arguments_alone(tmp_path):
    """Clipping moves into the optimizer on the trainer's own copy of the arguments: a second trainer built
    from the same TrainingArguments (a sweep) still clips."""
    args = training_args(tmp_path, max_steps=1, max_grad_norm=1.0)
    first = DOSTrainer(model=tiny_llama(), args=args, train_dataset=TokenData(), dos_kwargs={"stream_grads": True})
    assert args.max_grad_norm == 1.0 and first.args.max_grad_norm == 0.0
    second = DOSTrainer(model=tiny_llama(), args=args, train_dataset=TokenData(), dos_kwargs={"stream_grads": True})
    assert second.dos_kwargs["max_grad_norm"] == 1.0


def test_overlap_under_the_stock_trainer_is_refused_up_front_with_the_way_that_works(tmp_path):
    with pytest.raises(ValueError, match="DOSTrainer"):
        optimizer_cls_and_kwargs(training_args(tmp_path, max_steps=1), overlap=True)


def test_stream_grads_with_accumulation_under_the_stock_trainer_is_refused_up_front(tmp_path):
    args = training_args(tmp_path, max_steps=1, max_grad_norm=0.0)  # gradient_accumulation_steps=2
    with pytest.raises(ValueError, match="gradient_accumulation_steps > 1.*use DOSTrainer"):
        optimizer_cls_and_kwargs(args, stream_grads=True)

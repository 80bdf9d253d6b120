"""PyTorch Lightning as a client, on the CPU: ``configure_optimizers`` returns a DeepOptimizerStates (bare, or in
the dict form with a per-step LR scheduler) and ``Trainer.fit`` trains with gradient accumulation and norm
clipping. The weights must equal a hand-written loop with torch's fused AdamW that follows Lightning's semantics
(loss / accumulate_grad_batches per micro-batch, ``clip_grad_norm_`` over the optimizer's params before the
step, the scheduler stepped after every optimizer step), and a run resumed from ``trainer.save_checkpoint``
must continue bit for bit like the uninterrupted one.

The checkpoint is saved from ``on_train_batch_end`` right after an optimizer step (where Lightning's own
``ModelCheckpoint(every_n_train_steps=...)`` saves). A checkpoint saved after ``fit`` returned at
``max_steps``, or from ``on_train_epoch_end``, does not resume like the uninterrupted run with
``accumulate_grad_batches=2`` even with torch's own AdamW (Lightning 2.6.6: the first step after the resume
accumulates one micro-batch, not two): a Lightning loop matter, not the optimizer's."""

from __future__ import annotations

import warnings

import pytest
import torch

from deep_optimizer_states import DeepOptimizerStates
from tests.harness import assert_same_params, mlp, params_of

L = pytest.importorskip("lightning")

LR = 1e-2
BATCH = 4
ACCUMULATE = 2
CLIP = 1.0
SAMPLES = 32  # one epoch = SAMPLES / (BATCH * ACCUMULATE) = 4 optimizer steps: no partial accumulation at its end
STEPS_PER_EPOCH = SAMPLES // (BATCH * ACCUMULATE)
STEPS = 2 * STEPS_PER_EPOCH  # two epochs; the checkpoint is taken after the first


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny model: one intra-op thread is faster than two fighting over a busy CI machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def dataset() -> torch.utils.data.TensorDataset:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(SAMPLES, 32, generator=gen)
    y = 3.0 * torch.randn(SAMPLES, 8, generator=gen)  # large targets: gradient norms above CLIP, so clipping bites
    return torch.utils.data.TensorDataset(x, y)


def loader() -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(dataset(), batch_size=BATCH, shuffle=False)


def decay(step: int) -> float:
    return 1.0 / (1.0 + 0.5 * step)


class Module(L.LightningModule):
    def __init__(self, form: str, seed: int = 0) -> None:
        super().__init__()
        self.form = form
        self.net = mlp(seed=seed)
        self.losses: list[float] = []
        self.opt: DeepOptimizerStates | None = None

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = (self.net(x) - y).pow(2).mean()
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        if self.form == "bare":
            self.opt = DeepOptimizerStates(self.parameters(), lr=LR, schedule="cpu")
            return self.opt
        # the dict form, with the module itself given to the optimizer (named params, forward pre-hook)
        self.opt = DeepOptimizerStates(self, lr=LR, schedule="cpu")
        scheduler = torch.optim.lr_scheduler.LambdaLR(self.opt, decay)
        return {"optimizer": self.opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1}}


class SaveAfterStep(L.Callback):
    """``trainer.save_checkpoint(path)`` right after optimizer step ``at``."""

    def __init__(self, path, at: int) -> None:
        self.path, self.at = path, at

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.at and (batch_idx + 1) % ACCUMULATE == 0:
            trainer.save_checkpoint(self.path)


def fit(form: str, max_steps: int, seed: int = 0, ckpt_path=None, save_to=None) -> Module:
    module = Module(form, seed=seed)
    callbacks = [SaveAfterStep(save_to, STEPS_PER_EPOCH)] if save_to is not None else []
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, accumulate_grad_batches=ACCUMULATE,
                        gradient_clip_val=CLIP, gradient_clip_algorithm="norm", callbacks=callbacks)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        trainer.fit(module, train_dataloaders=loader(), ckpt_path=ckpt_path)
    assert trainer.global_step == max_steps
    return module


def reference(form: str, steps: int, clip: float | None = CLIP) -> tuple[dict, list[float]]:
    """Lightning's automatic optimization written out with torch.optim.AdamW(fused=True) on fp32; returns the
    final params and the pre-clip gradient norm of every step."""
    model = mlp(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, decay) if form == "dict" else None
    micro = [b for _ in range(steps // STEPS_PER_EPOCH) for b in loader()]
    norms = []
    for step in range(steps):
        opt.zero_grad()
        for x, y in micro[ACCUMULATE * step:ACCUMULATE * (step + 1)]:
            ((model(x) - y).pow(2).mean() / ACCUMULATE).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip is not None else float("inf"))
        norms.append(norm.item())
        opt.step()
        if sched is not None:
            sched.step()
    return params_of(model), norms


@pytest.fixture(scope="module", params=["bare", "dict"])
def runs(request, tmp_path_factory):
    form = request.param
    ckpt = tmp_path_factory.mktemp(f"lightning_{form}") / "step4.ckpt"
    full = fit(form, STEPS, save_to=ckpt)
    assert ckpt.is_file()
    resumed = fit(form, STEPS, seed=7, ckpt_path=str(ckpt))  # another init: everything must come from the ckpt
    return form, full, ckpt, resumed


def test_lightning_trains_and_equals_torch_fused_adamw(runs):
    form, full, _, _ = runs
    ref, norms = reference(form, STEPS)
    assert max(norms) > CLIP, f"clipping never engaged (pre-clip norms {norms}): the test would not cover it"
    assert_same_params(params_of(full.net), ref, exact=False, rtol=1e-6)
    # the clipping Lightning applied through clip_grad_norm_ on p.grad is what the optimizer used
    unclipped, _ = reference(form, STEPS, clip=None)
    assert not torch.allclose(params_of(full.net)["5.weight"], unclipped["5.weight"], rtol=1e-4, atol=0)
    opt = full.opt
    assert all(s["step"].item() == STEPS for s in opt.state.values())
    assert len(opt.state) == len(list(full.parameters()))
    if form == "dict":
        assert opt.param_groups[0]["lr"] == pytest.approx(LR * decay(STEPS), rel=1e-12)
    # the loss falls: the second epoch (same data) is lower than the first
    assert len(full.losses) == STEPS * ACCUMULATE
    first, second = full.losses[:SAMPLES // BATCH], full.losses[SAMPLES // BATCH:]
    assert sum(second) < 0.9 * sum(first), (first, second)


def test_lightning_checkpoint_resume_continues_bit_identically(runs):
    form, full, ckpt, resumed = runs
    saved = torch.load(ckpt, map_location="cpu", weights_only=False)
    assert saved["global_step"] == STEPS_PER_EPOCH
    # the checkpoint holds the weights and the optimizer state after step 4, as torch's AdamW has them
    ref_half, _ = reference(form, STEPS_PER_EPOCH)
    weights = {n.removeprefix("net."): v for n, v in saved["state_dict"].items()}
    assert_same_params(weights, ref_half, exact=False, rtol=1e-6)
    (opt_state,) = saved["optimizer_states"]
    assert len(opt_state["state"]) == len(ref_half)
    assert all(s["step"].item() == STEPS_PER_EPOCH for s in opt_state["state"].values())
    for s, (n, w) in zip(opt_state["state"].values(), weights.items()):
        assert torch.equal(s["master_param"], w), n
    if form == "dict":
        assert saved["lr_schedulers"][0]["last_epoch"] == STEPS_PER_EPOCH
    # the resumed run (other init, fresh optimizer) ran only the second epoch and ends where the uninterrupted one does
    assert len(resumed.losses) == (STEPS - STEPS_PER_EPOCH) * ACCUMULATE
    assert resumed.losses == full.losses[SAMPLES // BATCH:]
    assert_same_params(params_of(resumed.net), params_of(full.net), exact=True)
    for key in ("step", "exp_avg", "exp_avg_sq", "master"):
        for p, q in zip(full.parameters(), resumed.parameters()):
            assert torch.equal(full.opt.state[p][key], resumed.opt.state[q][key]), key
    if form == "dict":
        assert resumed.opt.param_groups[0]["lr"] == full.opt.param_groups[0]["lr"]

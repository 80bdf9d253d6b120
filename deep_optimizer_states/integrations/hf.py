"""Hugging Face ``transformers.Trainer`` integration (needs ``transformers``; the core never imports this module).

Two ways in::

    from deep_optimizer_states.integrations.hf import DOSTrainer, optimizer_cls_and_kwargs

    # 1. the stock Trainer, told which optimizer class to build (it groups the params itself)
    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      optimizer_cls_and_kwargs=optimizer_cls_and_kwargs(args, schedule="auto"))

    # 2. a Trainer subclass whose create_optimizer builds DeepOptimizerStates
    trainer = DOSTrainer(model=model, args=args, train_dataset=ds,
                         dos_kwargs={"schedule": "auto", "subgroup_size": 25_000_000})

Both build ``DeepOptimizerStates`` over the Trainer's usual two param groups (weight decay ``args.weight_decay``
for weights, 0 for biases and norms), with ``lr=args.learning_rate``, ``betas=(args.adam_beta1,
args.adam_beta2)``, ``eps=args.adam_epsilon``. ``args.optim`` is ignored.

Notes:

- Clipping: the Trainer clips itself (``args.max_grad_norm``, through ``accelerator.clip_grad_norm_``, which is
  ``torch.nn.utils.clip_grad_norm_`` on the model's params; their grads are ordinary tensors, so this works), so
  ``max_grad_norm`` is not given to the optimizer, and passing it here while ``args.max_grad_norm > 0`` is
  refused (it would clip twice). With ``args.max_grad_norm=0`` you may pass it to let the optimizer clip instead.
  The optimizer still computes the global norm once per step for its inf/nan check, so a step costs one more
  norm pass than with ``torch.optim.AdamW``. A step with inf/nan gradients is skipped by the optimizer
  (``nonfinite="skip"``, the default; params and states unchanged) where torch's AdamW would write NaNs.
- dtypes: bf16 or fp32 params train under the Trainer (also fp32 params with ``args.bf16=True`` autocast).
  fp16 *params* cannot: their dynamic loss scaling needs ``opt.scale_loss(loss)``, which the Trainer never
  calls, and the first step raises. Use bf16 params, or fp32 params with autocast.
- Checkpoints: the Trainer's ``optimizer.pt`` is ``opt.state_dict()`` (torch's layout plus fp32 masters);
  ``resume_from_checkpoint`` restores it exactly. ``save_only_model`` checkpoints resume from the saved weights
  with a fresh optimizer, as with torch's AdamW.
- One process per device; Accelerate's FSDP plugin is not supported here: the Trainer builds the optimizer on
  the unsharded params and Accelerate then swaps them for the sharded ones, which the optimizer refuses at its
  first step. For FSDP2 shard the model yourself and use a plain training loop (see the README).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from transformers import Trainer, TrainingArguments

from ..optimizer import DeepOptimizerStates

__all__ = ["DOSTrainer", "grouped_parameters", "optimizer_cls_and_kwargs", "optimizer_kwargs"]


def optimizer_kwargs(args: TrainingArguments, **overrides: Any) -> dict[str, Any]:
    """The ``DeepOptimizerStates`` keyword arguments the TrainingArguments imply, updated with ``overrides``
    (``schedule``, ``subgroup_size``, ``cpu_threads``, ``nonfinite``, ...)."""
    kwargs: dict[str, Any] = {
        "lr": args.learning_rate,
        "betas": (args.adam_beta1, args.adam_beta2),
        "eps": args.adam_epsilon,
        "weight_decay": args.weight_decay,
    }
    if "params" in overrides or "model" in overrides:
        raise TypeError("the Trainer gives the params: do not pass params/model in the optimizer's kwargs")
    if overrides.get("stream_grads") and args.max_grad_norm:
        raise ValueError("stream_grads=True with the Trainer's own clipping (args.max_grad_norm > 0): the Trainer "
                         "clips the params' .grad, which streamed gradients leave empty. Use DOSTrainer (it moves "
                         "the clipping into the optimizer and marks the non-final micro-batches), or leave "
                         "stream_grads out")
    if overrides.get("max_grad_norm") is not None and args.max_grad_norm:
        raise ValueError(f"the Trainer already clips gradients to args.max_grad_norm={args.max_grad_norm}; passing "
                         "max_grad_norm to the optimizer would clip twice. Drop it, or set args.max_grad_norm=0 "
                         "to let the optimizer clip")
    kwargs.update(overrides)
    return kwargs


def optimizer_cls_and_kwargs(args: TrainingArguments, **overrides: Any) -> tuple[type, dict[str, Any]]:
    """``(DeepOptimizerStates, kwargs)`` for ``Trainer(..., optimizer_cls_and_kwargs=...)``.

    The Trainer calls ``DeepOptimizerStates(grouped_params, **kwargs)`` with its weight-decay / no-decay param
    groups; kwargs carry lr, betas, eps and weight_decay from ``args`` and ``overrides`` (optimizer options such
    as ``schedule="auto"`` or ``subgroup_size``). ``args.max_grad_norm`` is not passed: the Trainer clips.
    """
    if overrides.get("overlap"):
        raise ValueError("overlap=True needs the model (each module waits for its own params), which the stock "
                         "Trainer does not give its optimizer: use DOSTrainer(dos_kwargs={'overlap': True})")
    if overrides.get("stream_grads") and args.gradient_accumulation_steps > 1:
        raise ValueError("stream_grads=True with gradient_accumulation_steps > 1: the stock Trainer cannot mark the "
                         "micro-batches that are not the last (opt.accumulating()); use DOSTrainer, which does")
    return DeepOptimizerStates, optimizer_kwargs(args, **overrides)


def grouped_parameters(model: torch.nn.Module, decay_names: list[str] | set[str],
                       weight_decay: float) -> list[dict[str, Any]]:
    """The Trainer's two groups (decay, no decay) of trainable params, with names (for clearer errors).
    An empty group is left out."""
    decay_names = set(decay_names)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [(n, p) for n, p in named if n in decay_names], "weight_decay": weight_decay},
        {"params": [(n, p) for n, p in named if n not in decay_names], "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


class DOSTrainer(Trainer):
    """A ``transformers.Trainer`` whose optimizer is ``DeepOptimizerStates`` (AdamW, fp32 states in host memory).

    ``create_optimizer`` groups the params as the base class does (``get_decay_parameter_names``: weights
    decay with ``args.weight_decay``, biases and norms do not) and honours ``args.learning_rate``,
    ``adam_beta1/2``, ``adam_epsilon``; ``dos_kwargs`` goes to the constructor (``schedule``,
    ``subgroup_size``, ``cpu_threads``, ``nonfinite``, ...). ``args.optim`` is ignored. The Trainer clips
    gradients itself (``args.max_grad_norm``). Train bf16 or fp32 params: fp16 params need ``opt.scale_loss``,
    which the Trainer never calls.

    With ``dos_kwargs={"overlap": True}`` the update runs beside the next forward (the optimizer is given the
    model: each module waits for its own params; the Trainer's checkpoints read the model's state_dict,
    which waits for the update). With ``dos_kwargs={"stream_grads": True}`` the gradients of CPU-placed
    subgroups leave the GPU during the last micro-batch's backward: the backward of every other micro-batch
    runs under ``opt.accumulating()``, and clipping moves from the Trainer (which reads the params'
    ``.grad``) into the optimizer: ``args.max_grad_norm`` is given to it and set to 0 for the Trainer, and
    the ``grad_norm`` the Trainer logs is the optimizer's (the Trainer's own would read the ``.grad`` that
    streaming emptied, and scale them in place).
    """

    def __init__(self, *args: Any, dos_kwargs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if kwargs.get("optimizer_cls_and_kwargs") is not None:
            raise ValueError("DOSTrainer builds its own optimizer: pass dos_kwargs, not optimizer_cls_and_kwargs")
        self.dos_kwargs = dict(dos_kwargs or {})
        super().__init__(*args, **kwargs)
        if self.dos_kwargs.get("stream_grads") and self.args.max_grad_norm:
            if self.dos_kwargs.get("max_grad_norm") is not None:
                raise ValueError("pass max_grad_norm in TrainingArguments or in dos_kwargs, not both")
            self.dos_kwargs["max_grad_norm"] = self.args.max_grad_norm  # the optimizer sees streamed gradients
            self.args = copy.copy(self.args)  # the caller's args stay (replace() would rerun __post_init__)
            self.args.max_grad_norm = 0.0
        optimizer_kwargs(self.args, **self.dos_kwargs)  # refuse bad kwargs now, not at train()

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """The base training loop; with ``overlap``, the last update has ended when it returns."""
        try:
            return super().train(*args, **kwargs)
        finally:
            opt = _ours(self.optimizer)
            if opt is not None and opt.layout is not None:
                opt.synchronize()

    def training_step(self, model: torch.nn.Module, inputs: dict, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The base step; with ``stream_grads``, a micro-batch that is not the last of its accumulation
        backpropagates under ``opt.accumulating()`` (its gradients stay to be accumulated)."""
        opt = self._streams()
        if opt is None or self.accelerator.sync_gradients:
            return super().training_step(model, inputs, *args, **kwargs)
        with opt.accumulating():
            return super().training_step(model, inputs, *args, **kwargs)

    def _streams(self) -> DeepOptimizerStates | None:
        opt = _ours(self.optimizer)
        return opt if opt is not None and opt.grad_stream is not None else None

    def _get_grad_norm(self, model: torch.nn.Module, grad_norm: Any = None) -> Any:
        """The base class takes the norm over the params' ``.grad`` (``clip_grad_norm_`` to inf, which also
        scales them in place); with ``stream_grads`` those are partly gone: the optimizer's norm is logged
        instead (``_maybe_log_save_evaluate``), taken at its step."""
        if self._streams() is not None:
            return grad_norm
        return super()._get_grad_norm(model, grad_norm=grad_norm)

    def _maybe_log_save_evaluate(self, tr_loss: Any, grad_norm: Any, *args: Any, **kwargs: Any) -> Any:
        """With ``stream_grads``, the step's global gradient norm as the optimizer took it."""
        opt = self._streams()
        if opt is not None and opt.last_grad_norm is not None:
            grad_norm = opt.last_grad_norm
        return super()._maybe_log_save_evaluate(tr_loss, grad_norm, *args, **kwargs)

    def create_optimizer(self, model: torch.nn.Module | None = None) -> torch.optim.Optimizer:
        if self.optimizer is None:
            opt_model = self.model if model is None else model
            groups = grouped_parameters(opt_model, self.get_decay_parameter_names(opt_model), self.args.weight_decay)
            kwargs = optimizer_kwargs(self.args, **self.dos_kwargs)
            self.optimizer = DeepOptimizerStates(groups, model=opt_model, **kwargs)
        return self.optimizer


def _ours(opt: Any) -> DeepOptimizerStates | None:
    """The DeepOptimizerStates inside Accelerate's AcceleratedOptimizer (or None)."""
    while opt is not None and not isinstance(opt, DeepOptimizerStates):
        opt = getattr(opt, "optimizer", None)
    return opt

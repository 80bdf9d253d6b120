"""`dos train`: real training on the standard library's source, run as a user would (a subprocess of
`python -m deep_optimizer_states`), exact resume from a checkpoint, `dos check`, and option errors."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deep_optimizer_states.tools.data import TokenData, load_text_data
from tests.harness import needs_compiler

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["--hidden", "64", "--layers", "1", "--seq", "32", "--micro-batch", "8", "--data-mb", "1",
         "--eval-batches", "2", "--sample-tokens", "16", "--no-progress"]


def dos(*args, cache=None, check=True, threads: str | None = "2") -> subprocess.CompletedProcess:
    """Run the CLI in a fresh process, on ``threads`` OpenMP threads (None: this process's environment)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if threads is not None:
        env["OMP_NUM_THREADS"] = threads
    if cache is not None:
        env["DOS_CACHE_DIR"] = str(cache)
    run = subprocess.run([sys.executable, "-m", "deep_optimizer_states", *args], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=120)
    if check:
        assert run.returncode == 0, f"dos {' '.join(args)} failed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    return run


def test_train_loss_falls_and_reports_a_summary(tmp_path):
    summary_file = tmp_path / "summary.json"
    run = dos("train", *SMALL, "--steps", "30", "--lr", "1e-2", "--eval-every", "15",
              "--summary-json", str(summary_file), cache=tmp_path)
    summary = json.loads(summary_file.read_text())
    losses = [loss for _, loss in summary["losses"]]
    assert [s for s, _ in summary["losses"]] == list(range(1, 31))
    assert 5.0 < losses[0] < 6.0, "an untrained byte-level model starts near ln(256) = 5.55"
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0, losses
    assert summary["final_eval_loss"] < losses[0] - 1.0
    assert [s for s, _ in summary["evals"]] == [15, 30]
    assert summary["tokens_per_s"] > 0 and abs(sum(summary["time_split"].values()) - 1) < 1e-9
    assert summary["run"]["vocab"] == 256 and summary["sample"].startswith("def ")
    assert "done: steps 1-30" in run.stdout and "tokens/s" in run.stdout and "sample (top-8" in run.stdout


def test_resumed_run_continues_the_same_loss_curve_exactly(tmp_path):
    common = [*SMALL, "--steps", "6", "--accum", "2", "--eval-every", "0", "--sample-tokens", "0"]
    full_dir, resumed_dir = tmp_path / "full", tmp_path / "resumed"
    dos("train", *common, "--checkpoint-dir", str(full_dir), "--checkpoint-every", "3", "--keep-checkpoints", "5",
        "--summary-json", str(tmp_path / "full.json"), cache=tmp_path)
    full = json.loads((tmp_path / "full.json").read_text())
    # the run "interrupted" after step 3: only its step-3 checkpoint exists
    resumed_dir.mkdir()
    shutil.copytree(full_dir / "step-000000003", resumed_dir / "step-000000003")
    run = dos("train", *common, "--checkpoint-dir", str(resumed_dir), "--resume",
              "--summary-json", str(tmp_path / "resumed.json"), cache=tmp_path)
    resumed = json.loads((tmp_path / "resumed.json").read_text())
    assert "resumed from" in run.stdout and resumed["start_step"] == 3
    assert resumed["losses"] == full["losses"][3:], "steps 4-6 must repeat the uninterrupted run bit for bit"
    assert resumed["final_eval_loss"] == full["final_eval_loss"]


def test_a_rerun_into_the_same_folder_saves_each_step_once(tmp_path):
    """A restarted job (no --resume) into a folder that already has its step names: the new checkpoints get
    a suffix, and the last step is still saved once (a second copy would push step 2 out of --keep 2)."""
    common = [*SMALL, "--steps", "4", "--eval-every", "0", "--sample-tokens", "0", "--checkpoint-dir",
              str(tmp_path / "ck"), "--checkpoint-every", "2"]
    for run in ("first", "second"):
        dos("train", *common, "--summary-json", str(tmp_path / f"{run}.json"), cache=tmp_path)
    saved = json.loads((tmp_path / "second.json").read_text())["checkpoints"]
    assert [Path(p).name.split(".")[0] for p in saved] == ["step-000000002", "step-000000004"], saved


def test_resume_refuses_a_checkpoint_of_another_run(tmp_path):
    common = [*SMALL, "--steps", "2", "--eval-every", "0", "--sample-tokens", "0", "--checkpoint-dir", str(tmp_path)]
    dos("train", *common, cache=tmp_path)
    run = dos("train", *common, "--seq", "16", "--steps", "4", "--resume", cache=tmp_path, check=False)
    assert run.returncode == 2 and "different run" in run.stderr and "seq" in run.stderr


def test_resume_with_more_steps_keeps_the_runs_own_warmup(tmp_path):
    """The warm-up derived from --steps (steps // 10) is the checkpoint's on a resume asking for more steps:
    not a reason to refuse it."""
    common = [*SMALL, "--eval-every", "0", "--sample-tokens", "0", "--checkpoint-dir", str(tmp_path)]
    dos("train", *common, "--steps", "10", "--checkpoint-every", "10", cache=tmp_path)
    run = dos("train", *common, "--steps", "20", "--resume", cache=tmp_path)
    assert "resumed from" in run.stdout and "warm-up 1," in run.stdout and "now spans 20 steps" in run.stdout


def test_check_is_the_old_self_check(tmp_path):
    run = dos("check", "--steps", "2", cache=tmp_path)
    assert "step   2" in run.stdout and "matches torch.optim.AdamW on fp32 masters" in run.stdout


@pytest.mark.parametrize("args,message", [
    (["--steps", "0"], "argument --steps: must be an integer >= 1"),
    (["--lr", "-1"], "argument --lr: must be > 0"),
    (["--schedule", "sometimes"], "argument --schedule"),
    (["--preset", "huge"], "argument --preset: invalid choice"),
    (["--min-lr-ratio", "2"], "argument --min-lr-ratio: must be between 0 and 1"),
    (["--resume"], "--resume needs --checkpoint-dir"),
    (["--checkpoint-every", "5"], "--checkpoint-every needs --checkpoint-dir"),
    (["--prefetch"], "--prefetch needs --stream-grads"),
    (["--prefetch", "release"], "--prefetch needs --stream-grads"),
    (["--stream-grads", "--prefetch", "hold"], "argument --prefetch: invalid choice"),
    (["--speculate", "--overlap"], "--speculate needs --stream-grads"),
    (["--hidden", "100"], "--hidden must be a multiple of 64"),
    (["--data", "/nonexistent/file.txt"], "data:"),
    (["--model", "/nonexistent/model"], "--model /nonexistent/model: not a directory"),
])
def test_bad_options_are_argparse_errors(args, message, capsys):
    from deep_optimizer_states.tools.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--no-progress", *args])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_batches_depend_on_the_step_alone_and_eval_is_held_out():
    data = load_text_data(None, seq=32, micro_batch=4, seed=3, limit_mb=0.25)
    again = load_text_data(None, seq=32, micro_batch=4, seed=3, limit_mb=0.25)
    assert data.fingerprint == again.fingerprint
    assert torch.equal(data.batch(7, 1), again.batch(7, 1)) and not torch.equal(data.batch(7, 0), data.batch(8, 0))
    assert data.batch(7, 0).shape == (4, 33) and data.batch(7, 0).dtype == torch.int64
    total = len(data.train) + len(data.held_out)
    assert len(data.train) == int(total * 0.95), "the last 5% is held out"
    text = TokenData.from_bytes(b"abc" * 100, seq=8, micro_batch=2)
    assert text.decode(text.encode("h\u00e9")) == "h\u00e9" and text.decode([0xff]) == "\ufffd"


def test_trains_a_local_hugging_face_model_directory_on_your_files(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1,
                      intermediate_size=128, vocab_size=300)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "model")  # no tokenizer there: bytes
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog\n" * 200)
    summary_file = tmp_path / "summary.json"
    dos("train", "--model", str(tmp_path / "model"), "--data", str(text), "--seq", "32", "--micro-batch", "4",
        "--steps", "3", "--eval-batches", "1", "--sample-tokens", "4", "--no-progress",
        "--summary-json", str(summary_file), cache=tmp_path)
    summary = json.loads(summary_file.read_text())
    assert summary["run"]["vocab"] == 300 and len(summary["losses"]) == 3


def _word_tokenizer(directory, words: list[str]) -> None:
    """A word-level Hugging Face tokenizer saved into ``directory`` (built offline with ``tokenizers``)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "</s>": 1, **{w: i + 2 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="</s>").save_pretrained(directory)


def test_trains_with_the_model_directorys_own_tokenizer_and_refuses_one_that_does_not_load(tmp_path):
    """The directory's tokenizer encodes the data (the sample decodes to its words, not bytes); a tokenizer
    file that does not load is an error, never a silent fall-back to bytes."""
    from transformers import LlamaConfig, LlamaForCausalLM

    words = "the quick brown fox jumps over lazy dog".split()
    cfg = LlamaConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1,
                      intermediate_size=128, vocab_size=16)  # under the 256 byte ids: bytes would be refused
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "model")
    _word_tokenizer(tmp_path / "model", words)
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog\n" * 200)
    args = ["train", "--model", str(tmp_path / "model"), "--data", str(text), "--seq", "16", "--micro-batch", "4",
            "--steps", "2", "--eval-batches", "1", "--sample-tokens", "6", "--no-progress"]
    dos(*args, "--summary-json", str(tmp_path / "summary.json"), cache=tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["run"]["vocab"] == 16 and len(summary["losses"]) == 2
    assert set(summary["sample"].split()) <= {*words, "[UNK]", "</s>"}, summary["sample"]
    (tmp_path / "model" / "tokenizer.json").write_text("{not json")
    run = dos(*args, cache=tmp_path, check=False)
    assert run.returncode == 2 and "its tokenizer does not load" in run.stderr, run.stderr[-2000:]


def test_stream_grads_and_overlap_train_the_same_curve(tmp_path):
    """--stream-grads sends the gradients down during backward (the last micro-batch of each step), and
    --overlap leaves each update running beside the next forward: on the CPU the same fp32 operations, so
    the same losses, bit for bit."""
    common = [*SMALL, "--steps", "4", "--accum", "2", "--eval-every", "0", "--sample-tokens", "0"]
    dos("train", *common, "--summary-json", str(tmp_path / "plain.json"), cache=tmp_path)
    dos("train", *common, "--stream-grads", "--summary-json", str(tmp_path / "stream.json"), cache=tmp_path)
    plain, stream = (json.loads((tmp_path / f).read_text()) for f in ("plain.json", "stream.json"))
    assert stream["losses"] == plain["losses"] and stream["final_eval_loss"] == plain["final_eval_loss"]
    dos("train", *common, "--overlap", "--summary-json", str(tmp_path / "overlap.json"), cache=tmp_path)
    overlap = json.loads((tmp_path / "overlap.json").read_text())
    assert overlap["losses"] == plain["losses"] and overlap["final_eval_loss"] == plain["final_eval_loss"]
    for value in ([], ["release"]):
        dos("train", *common, "--stream-grads", "--prefetch", *value, "--summary-json", str(tmp_path / "prefetch.json"),
            cache=tmp_path)  # no GPU memory to fill here: the flag reaches the optimizer, the curve stays
        prefetch = json.loads((tmp_path / "prefetch.json").read_text())
        assert prefetch["losses"] == plain["losses"]
    dos("train", *common, "--stream-grads", "--speculate", "--overlap", "--summary-json",
        str(tmp_path / "speculate.json"), cache=tmp_path)
    speculate = json.loads((tmp_path / "speculate.json").read_text())
    assert speculate["losses"] == plain["losses"] and speculate["final_eval_loss"] == plain["final_eval_loss"]


def test_a_model_built_on_the_meta_device_is_made_whole_with_its_ties_biases_and_rotary_buffers():
    """tools/models.py's materialize, as `dos train` uses it: tied weights stay one Parameter, biases 0,
    norm weights 1, the rest N(0, initializer_range), rotary buffers computed (a meta model has none), and
    the same values as a second materialisation with the same seed."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from deep_optimizer_states.tools.models import materialize

    cfg = LlamaConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1,
                      intermediate_size=128, vocab_size=100, tie_word_embeddings=True, attention_bias=True)
    models = []
    for _ in range(2):
        with torch.device("meta"):
            models.append(materialize(LlamaForCausalLM(cfg), "cpu", seed=3))
    model = models[0]
    assert model.lm_head.weight is model.model.embed_tokens.weight
    for name, p in model.named_parameters():
        assert not p.is_meta and torch.equal(p, dict(models[1].named_parameters())[name]), name
        if name.endswith(".bias"):
            assert torch.all(p == 0), name
        elif name.endswith("norm.weight"):
            assert torch.all(p == 1), name
        else:
            assert abs(float(p.detach().std()) - cfg.initializer_range) < 0.2 * cfg.initializer_range, name
    assert all(not b.is_meta and torch.isfinite(b).all() for b in model.buffers())
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(0))
    assert 4.0 < float(model(input_ids=ids, labels=ids).loss.detach()) < 5.2, "near ln(100) = 4.6 untrained"


def test_a_model_read_shard_by_shard_equals_the_saved_one_and_bad_directories_are_refused(tmp_path):
    """tools/models.py's materialize with ``weights``: the params and persistent buffers equal the saved
    model's; a directory without safetensors, or one missing params of the model, is refused by name."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from deep_optimizer_states.tools.models import materialize

    def config(layers):
        return LlamaConfig(hidden_size=64, num_hidden_layers=layers, num_attention_heads=1, num_key_value_heads=1,
                           intermediate_size=128, vocab_size=100)

    torch.manual_seed(0)
    saved = LlamaForCausalLM(config(2))
    saved.save_pretrained(tmp_path / "st", max_shard_size="50KB")
    (tmp_path / "bin").mkdir()  # a model saved otherwise (pytorch_model.bin): no safetensors here
    torch.save(saved.state_dict(), tmp_path / "bin" / "pytorch_model.bin")
    with torch.device("meta"):
        model = LlamaForCausalLM(config(2))
    materialize(model, "cpu", weights=tmp_path / "st")
    for (name, p), q in zip(model.named_parameters(), saved.parameters()):
        assert torch.equal(p, q), name
    for name, b in model.named_buffers():
        assert torch.equal(b, dict(saved.named_buffers())[name]), name
    with torch.device("meta"):
        bigger = LlamaForCausalLM(config(3))
    with pytest.raises(ValueError, match="not in its checkpoint"):
        materialize(bigger, "cpu", weights=tmp_path / "st")
    wider = config(2)
    wider.vocab_size = 101  # one row more than the file's: refused, not broadcast
    with torch.device("meta"):
        wider = LlamaForCausalLM(wider)
    with pytest.raises(ValueError, match="shape"):
        materialize(wider, "cpu", weights=tmp_path / "st")
    with torch.device("meta"):
        model = LlamaForCausalLM(config(2))
    with pytest.raises(FileNotFoundError, match="safetensors"):
        materialize(model, "cpu", weights=tmp_path / "bin")


@needs_compiler
def test_the_bf16_cpu_path_trains_the_same_losses(tmp_path):
    """bf16 params on the CPU path, with and without --bf16-cpu-path (clipped, accumulated): the same losses."""
    common = [*SMALL, "--dtype", "bf16", "--schedule", "cpu", "--steps", "5", "--accum", "2", "--eval-every", "0",
              "--sample-tokens", "0", "--max-grad-norm", "0.5"]
    for name, flag in (("plain", []), ("lean", ["--bf16-cpu-path"])):
        dos("train", *common, *flag, "--summary-json", str(tmp_path / f"{name}.json"), cache=tmp_path)
    plain, lean = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("plain", "lean"))
    assert lean["losses"] == plain["losses"] and len(plain["losses"]) == 5
    assert (plain["run"]["bf16_cpu_path"], lean["run"]["bf16_cpu_path"]) == (False, True)  # the kernel ran

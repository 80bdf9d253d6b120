"""FSDP2 on NCCL with real CUDA streams: every step equals a single-process torch.optim.AdamW (2 GPUs)."""

import pytest
import torch

from tests.test_fsdp2 import check_peer_built_the_same, torchrun

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]


@pytest.mark.parametrize("schedule", ["cpu", "2", "gpu", "auto", "offload"])
def test_fsdp2_on_two_gpus_matches_adamw(schedule):
    out = torchrun(2, "train", "--steps", "8", "--schedule", schedule, "--device", "cuda")
    assert out.count("8 steps equal torch AdamW") == 2


def test_dcp_resharding_on_gpus(tmp_path):
    common = ["--ckpt", str(tmp_path / "ckpt"), "--out", str(tmp_path), "--device", "cuda"]
    torchrun(2, "save", *common)
    torchrun(1, "load", *common)
    torchrun(2, "load", *common)
    a = torch.load(tmp_path / "uninterrupted_2.pt")
    assert all(torch.equal(x, y) for x, y in zip(a, torch.load(tmp_path / "resumed_2.pt")))
    for x, y in zip(a, torch.load(tmp_path / "resumed_1.pt")):
        torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("schedule", ["cpu", "mixed"])
def test_streamed_gradients_under_fsdp2_on_two_gpus(schedule):
    """The post-accumulate-grad hooks run by FSDP2's reduce-scatter (on its own stream), gradients copied on
    ours: equal to torch AdamW and bit for bit to the unstreamed run."""
    out = torchrun(2, "train", "--steps", "6", "--schedule", schedule, "--stream", "--device", "cuda")
    assert out.count("6 steps equal torch AdamW") == 2 and out.count("equal bit for bit") == 2


def test_states_filled_ahead_under_fsdp2_on_two_gpus():
    """prefetch=True: the fills start from the hooks FSDP2 runs on its reduce-scatter stream; bit for bit
    the run without, and equal to torch AdamW."""
    out = torchrun(2, "train", "--steps", "6", "--schedule", "mixed", "--stream", "--fill-ahead", "--device", "cuda")
    assert out.count("6 steps equal torch AdamW") == 2 and out.count("equal bit for bit") == 2
    assert out.count("staged subgroups filled during backward") == 2


def test_mixed_precision_policy_on_two_gpus():
    out = torchrun(2, "mixed_precision", "--steps", "4", "--schedule", "mixed", "--device", "cuda")
    assert out.count("4 mixed-precision steps equal torch AdamW") == 2


@pytest.mark.parametrize("stream", [False, True], ids=["gathered", "streamed"])
def test_an_inf_on_one_gpu_skips_the_step_on_both(stream):
    out = torchrun(2, "nonfinite", "--steps", "5", "--schedule", "mixed", *(["--stream"] if stream else []),
                   "--device", "cuda")
    assert out.count("skipped the poisoned step with the others, 4 steps equal torch AdamW") == 2


@pytest.mark.parametrize("schedule,stream", [("mixed", False), ("2", True)])
def test_overlap_under_fsdp2_on_two_gpus(schedule, stream):
    """overlap=True: each fully_shard unit's all-gather (on FSDP2's own streams) waits on the host for the
    writes of its shards; bit for bit against the synchronous update, with AdamW slowed down."""
    out = torchrun(2, "overlap", "--steps", "4", "--schedule", schedule, *(["--stream"] if stream else []),
                   "--device", "cuda")
    assert out.count("overlapped, 4 steps equal the synchronous run bit for bit") == 2


def test_the_benchmark_fsdp2_peer_from_the_meta_device_on_gpus(tmp_path):
    """bench's FSDP2 + CPUOffloadPolicy peer on NCCL (shards pinned on the host by FSDP2, rotary buffers on
    the GPU), built from the meta device on 1 and 2 GPUs: the same model both times, and it trains."""
    check_peer_built_the_same(tmp_path, (1, 2), "--device", "cuda")

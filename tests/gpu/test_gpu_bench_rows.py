"""The bench's result row on a GPU: what it records about the process beside the times (bench/run_system.py)."""

import pytest
import torch

from bench import run_system

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_row_on_the_gpu_counts_the_allocators_driver_calls_and_names_the_openmp_runtimes():
    row = run_system.run("ours_offload_overlap_spec_prefetch_bf16", "tiny", None, iters=3, warmup=2, micro_batch=1,
                         seq=16, device=torch.device("cuda"))
    assert row["status"] == "ok", row.get("traceback")
    calls = row["allocator_calls"]
    assert {"cudaMalloc", "cudaFree", "retries"} <= set(calls) and all(v >= 0 for v in calls.values()), calls
    reserved = row["reserved_gpu_GB"]  # held from the driver at the timed loop's start and end
    assert 0 < reserved["start"] <= torch.cuda.get_device_properties(0).total_memory / 1e9, reserved
    if calls["cudaFree"] == 0:  # nothing given back: what the allocator holds can only have grown
        assert reserved["end"] >= reserved["start"], (reserved, calls)
    assert row["openmp_runtimes"], "torch's intra-op threads run on an OpenMP runtime, mapped by now"
    # the loop's peak so far after each iteration (the uncounted first one first): never falling, and no higher
    # than the loop's peak read after it (the last update may still allocate past the last read)
    so_far = row["peak_so_far_gpu_GB"]
    assert len(so_far) == 3 + 1 and so_far == sorted(so_far) and so_far[0] > 0, so_far
    assert so_far[-1] <= row["free_peak_gpu_GB"] + 0.005 and row["peak_gpu_GB"] >= row["free_peak_gpu_GB"]

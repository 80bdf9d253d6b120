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
    # the allocator's peak read and reset after each iteration of the timed loop: one per counted iteration,
    # the loop's own peak their highest, the run's no lower than the loop's or the synchronised phases'
    counted, first = row["iter_peak_gpu_GB"], row["first_peak_gpu_GB"]
    assert len(counted) == 3 and min(counted) > 0 and first > 0, row
    assert row["free_peak_gpu_GB"] == round(max(first, *counted), 2)
    assert row["peak_gpu_GB"] >= max(row["free_peak_gpu_GB"], row["phases_peak_gpu_GB"]) - 0.005

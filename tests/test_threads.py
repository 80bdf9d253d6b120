"""The CPU path's default thread count: per local rank, and one core left to the GPU's driving thread."""

import pytest
import torch

from deep_optimizer_states.core import ranks
from deep_optimizer_states.core.ranks import cpu_threads_per_rank


@pytest.fixture
def host(monkeypatch):
    """A host of 16 cores whose torch runs 16 threads, started without a launcher."""
    monkeypatch.setattr(ranks, "host_cores", lambda: 16)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 16)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    return monkeypatch


def test_one_process_leaves_one_core_to_the_gpu_thread(host):
    assert cpu_threads_per_rank(None, gpu=True) == 15
    assert cpu_threads_per_rank(None, gpu=False) is None  # the CPU-only pipeline runs on the caller's threads


def test_a_thread_count_below_the_cores_is_kept(host):
    host.setattr(torch, "get_num_threads", lambda: 8)  # the user's OMP_NUM_THREADS or set_num_threads
    assert cpu_threads_per_rank(None, gpu=True) is None


def test_local_ranks_split_the_cores_and_each_leaves_one(host):
    host.setenv("LOCAL_WORLD_SIZE", "2")
    assert cpu_threads_per_rank(None, gpu=True) == 7
    assert cpu_threads_per_rank(None, gpu=False) == 8
    host.setenv("LOCAL_WORLD_SIZE", "32")
    assert cpu_threads_per_rank(None, gpu=True) == 1


def test_an_explicit_count_wins_and_a_bad_one_is_refused(host):
    assert cpu_threads_per_rank(16, gpu=True) == 16
    for bad in (0, -1, 2.0, True, "4"):
        with pytest.raises(ValueError, match="cpu_threads must be an int >= 1"):
            cpu_threads_per_rank(bad, gpu=True)


def test_a_one_core_host_keeps_one_thread(host):
    host.setattr(ranks, "host_cores", lambda: 1)
    host.setattr(torch, "get_num_threads", lambda: 1)
    assert cpu_threads_per_rank(None, gpu=True) is None


def test_the_engines_worker_starts_on_its_creators_thread_count_not_the_last_one_set_elsewhere():
    """Torch gives a new thread the thread count that any thread set last, not its creator's: a CPU worker
    started plainly after another thread set one would run the CPU path on one (as an engine's after another
    engine's ``set_cpu_threads(1)``). ``engine.start_worker`` gives it its creator's count."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from deep_optimizer_states.core.engine import start_worker

    before = torch.get_num_threads()
    torch.set_num_threads(2)  # the creating thread's count
    try:
        other = threading.Thread(target=torch.set_num_threads, args=(1,))
        other.start()
        other.join()
        assert torch.get_num_threads() == 2, "another thread's count is its own"
        with ThreadPoolExecutor(1) as plain:
            assert plain.submit(torch.get_num_threads).result() == 1, "a new thread takes the last count set"
        with ThreadPoolExecutor(1, initializer=start_worker, initargs=(torch.device("cpu"), 2)) as worker:
            assert worker.submit(torch.get_num_threads).result() == 2
    finally:
        torch.set_num_threads(before)

"""Host buffers: sizes, zero-fill, the page-aligned chunks they are faulted in and registered by, the
capacity check and the progress bar's threshold. CPU only and fast, except the GPU-marked pinning tests."""

import contextlib
import gc
import threading
import weakref

import pytest
import torch

from deep_optimizer_states import DeepOptimizerStates
from deep_optimizer_states.core import host_memory as hm
from deep_optimizer_states.core.host_memory import HostSpec
from tests.harness import loss_of, mlp

PAGE = hm.PAGE_BYTES
ODD_SIZES = [0, 1, 2, PAGE - 1, PAGE, PAGE + 1, 3 * PAGE - 1, 17 * PAGE + 5, 1000 * PAGE + 3]


def _assert_tiles(chunks, numel):
    """Chunks cover [0, numel) exactly once, in order, none empty."""
    if numel == 0:
        assert chunks == []
        return
    assert chunks[0][0] == 0 and chunks[-1][1] == numel
    for (s0, e0), (s1, _) in zip(chunks, chunks[1:]):
        assert e0 == s1
    assert all(e > s for s, e in chunks)


@pytest.mark.parametrize("element_size", [1, 2, 4, 8])
@pytest.mark.parametrize("offset", [0, 64, PAGE - 8])  # where in its page the buffer starts
@pytest.mark.parametrize("chunk_bytes", [1, PAGE, 3 * PAGE, 3 * PAGE + 100, 1 << 20])
@pytest.mark.parametrize("numel_bytes", ODD_SIZES)
def test_page_chunks_cover_the_range_once_with_page_aligned_cuts(element_size, offset, chunk_bytes, numel_bytes):
    ptr = 0x7F0000000000 + offset
    numel = numel_bytes // element_size + (numel_bytes % element_size > 0)
    chunks = hm.page_chunks(ptr, numel, element_size, chunk_bytes)
    _assert_tiles(chunks, numel)
    step = max(PAGE, chunk_bytes // PAGE * PAGE)
    for s, _ in chunks[1:]:
        assert (ptr + s * element_size) % PAGE == 0  # every inner cut on a page boundary
    for s, e in chunks[1:-1]:
        assert (e - s) * element_size == step  # middle chunks are exactly one step
    if chunks:
        assert (chunks[0][1] - chunks[0][0]) * element_size < step + PAGE


def test_page_chunks_refuse_elements_that_do_not_tile_pages():
    with pytest.raises(ValueError):
        hm.page_chunks(0x1002, 10, 4, PAGE)


@pytest.mark.parametrize("nbytes", [0, 1, PAGE, 10 * 2**20, 83 * 10**9])
def test_chunk_size_is_whole_pages_and_bounded(nbytes):
    c = hm.chunk_bytes_for(nbytes)
    assert c % PAGE == 0 and PAGE <= c <= max(hm.MAX_CHUNK_BYTES, PAGE)


@pytest.mark.parametrize("numel", [0, 1, PAGE // 4 - 1, PAGE // 4 + 1, 3_000_001])
def test_buffer_chunks_of_real_tensors_tile_them(numel):
    t = torch.empty(numel, dtype=torch.float32)
    chunks = hm.buffer_chunks(t)
    _assert_tiles(chunks, numel)
    for s, _ in chunks[1:]:
        assert (t.data_ptr() + 4 * s) % PAGE == 0


def test_host_empty_many_sizes_dtypes_and_zero_fill(monkeypatch):
    monkeypatch.setattr(hm, "MIN_CHUNK_BYTES", PAGE)  # many chunks even for small buffers
    specs = [HostSpec(3_000_001, torch.float32), HostSpec(5, torch.bfloat16), HostSpec(0, torch.float32),
             HostSpec(PAGE + 1, torch.float64, zero=False), HostSpec(1_234_567, torch.int8)]
    tensors = hm.host_empty_many(specs, pin=False)
    assert len(tensors) == len(specs)
    for t, s in zip(tensors, specs):
        assert t.shape == (s.numel,) and t.dtype == s.dtype and t.device.type == "cpu" and t.is_contiguous()
        if s.zero:
            assert not t.any()
    assert len({t.data_ptr() for t in tensors if t.numel()}) == 4  # distinct buffers


def test_host_empty_many_zero_fills_reused_memory():
    """Freed memory can come back dirty from the allocator; zero means zero, not 'fresh pages'."""
    dirty = torch.full((1 << 16,), 7.0)
    del dirty
    (t,) = hm.host_empty_many([HostSpec(1 << 16, torch.float32)], pin=False)
    assert not t.any()


def test_host_empty_keeps_its_signature():
    t = hm.host_empty(PAGE + 3, torch.float32, False)
    assert t.shape == (PAGE + 3,) and t.dtype == torch.float32 and not t.is_pinned()


def test_specs_may_be_plain_tuples():
    a, b = hm.host_empty_many([(10, torch.float32), (7, torch.bfloat16, False)], pin=False)
    assert a.numel() == 10 and b.dtype == torch.bfloat16 and not a.any()


def test_host_bytes_counts_every_buffer():
    specs = [HostSpec(100, torch.float32), HostSpec(100, torch.bfloat16), HostSpec(3, torch.float64, False)]
    assert hm.host_bytes(specs) == 400 + 200 + 24


def test_parallel_chunks_runs_every_chunk_once_in_several_threads(monkeypatch):
    monkeypatch.setattr(hm, "MIN_CHUNK_BYTES", PAGE)
    monkeypatch.setattr(hm, "INLINE_BYTES", 0)
    (t,) = hm.host_empty_many([HostSpec(2_000_003, torch.float32, zero=False)], pin=False)
    src = torch.arange(t.numel(), dtype=torch.bfloat16)
    seen, threads = [], set()

    def fn(s: int, e: int) -> None:
        threads.add(threading.get_ident())
        seen.append((s, e))
        t[s:e].copy_(src[s:e])

    hm.parallel_chunks(t, fn)
    _assert_tiles(sorted(seen), t.numel())
    assert sorted(seen) == hm.buffer_chunks(t)
    assert torch.equal(t, src.float())
    assert threading.get_ident() not in threads  # ran in the pool


def test_small_totals_run_inline_without_a_pool(monkeypatch):
    monkeypatch.setattr(hm, "_pool", lambda: pytest.fail("a pool for a small allocation"))
    (t,) = hm.host_empty_many([HostSpec(1000, torch.float32)], pin=False)
    assert not t.any()


def test_parallel_chunks_reraises_errors():
    t = torch.empty(10)

    def fn(s, e):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        hm.parallel_chunks(t, fn)


def test_capacity_check_names_needed_and_available(monkeypatch):
    monkeypatch.setenv(hm.HOST_MEMORY_ENV, "1.5")
    with pytest.raises(MemoryError, match=r"the states: 2\.00 GB needed, 1\.50 GB available"):
        hm.check_host_capacity(2 * 10**9, "the states")
    assert hm.check_host_capacity(10**9, "the states") == 1.5e9


def test_host_empty_many_checks_capacity_for_the_total_before_allocating(monkeypatch):
    monkeypatch.setenv(hm.HOST_MEMORY_ENV, "0.000001")  # 1000 bytes
    hm.host_empty_many([HostSpec(250, torch.float32)], pin=False)  # exactly fits
    with pytest.raises(MemoryError, match=r"0\.00 GB needed"):
        hm.host_empty_many([HostSpec(200, torch.float32), HostSpec(200, torch.float32)], pin=False)


def test_progress_only_for_big_allocations_that_ask_for_it():
    assert not hm.progress_enabled(10**6, "states")
    assert not hm.progress_enabled(hm.PROGRESS_MIN_BYTES - 1, "states")
    assert not hm.progress_enabled(10**12, None)
    assert hm.progress_enabled(hm.PROGRESS_MIN_BYTES, "states")
    assert isinstance(hm._progress_bar(10**6, "states"), hm._NoBar)


def test_progress_bar_falls_back_silently_without_tqdm(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_tqdm(name, *args, **kwargs):
        if name.startswith("tqdm"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tqdm)
    bar = hm._progress_bar(10**13, "states")
    assert isinstance(bar, hm._NoBar)
    bar.update(5)
    bar.close()


def test_pageable_path_never_touches_cuda(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("touched torch.cuda")

    monkeypatch.setattr(torch.cuda, "cudart", boom)
    monkeypatch.setattr(torch.cuda, "init", boom)
    monkeypatch.setattr(torch.cuda, "set_device", boom)
    hm.host_empty_many([HostSpec(1_000_000, torch.float32), HostSpec(10, torch.float32, False)], pin=False)


@pytest.mark.parametrize("numel", [1, PAGE // 4 + 1, 50_000_001])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pinned_buffers_are_pinned_and_copies_across_chunk_cuts_work(numel, monkeypatch):
    monkeypatch.setattr(hm, "MIN_CHUNK_BYTES", PAGE)  # many chunks, many cuts to cross
    master, m = hm.host_empty_many([HostSpec(numel, torch.float32, zero=False), HostSpec(numel, torch.float32)],
                                   pin=True)
    assert master.is_pinned() and m.is_pinned() and not m.any()
    src = torch.randn(numel, device="cuda")
    hm.parallel_chunks(master, lambda s, e: master[s:e].copy_(src[s:e]))
    assert torch.equal(master, src.cpu())
    # one copy over the whole buffer spans every chunk cut, both ways
    back = torch.empty_like(src)
    back.copy_(master, non_blocking=True)
    m.copy_(back, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back, src) and torch.equal(m, master)
    for s, _ in hm.buffer_chunks(master)[1:]:
        assert master[s - 1 : s + 1].is_pinned()  # a view across a cut is still pinned memory


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_each_buffer_is_one_registration(monkeypatch):
    """Faulted in by chunks, registered whole: one unregister of the start pointer unpins all of it (what the
    finalizer does), so no copy ever spans two registrations."""
    monkeypatch.setattr(hm, "MIN_CHUNK_BYTES", PAGE)
    (t,) = hm.host_empty_many([HostSpec(10_000_000, torch.float32)], pin=True)
    assert len(hm.buffer_chunks(t)) > 1
    cudart = torch.cuda.cudart()
    assert int(cudart.cudaHostUnregister(t.data_ptr())) == 0
    assert not t.is_pinned()
    assert int(cudart.cudaHostRegister(t.data_ptr(), 4 * t.numel(), 0)) == 0  # for the finalizer
    assert t.is_pinned()


@pytest.mark.parametrize("value,expected", [("inf", None), ("2", 2 * hm.GB), ("-1", ValueError), ("x", ValueError)])
def test_host_memory_override_values(value, expected, monkeypatch):
    monkeypatch.setenv(hm.HOST_MEMORY_ENV, value)
    if expected is ValueError:
        with pytest.raises(ValueError, match=hm.HOST_MEMORY_ENV):
            hm.available_host_bytes()
    else:
        assert hm.available_host_bytes() == expected


def test_a_failed_pinning_fallback_unregisters_the_buffers_registered_before(monkeypatch):
    """When one buffer's registration fails and torch's pinned allocator cannot take it either, the buffers
    registered already are unregistered with their tensors (no pages left locked), and the error says what
    to change."""
    registered, unregistered = [], []

    def register(ptr, nbytes):
        registered.append(ptr)
        return len(registered) != 2  # the second buffer's registration fails

    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    monkeypatch.setattr(hm, "_register", register)
    monkeypatch.setattr(hm, "_unregister_all", lambda ptrs: unregistered.extend(ptrs))
    real_empty = torch.empty

    def empty(*args, **kwargs):
        if kwargs.get("pin_memory"):
            raise RuntimeError("cannot lock more memory")
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", empty)
    with pytest.raises(MemoryError, match="cannot pin .*ulimit -l"):
        hm.host_empty_many([HostSpec(1 << 20, torch.float32)] * 4, pin=True)
    gc.collect()
    assert sorted(unregistered) == sorted(registered[:1] + registered[2:])


@contextlib.contextmanager
def _no_collection():
    """The garbage collector off inside (the test decides when it runs), after torch's one-off keeping of
    a process's first optimizer until a collection (its own optimizers too) is out of the way."""
    torch.optim.AdamW(mlp().parameters())
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def test_an_optimizer_dropped_without_close_does_not_block_the_next_one(monkeypatch):
    """An optimizer dropped without close() inside a reference cycle (a user's object holding it and held
    by it) keeps its pinned buffers until the garbage collector runs; the next one's capacity check
    collects first instead of failing for that memory."""
    with _no_collection():
        opt = DeepOptimizerStates(mlp(torch.float32, "cpu", seed=1), lr=1e-3)
        opt.trainer = {"optimizer": opt}
        dropped = weakref.ref(opt)
        del opt
        assert dropped() is not None  # held by the cycle: the premise of the test
        monkeypatch.setattr(hm, "available_host_bytes", lambda: 10**12 if dropped() is None else 0)
        DeepOptimizerStates(mlp(torch.float32, "cpu", seed=2), lr=1e-3).close()
        assert dropped() is None
        with pytest.raises(MemoryError, match="not enough host memory"):  # short for real: still refused
            monkeypatch.setattr(hm, "available_host_bytes", lambda: 0)
            DeepOptimizerStates(mlp(torch.float32, "cpu", seed=3), lr=1e-3)


@pytest.mark.parametrize("kwargs", [{}, {"stream_grads": True}, {"overlap": True},
                                    {"stream_grads": True, "overlap": True, "prefetch": True}],
                         ids=["plain", "stream_grads", "overlap", "prefetch"])
def test_dropping_the_optimizer_frees_it_at_once(kwargs):
    """As with a torch optimizer: no reference cycle of its own keeps it (and its pinned buffers) alive
    until a garbage collection, also after its states were read and a state_dict taken."""
    with _no_collection():
        model = mlp(torch.float32, "cpu", seed=1)
        opt = DeepOptimizerStates(model, lr=1e-3, **kwargs)
        loss_of(model, torch.Generator().manual_seed(0)).backward()
        opt.step()
        opt.synchronize()
        opt.state[next(model.parameters())]["exp_avg"].sum()
        opt.state_dict()
        dropped = weakref.ref(opt)
        del opt
        assert dropped() is None, "the optimizer outlived its last reference"


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_an_optimizer_whose_update_failed_is_freed_at_once_too(monkeypatch, overlap):
    """The failed update's error is kept as text (with where it was raised): the exception would keep its
    traceback's frames, and the optimizer in them, alive after the user drops it (after an out-of-memory
    error, say, to build a smaller one)."""
    from deep_optimizer_states.core import engine

    def failing(*args, **kwargs):
        raise RuntimeError("injected failure in the update")

    with _no_collection():
        model = mlp(torch.float32, "cpu", seed=1)
        opt = DeepOptimizerStates(model, lr=1e-3, schedule="cpu", overlap=overlap)
        monkeypatch.setattr(engine, "adam_update", failing)
        loss_of(model, torch.Generator().manual_seed(0)).backward()
        with pytest.raises(RuntimeError, match="injected failure"):
            opt.step()
            opt.synchronize()
        with pytest.raises(RuntimeError, match="failed part-way .*injected failure.*raised at .* in failing"):
            opt.step()
        dropped = weakref.ref(opt)
        del opt
        assert dropped() is None, "the optimizer outlived its last reference"

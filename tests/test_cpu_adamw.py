"""The bf16-gradient CPU AdamW kernel: bit for bit torch's fused CPU kernel, or not used at all."""

import warnings

import pytest
import torch

from deep_optimizer_states.core import cpu_adamw
from deep_optimizer_states.core.adam import AdamHyper, adam_update
from tests.harness import needs_compiler


@pytest.fixture(scope="module")
def kernel():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a build failure or a mismatch warns: here it must not happen
        built = cpu_adamw.load()
    assert built is not None
    return built


@needs_compiler
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_equals_torchs_kernel_bit_for_bit(kernel, threads, seed):
    """Fresh random data each seed, sizes with and without a scalar tail, AdamW and Adam, multipliers."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert cpu_adamw.mismatch(kernel, sizes=(16, 5, 512 * 40 + 3, 300_017), seed=seed) is None
    finally:
        torch.set_num_threads(before)


@needs_compiler
def test_ten_steps_on_views_equal_torchs_and_the_rounded_params(kernel):
    """Steps in sequence on views into one flat buffer (as the layout's spans are), with a clip factor."""
    gen = torch.Generator().manual_seed(7)
    n = 4096 + 16 * 9
    ours = [torch.randn(2 * n, generator=gen), torch.zeros(2 * n), torch.zeros(2 * n)]
    ref = [t.clone() for t in ours]
    h = AdamHyper(2e-3, 0.9, 0.999, 1e-8, 0.1, True)
    out = torch.empty(n, dtype=torch.bfloat16)
    for step in range(10):
        g = (torch.randn(n, generator=gen) * 10 ** -(step % 4)).bfloat16()
        clip = torch.tensor(0.25 + step / 40, dtype=torch.float32)
        p, m, v = (t[n:] for t in ours)
        kernel(p, g, m, v, step, h, (float(clip),), out)
        g32 = g.float().mul_(clip)
        adam_update(ref[0][n:], g32, ref[1][n:], ref[2][n:], step, h)
        for a, b in zip(ours, ref):
            assert torch.equal(a.view(torch.int32), b.view(torch.int32))
        assert torch.equal(out.view(torch.int16), ref[0][n:].bfloat16().view(torch.int16))
    assert torch.equal(ours[0][:n], ref[0][:n])  # the other half untouched


@needs_compiler
@pytest.mark.parametrize("n", [512 * 3 + 16 * 5, 512 * 3 + 16 * 5 + 7])
def test_the_states_before_are_saved_in_the_same_pass_and_the_update_is_unchanged(kernel, n):
    """``save`` (an update run ahead): rows of a wider spare (as speculation's [3, largest] spare is sliced)
    get the param, exp_avg and exp_avg_sq as they were, the tail's too; the update equals the one without."""
    gen = torch.Generator().manual_seed(11)
    states = [torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 1e-3, torch.rand(n, generator=gen) * 1e-5]
    before = [t.clone() for t in states]
    twin = [t.clone() for t in states]
    g = (torch.randn(n, generator=gen) * 1e-2).bfloat16()
    h = AdamHyper(1e-3, 0.9, 0.95, 1e-8, 0.1, True)
    spare = torch.full((3, n + 100), float("nan"))
    out, out_twin = torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.bfloat16)
    kernel(*states[:1], g, *states[1:], 4, h, (0.5,), out, spare[:, :n])
    kernel(*twin[:1], g, *twin[1:], 4, h, (0.5,), out_twin)
    for saved, b, a, t in zip(spare, before, states, twin):
        assert torch.equal(saved[:n].view(torch.int32), b.view(torch.int32))
        assert saved[n:].isnan().all()  # nothing past the span
        assert torch.equal(a.view(torch.int32), t.view(torch.int32)) and not torch.equal(a, b)
    assert torch.equal(out.view(torch.int16), out_twin.view(torch.int16))


@needs_compiler
@pytest.mark.parametrize("offset", range(8))
def test_the_rounded_params_land_whatever_their_alignment(kernel, offset):
    """``out`` (written with streaming stores from its first 16-byte aligned element) starts at each of the 8
    bf16 offsets within 16 bytes, as a subgroup's params half of grad32 may: every element is the rounded
    param, and nothing beside ``out`` is written."""
    n = 512 * 5 + 16 * 3 + 5  # whole blocks, a part block and the scalar tail
    gen = torch.Generator().manual_seed(100 + offset)
    p, m, v = torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 1e-3, torch.rand(n, generator=gen) * 1e-5
    g = (torch.randn(n, generator=gen) * 1e-2).bfloat16()
    h = AdamHyper(1e-3, 0.9, 0.999, 1e-8, 0.01, True)
    guard = torch.tensor(-7.0).bfloat16().view(torch.int16)
    wide = torch.empty(n + 16, dtype=torch.bfloat16)
    wide.view(torch.int16).fill_(guard)
    out = wide[offset : offset + n]
    want = p.clone()
    adam_update(want, g.float(), m.clone(), v.clone(), 2, h)
    kernel(p, g, m, v, 2, h, (), out)
    assert torch.equal(out.view(torch.int16), want.bfloat16().view(torch.int16))
    rest = torch.cat([wide[:offset], wide[offset + n :]]).view(torch.int16)
    assert (rest == guard).all()


@pytest.fixture
def fresh_load():
    """load() runs again here, and the kernel built for the other tests is found again after."""
    cpu_adamw.load.cache_clear()
    yield cpu_adamw.load
    cpu_adamw.load.cache_clear()


def test_a_failed_build_keeps_torchs_kernel(monkeypatch, fresh_load):
    import torch.utils.cpp_extension as ext

    def broken(*args, **kwargs):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(ext, "load_inline", broken)
    with pytest.warns(UserWarning, match="did not build .*no compiler here.*torch's fused kernel is used"):
        assert fresh_load() is None


@needs_compiler
def test_a_kernel_that_differs_is_not_used(monkeypatch, kernel, fresh_load):
    """Were torch's kernel to round differently (another version), no form matches and load() says so."""
    real = cpu_adamw.adam_update

    def shifted(param, *args):
        real(param, *args)
        param.view(torch.int32).add_(1)  # one ulp off everywhere

    monkeypatch.setattr(cpu_adamw, "adam_update", shifted)
    with pytest.warns(UserWarning, match="does not match torch's kernel here in any of its 12 forms"):
        assert fresh_load() is None


@needs_compiler
def test_a_kernel_that_differs_only_when_its_threads_share_the_work_is_not_used(monkeypatch, kernel, fresh_load):
    """load() checks a size the threads take in several chunks too: a kernel right on one chunk and wrong
    on several (a chunk's bounds off, another OpenMP runtime) is not used."""
    real = cpu_adamw.adam_update

    def shifted_when_split(param, *args):
        real(param, *args)
        if param.numel() > cpu_adamw.CHUNK:
            param.view(torch.int32).add_(1)

    monkeypatch.setattr(cpu_adamw, "adam_update", shifted_when_split)
    with pytest.warns(UserWarning, match=f"x param differs from torch's kernel [^;]*, {cpu_adamw.SPLIT} elements"):
        assert fresh_load() is None


@pytest.fixture(scope="module")
def fixed_shares(kernel):
    """The kernel built to give each thread a fixed share of its blocks (the library's before H200 calls 119-124),
    in the library's form."""
    return cpu_adamw.Bf16GradAdam(cpu_adamw.build(["DOS_FIXED_SHARES"]), kernel.variant)


@needs_compiler
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("build", ["library", "fixed_shares"])
def test_each_build_equals_torchs_kernel_over_many_chunks_and_saves_the_states_before(kernel, fixed_shares, build,
                                                                                      threads):
    """Sizes of several chunks (64 blocks of 512) and a part chunk, with a tail: bit for bit torch's kernel; and
    with ``save`` (an update run ahead) every element's states before land in the spare, whichever thread took
    its chunk or share."""
    ours = kernel if build == "library" else fixed_shares
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert cpu_adamw.mismatch(ours, sizes=(cpu_adamw.SPLIT, 16), seed=threads) is None
        n = cpu_adamw.CHUNK * 4 + 16 * 3
        gen = torch.Generator().manual_seed(threads)
        states = [torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 1e-3, torch.rand(n, generator=gen)]
        was = [t.clone() for t in states]
        spare = torch.full((3, n), float("nan"))
        ours(states[0], (torch.randn(n, generator=gen) * 1e-2).bfloat16(), states[1], states[2], 3,
             AdamHyper(1e-3, 0.9, 0.95, 1e-8, 0.1, True), (0.5,), torch.empty(n, dtype=torch.bfloat16), spare)
        for saved, b in zip(spare, was):
            assert torch.equal(saved.view(torch.int32), b.view(torch.int32))
    finally:
        torch.set_num_threads(before)


def test_an_unknown_kernel_macro_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown kernel macros \\['DOS_FAST'\\]: pass some of"):
        cpu_adamw.build(["DOS_FAST"])

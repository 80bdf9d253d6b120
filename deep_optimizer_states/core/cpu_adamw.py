"""A CPU AdamW that reads bf16 gradients and can write the bf16 params, for fewer host bytes per element.

The CPU path is held by host memory traffic (docs/benchmarks/targets.md). torch's fused CPU kernel needs
fp32 gradients, so today each CPU-placed element's gradient is up-cast on the GPU, sent down as 4 bytes,
and read back as 4; and its fp32 master goes up as 4 bytes for the GPU to round. This kernel reads the
gradient as bf16 (2 + 2 bytes: the up-cast is exact, done in registers) and writes the rounded param
beside the master (2 bytes, sent up as 2; with streaming stores, so that their cache lines are not read
first): 32 bytes through host memory per element instead of 36, and half the PCIe bytes of the CPU path.
Its threads take the blocks in chunks as each comes free, so a vCPU the hypervisor shares holds up one chunk,
not a fixed share of the update (x0.969 per iteration over 16 paired rounds on one H200 host, x0.987 over 20
on two: overlap.md, calls 119-125; its CPU path the faster in every pair).

Exactness: the arithmetic is that of torch's fused CPU kernel on fp32 (its vectorised loop), written
element by element and compiled without contraction but where a form says so: which multiply-adds torch's
build fused (the moment's lerp, the second moment, the L2 term) is a property of that build, so 12 forms
are compiled and the one that matches is kept. The gradient multipliers (unscale, clip) are the same fp32
multiplies the engine applies. ``load()`` compiles it once (torch's C++ extension builder), then checks it bit for bit
against torch's kernel on random data, AdamW and Adam, with and without weight decay and multipliers, at
early and late steps, on one chunk and on a size its threads share; if the compiler is missing or any bit
differs (another torch, another kernel), it returns None and says why, and the caller keeps torch's kernel.

The engine uses it with ``bf16_cpu_path=True`` (opt-in: docs/design.md item 15 says when it pays) for CPU-placed
subgroups of bf16 params, their gradients sent at the update or streamed during backward, and for those
run ahead (``engine.bf16_update``); bench/cpu_kernel.py times it against torch's kernel.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import platform
import types
import warnings
from typing import Sequence

import torch

from .adam import AdamHyper, adam_update

log = logging.getLogger(__name__)

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <omp.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__SSE2__)
#include <immintrin.h>
#endif

static inline float from_bf16(uint16_t h) {
  uint32_t bits = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

static inline uint16_t to_bf16(float f) {  // round to nearest even; a NaN stays a NaN (its bits may differ)
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  return f != f ? uint16_t(0x7FC0) : uint16_t(rounded);
}

// The contractions a compiler may have made in torch's kernel: the lerp (an explicit fmadd, or not), the
// second moment v * b2 + (c * g) * g (none, fma(v, b2, .), or fma(c * g, g, .)), the L2 term g + p * wd
// (kL2: 0 none, 1 unfused, 2 fused). Blocks of kBlock elements: the update, then their bf16 rounding while
// they are in cache (one loop doing both is not vectorised by GCC 12). A multiply by 1 is exact, so the
// multipliers and AdamW's shrink are applied unconditionally. With ``save`` (an update run ahead, which
// must be undoable) each block's states before are copied aside first, while the update brings them into
// cache anyway: a separate copy pass would read them from memory once more.
constexpr int64_t kBlock = 512;
// Blocks handed out to the threads 64 at a time (32768 elements, about 1 MB of host traffic each)
constexpr int64_t kChunk = 64;

// The states before, into the spare: streaming stores where the spare is aligned (the spare is only read
// back by an undo, so it need not be read into cache before it is written: 12 bytes per element less).
static inline void keep_aside(float* __restrict dst, const float* __restrict src, int64_t count) {
#if defined(__SSE2__)
  int64_t i = 0;
  if ((reinterpret_cast<uintptr_t>(dst) & 15) == 0) {
    for (; i + 4 <= count; i += 4) _mm_stream_ps(dst + i, _mm_loadu_ps(src + i));
  }
  if (i < count) std::memcpy(dst + i, src + i, size_t(count - i) * sizeof(float));
#else
  std::memcpy(dst, src, size_t(count) * sizeof(float));
#endif
}

// The rounded params, from the block's buffer into ``dst``: streaming stores where ``dst`` is 16-byte aligned (from
// its first aligned element on). They go up over PCIe and are not read here again, so their lines need not be read
// into cache before they are written: 2 bytes per element less. DOS_PLAIN_STORES builds the plain stores instead
// (bench/cpu_kernel.py times both).
static inline void send_out(uint16_t* __restrict dst, const uint16_t* __restrict src, int64_t count) {
  int64_t i = 0;
#if defined(__SSE2__) && !defined(DOS_PLAIN_STORES)
  const uintptr_t addr = reinterpret_cast<uintptr_t>(dst);
  if ((addr & 1) == 0) {
    i = std::min<int64_t>(count, int64_t(((16 - (addr & 15)) & 15) / 2));
    std::memcpy(dst, src, size_t(i) * sizeof(uint16_t));
    for (; i + 8 <= count; i += 8)
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
  }
#endif
  if (i < count) std::memcpy(dst + i, src + i, size_t(count - i) * sizeof(uint16_t));
}

template <bool kLerp, int kSquare, int kL2, bool kOut>
static void blocks(float* __restrict p, const uint16_t* __restrict g, float* __restrict m, float* __restrict v,
                   uint16_t* __restrict out, float* const* save, int64_t first, int64_t last, int64_t n,
                   float k0, float k1,
                   float shrink, float l2, bool small, float coeff, float sq_coeff, float b2, float bias2_sqrt,
                   float epsf, float step_size) {
  for (int64_t block = first; block < last; ++block) {
    const int64_t start = block * kBlock, stop = std::min(n, start + kBlock);
    if (save != nullptr) {
      keep_aside(save[0] + start, p + start, stop - start);
      keep_aside(save[1] + start, m + start, stop - start);
      keep_aside(save[2] + start, v + start, stop - start);
    }
    for (int64_t i = start; i < stop; ++i) {
      float grad = from_bf16(g[i]) * k0 * k1;
      const float param = p[i] * shrink;
      if (kL2 == 1) grad = grad + param * l2;
      if (kL2 == 2) grad = std::fma(param, l2, grad);
      const float avg = m[i], base = small ? avg : grad, diff = grad - avg;
      const float new_avg = kLerp ? std::fma(coeff, diff, base) : coeff * diff + base;
      const float scaled = sq_coeff * grad;
      const float new_sq = kSquare == 0 ? v[i] * b2 + scaled * grad
                         : kSquare == 1 ? std::fma(v[i], b2, scaled * grad) : std::fma(scaled, grad, v[i] * b2);
      const float denom = std::sqrt(new_sq) / bias2_sqrt + epsf;
      m[i] = new_avg;
      v[i] = new_sq;
      p[i] = param + step_size * new_avg / denom;
    }
    if (kOut) {
      uint16_t rounded[kBlock];
      for (int64_t i = start; i < stop; ++i) rounded[i - start] = to_bf16(p[i]);
      send_out(out + start, rounded, stop - start);
    }
  }
#if defined(__SSE2__)
  if (save != nullptr || kOut) _mm_sfence();  // the streaming stores visible before this thread's part is done
#endif
}

template <bool kLerp, int kSquare, int kL2, bool kOut>
static void run(float* p, const uint16_t* g, float* m, float* v, uint16_t* out, float* const* save, int64_t n,
                double lr, double beta1, double beta2, double wd, double eps, int64_t step, bool decoupled, float k0,
                float k1) {
  const double bias1 = 1 - std::pow(beta1, step), bias2 = 1 - std::pow(beta2, step);
  const float step_size = float(-(lr / bias1)), bias2_sqrt = float(std::sqrt(bias2));
  const float weight = float(1 - beta1), sq_coeff = float(1 - beta2), b2 = float(beta2);
  const bool small = std::abs(weight) < 0.5f;
  const float coeff = small ? weight : weight - 1.0f;
  const float shrink = decoupled && wd != 0 ? float(1 - lr * wd) : 1.0f;
  const float l2 = float(wd), epsf = float(eps);
  const int64_t count = (n + kBlock - 1) / kBlock;
#if defined(DOS_FIXED_SHARES)
  at::parallel_for(0, count, 16, [=](int64_t first, int64_t last) {  // a fixed share per thread
    blocks<kLerp, kSquare, kL2, kOut>(p, g, m, v, out, save, first, last, n, k0, k1, shrink, l2, small, coeff,
                                      sq_coeff, b2, bias2_sqrt, epsf, step_size);
  });
#else
  // Chunks of kChunk blocks handed out as threads come free: a thread that runs slower (a vCPU the hypervisor
  // shares) holds up one chunk, not a fixed share of the whole span. Each element is computed alike either way.
  const int64_t chunks = (count + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(dynamic, 1) if (chunks > 1)
  for (int64_t c = 0; c < chunks; ++c)
    blocks<kLerp, kSquare, kL2, kOut>(p, g, m, v, out, save, c * kChunk, std::min(count, (c + 1) * kChunk), n, k0,
                                      k1, shrink, l2, small, coeff, sq_coeff, b2, bias2_sqrt, epsf, step_size);
#endif
}

using Kernel = void (*)(float*, const uint16_t*, float*, float*, uint16_t*, float* const*, int64_t, double, double,
                        double, double, double, int64_t, bool, float, float);

template <bool kLerp, int kSquare, bool kFusedL2>
static Kernel pick(bool l2, bool out) {
  if (!l2) return out ? run<kLerp, kSquare, 0, true> : run<kLerp, kSquare, 0, false>;
  constexpr int mode = kFusedL2 ? 2 : 1;
  return out ? run<kLerp, kSquare, mode, true> : run<kLerp, kSquare, mode, false>;
}

void adamw_bf16(torch::Tensor p, torch::Tensor g, torch::Tensor m, torch::Tensor v, torch::Tensor out,
                torch::Tensor save, double lr, double beta1, double beta2, double wd, double eps, int64_t step,
                bool decoupled, std::vector<double> multipliers, int64_t variant) {
  TORCH_CHECK(p.is_cpu() && g.is_cpu() && m.is_cpu() && v.is_cpu() && (!out.defined() || out.is_cpu()),
              "host tensors");
  TORCH_CHECK(p.is_contiguous() && m.is_contiguous() && v.is_contiguous() && g.is_contiguous(), "contiguous");
  TORCH_CHECK(p.scalar_type() == at::kFloat && m.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat
              && g.scalar_type() == at::kBFloat16, "fp32 p, m, v and a bf16 gradient");
  TORCH_CHECK(multipliers.size() <= 2, "at most two gradient multipliers (unscale, clip)");
  const int64_t n = p.numel();
  TORCH_CHECK(g.numel() == n && m.numel() == n && v.numel() == n, "sizes differ");
  uint16_t* o = nullptr;
  if (out.defined() && out.numel()) {
    TORCH_CHECK(out.numel() == n && out.is_contiguous() && out.scalar_type() == at::kBFloat16, "bf16 out");
    o = reinterpret_cast<uint16_t*>(out.data_ptr());
  }
  float* rows[3] = {nullptr, nullptr, nullptr};
  if (save.defined() && save.numel()) {
    TORCH_CHECK(save.is_cpu() && save.scalar_type() == at::kFloat && save.dim() == 2 && save.size(0) == 3
                && save.size(1) == n && save.stride(1) == 1, "save: fp32 host rows [3, n], each contiguous");
    for (int row = 0; row < 3; ++row) rows[row] = save.data_ptr<float>() + row * save.stride(0);
  }
  TORCH_CHECK(variant >= 0 && variant < 12, "variant");
  const bool l2 = !decoupled && wd != 0;
  static Kernel (*const forms[])(bool, bool) = {
      pick<false, 0, false>, pick<false, 0, true>, pick<false, 1, false>, pick<false, 1, true>,
      pick<false, 2, false>, pick<false, 2, true>, pick<true, 0, false>, pick<true, 0, true>,
      pick<true, 1, false>, pick<true, 1, true>, pick<true, 2, false>, pick<true, 2, true>};
  const Kernel kernel = forms[variant](l2, o != nullptr);
  const float k0 = multipliers.size() > 0 ? float(multipliers[0]) : 1.0f;
  const float k1 = multipliers.size() > 1 ? float(multipliers[1]) : 1.0f;
  float *pp = p.data_ptr<float>(), *mp = m.data_ptr<float>(), *vp = v.data_ptr<float>();
  const uint16_t* gp = reinterpret_cast<const uint16_t*>(g.data_ptr());
  // torch's thread count for this thread, also where this build's OpenMP runtime is not torch's own
  omp_set_num_threads(at::get_num_threads());
  pybind11::gil_scoped_release release;  // the training loop's thread runs on meanwhile
  kernel(pp, gp, mp, vp, o, rows[0] ? rows : nullptr, n, lr, beta1, beta2, wd, eps, step, decoupled, k0, k1);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("adamw_bf16", &adamw_bf16);
}
"""


# no contraction but the kernel's own fma calls; vector sqrt (IEEE either way); this CPU's vector width
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fopenmp"]
KERNEL_DEFINES = {  # the macros ``build`` takes, and what each builds: variants bench/ times against the library's
    "DOS_PLAIN_STORES": "with plain stores for the rounded params (the kernel before H200 call 95)",
    "DOS_FIXED_SHARES": "giving each thread a fixed share of its blocks (the kernel before H200 calls 119-124)",
}
UNIT = 16  # torch's kernel runs whole vectors of 16 fp32 (AVX-512; 2 of 8 with AVX2), a scalar loop after
CHUNK = 64 * 512  # kChunk blocks of kBlock elements: what one of the kernel's threads takes at a time
SPLIT = 3 * CHUNK + 5 * 512 + 7  # a size the kernel's threads share: whole chunks, a part chunk, a scalar tail
_EMPTY = torch.empty(0)
VARIANTS = 12  # fused lerp or not x three forms of the second moment x fused L2 term or not (the C++ order)


class Bf16GradAdam:
    """The compiled kernel, in the variant (which multiply-adds are fused) that matched torch's kernel here."""

    def __init__(self, module, variant: int) -> None:
        self._module, self.variant = module, variant

    def __call__(self, param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                 steps_done: int, h: AdamHyper, multipliers: Sequence[float] = (),
                 out: torch.Tensor | None = None, save: torch.Tensor | None = None) -> None:
        """As ``adam_update`` on ``grad.float() * m1 * m2 ...`` for step ``steps_done + 1``; also ``out`` =
        the new param rounded to bf16 when given, and ``save`` ([3, numel] fp32: param, exp_avg, exp_avg_sq)
        = the states before, copied in the same pass. The last ``numel % 16`` elements, which torch's kernel
        updates in its scalar loop, are given to torch's kernel (their gradients up-cast here)."""
        n = param.numel()
        body = n - n % UNIT
        if body:
            self._module.adamw_bf16(param[:body], grad[:body], exp_avg[:body], exp_avg_sq[:body],
                                    _EMPTY if out is None else out[:body], _EMPTY if save is None else save[:, :body],
                                    h.lr, h.beta1, h.beta2, h.weight_decay, h.eps, steps_done + 1, h.decoupled,
                                    [float(k) for k in multipliers], self.variant)
        if body < n:
            if save is not None:
                for dst, src in zip(save[:, body:], (param, exp_avg, exp_avg_sq)):
                    dst.copy_(src[body:])
            tail = grad[body:].float()
            for k in multipliers:
                tail.mul_(torch.tensor(float(k), dtype=torch.float32))
            adam_update(param[body:], tail, exp_avg[body:], exp_avg_sq[body:], steps_done, h)
            if out is not None:
                out[body:].copy_(param[body:])


def mismatch(kernel: Bf16GradAdam, sizes: Sequence[int] = (4096, 4096 + 7, SPLIT), seed: int = 0) -> str | None:
    """None when ``kernel`` equals torch's fused CPU kernel bit for bit on random data in every case (each
    size: a scalar tail after whole vectors is taken too; by default one size spread over the threads in
    chunks); else the first case that differs."""
    gen = torch.Generator().manual_seed(seed)
    cases = [(AdamHyper(1e-3, 0.9, 0.999, 1e-8, 0.01, True), 0, ()),
             (AdamHyper(3e-4, 0.9, 0.95, 1e-6, 0.1, True), 999, (0.37,)),
             (AdamHyper(1e-2, 0.4, 0.95, 1e-8, 0.0, True), 5, (2.0 ** -12, 0.81)),  # lerp weight 0.6
             (AdamHyper(1e-3, 0.9, 0.999, 1e-8, 0.05, False), 2, (0.5,))]  # classic Adam, L2 decay
    for (h, steps, mults), numel in ((case, n) for case in cases for n in sizes):
        p = torch.randn(numel, generator=gen)
        g = (torch.randn(numel, generator=gen) * 1e-2).bfloat16()
        m = torch.randn(numel, generator=gen) * 1e-3
        v = torch.rand(numel, generator=gen) * 1e-5
        want = [t.clone() for t in (p, m, v)]
        g32 = g.float()
        for k in mults:
            g32.mul_(torch.tensor(k, dtype=torch.float32))
        adam_update(want[0], g32, want[1], want[2], steps, h)
        out = torch.empty(numel, dtype=torch.bfloat16)
        kernel(p, g, m, v, steps, h, mults, out)
        for name, got, ref in (("param", p, want[0]), ("exp_avg", m, want[1]), ("exp_avg_sq", v, want[2]),
                               ("bf16 param", out, want[0].bfloat16())):
            if not torch.equal(got.view(torch.int32 if got.dtype == torch.float32 else torch.int16),
                               ref.view(torch.int32 if ref.dtype == torch.float32 else torch.int16)):
                return (f"{name} differs from torch's kernel ({h}, step {steps + 1}, multipliers {mults}, "
                        f"{numel} elements)")
    return None


def _cpu_tag() -> str:
    """This CPU's model and instruction sets, hashed: the build is for this CPU (-march=native), and torch
    caches builds by name in a directory a cluster's machines may share."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = [platform.machine(), platform.processor()]
    return hashlib.sha1("".join(lines).encode()).hexdigest()[:10]


def build(defines: Sequence[str] = ()) -> types.ModuleType:
    """The extension module compiled for this CPU with the macros ``defines`` (torch caches each build by name)."""
    from torch.utils.cpp_extension import load_inline

    unknown = [d for d in defines if d not in KERNEL_DEFINES]
    if unknown:
        raise ValueError(f"unknown kernel macros {unknown}: pass some of {sorted(KERNEL_DEFINES)}")
    name = "_".join([f"dos_cpu_adamw_bf16_{_cpu_tag()}", *(d.lower() for d in defines)])
    return load_inline(name, _SOURCE, extra_cflags=FLAGS + [f"-D{d}" for d in defines], extra_ldflags=["-fopenmp"])


@functools.lru_cache(maxsize=1)
def load() -> Bf16GradAdam | None:
    """The kernel if it compiles here and matches torch's bit for bit, else None (with a warning why)."""
    try:
        log.info("bf16_cpu_path: building (or loading the built) CPU AdamW kernel; the first build takes ~30 s")
        module = build()
    except Exception as e:  # no compiler, no ninja, a header missing: torch's kernel stays
        warnings.warn(f"the bf16-gradient CPU AdamW did not build ({type(e).__name__}: {str(e)[:300]}); "
                      "torch's fused kernel is used")
        return None
    reasons = {}
    for variant in range(VARIANTS):
        kernel = Bf16GradAdam(module, variant)
        reason = mismatch(kernel)
        if reason is None:
            return kernel
        reasons[reason] = reasons.get(reason, 0) + 1
    warnings.warn("the bf16-gradient CPU AdamW does not match torch's kernel here in any of its "
                  f"{VARIANTS} forms ({'; '.join(f'{n} x {r}' for r, n in reasons.items())}); torch's fused "
                  "kernel is used")
    return None

// Shared helpers of the CPU kernels (terngrad.cpp, selection.cpp, binwords.cpp). lightning_gradcomp/kernels/_build.py
// compiles the three sources as one translation unit on first use. Design choices, once:
//
// * Every kernel works on tiles of a few thousand elements that stay in L1/L2; the hot per-tile loops are
//   plain loops the compiler auto-vectorises. They are compiled for several instruction sets at once with GCC's
//   target_clones (picked at load time by the CPU), so one build runs on any x86-64 machine: no
//   -march=native.
// * Tiles are distributed over torch's intra-op threads (at::parallel_for, OpenMP) and every partial result
//   is combined in a fixed order, so results never depend on the thread count.
// * Float reductions keep 16 independent lanes: GCC vectorises them without -ffast-math.
// * The random stream is a keyed integer hash of the element index (counter-based): element i of a tensor
//   draws lowbias32(lowbias32(i + k0) ^ k1), the same on CPU, in the torch-ops fallback and on CUDA.

#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__) && __GNUC__ >= 11
// the x86-64 micro-architecture levels: v4 adds AVX-512 BW/VL to F, which the byte narrowing of the ternary codes
// and packing need (with "avx512f" alone the ternarize + pack kernel ran at 2/3 of this speed on AMD EPYC)
#define LGC_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default"), noinline))
#elif defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define LGC_CLONES __attribute__((target_clones("avx512f", "avx2", "default"), noinline))
#else
#define LGC_CLONES
#endif

namespace {

constexpr int64_t kTile = 16384;  // elements per tile (input side)

// at least this many elements per thread: small tensors stay on one thread, where a fork/join (and, on a
// busy machine, waiting for a descheduled sibling thread) would cost more than the work
inline int64_t grain(int64_t elems_per_item) {
  return std::max<int64_t>(1, (8 * kTile) / std::max<int64_t>(1, elems_per_item));
}

inline uint32_t lowbias32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352dU;
  x ^= x >> 15;
  x *= 0x846ca68bU;
  x ^= x >> 16;
  return x;
}

inline uint32_t hash_index(uint32_t i, uint32_t k0, uint32_t k1) { return lowbias32(lowbias32(i + k0) ^ k1); }

void check_f32(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == torch::kFloat32, name, " must be float32");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

// the caller's output buffer (float32, n elements, contiguous), or a new one when it passes an empty tensor:
// writing into a reused buffer skips the page faults of a fresh allocation
torch::Tensor output(torch::Tensor out, int64_t n) {
  if (out.numel() == 0 && n != 0) return torch::empty({n}, torch::kFloat32);
  check_f32(out, "out");
  TORCH_CHECK(out.numel() == n, "out has ", out.numel(), " elements, expected ", n);
  return out;
}

// GCC vector extensions: explicit 8-wide lanes that each target_clones variant lowers to its own registers
// (one ymm on AVX2, halves of a zmm on AVX-512, two xmm on the SSE2 baseline).
typedef float f8 __attribute__((vector_size(32)));
typedef int32_t i8v __attribute__((vector_size(32)));
typedef double d8 __attribute__((vector_size(64)));

inline f8 load8(const float* p) {
  f8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline f8 abs8(f8 v) {
  i8v bits = (i8v)v & 0x7fffffff;
  return (f8)bits;
}

// max that propagates NaN as torch.amax does: a plain `m > a ? m : a` forgets a NaN at the next comparison, so a
// NaN gradient would get a finite scaler here but a NaN one on the torch backend
inline f8 nanmax8(f8 m, f8 a) { return ((m > a) | (m != m)) ? m : a; }
inline float nanmax(float m, float a) { return (m > a || m != m) ? m : a; }

}  // namespace

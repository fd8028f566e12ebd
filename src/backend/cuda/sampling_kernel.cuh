// Token sampling, one block of 512 threads per row of logits. Why built this way:
//
// - The vocabulary (152k for Qwen3) does not fit in shared memory, so the row is re-read from
//   L2 by each pass; the number of passes is what matters. Top-k and top-p thresholds are found
//   by a 4-pass radix select over order-preserving 32-bit keys of the scaled logits (8 bits per
//   pass, a 256-bin shared-memory histogram of counts or of probability mass), not by sorting:
//   greedy is 1 pass, full top-k + top-p sampling about 11.
// - The threshold is an exact key, so "keep the k largest" keeps every logit equal to the k-th
//   largest, and the top-p cut is the smallest set of largest probabilities reaching p.
// - The draw: one Philox uniform u per row (seed and subsequence = the request's step), then
//   the kept tokens are walked in vocabulary order: per-thread contiguous ranges, a block scan
//   of their masses, and the one thread whose range holds u * total walks it.
#pragma once

#include <curand_kernel.h>

#include <cfloat>
#include <cstdint>

#include "backend/cuda/device_utils.cuh"
#include "backend/cuda/sampling.h"

namespace moeinfer::cuda {

namespace sampling {

inline constexpr int kThreads = 512;
inline constexpr int kWarps = kThreads / 32;

__device__ __forceinline__ uint32_t order_key(float x) {
  const uint32_t u = __float_as_uint(x);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

struct Shared {
  float hist[256];
  float warp_f[kWarps];
  int warp_i[kWarps];
  uint32_t prefix;
  float remaining;
  int token;
  int last_kept;
  float u;
};

// Block sum of one float per thread (every thread gets it).
__device__ __forceinline__ float block_sum(float v, Shared& s) {
  v = device::warp_sum(v);
  if ((threadIdx.x & 31) == 0) s.warp_f[threadIdx.x >> 5] = v;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) total += s.warp_f[w];
  __syncthreads();
  return total;
}

// Exclusive block scan of one float per thread; *total gets the sum.
__device__ __forceinline__ float block_exclusive_scan(float v, Shared& s, float* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float inclusive = v;
#pragma unroll
  for (int offset = 1; offset < 32; offset <<= 1) {
    const float other = __shfl_up_sync(device::kFullMask, inclusive, offset);
    if (lane >= offset) inclusive += other;
  }
  if (lane == 31) s.warp_f[warp] = inclusive;
  __syncthreads();
  float prefix = 0.f, sum = 0.f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    const float x = s.warp_f[w];
    if (w < warp) prefix += x;
    sum += x;
  }
  __syncthreads();
  *total = sum;
  return prefix + inclusive - v;
}

// Largest key t (>= floor) such that the weight of {i : key_i >= t, key_i >= floor} reaches
// target, where the weight of token i is 1 (counting) or exp(x_i - x_max) (mass).
__device__ uint32_t radix_select(const float* logits, int vocab, float inv_t, float x_max,
                                 bool mass, float target, uint32_t floor, Shared& s) {
  if (threadIdx.x == 0) {
    s.prefix = 0;
    s.remaining = target;
  }
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int i = threadIdx.x; i < 256; i += kThreads) s.hist[i] = 0.f;
    __syncthreads();
    const uint32_t prefix = s.prefix;
    const uint32_t high_mask = shift == 24 ? 0u : (0xffffffffu << (shift + 8));
    for (int i = threadIdx.x; i < vocab; i += kThreads) {
      const float x = logits[i] * inv_t;
      const uint32_t key = order_key(x);
      if (key >= floor && (key & high_mask) == prefix)
        atomicAdd(&s.hist[(key >> shift) & 255u], mass ? __expf(x - x_max) : 1.f);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      float above = 0.f;
      int chosen = -1, lowest_nonempty = 0;
      for (int bin = 255; bin >= 0; --bin) {
        const float h = s.hist[bin];
        if (h == 0.f) continue;
        lowest_nonempty = bin;
        if (above + h >= s.remaining) {
          chosen = bin;
          break;
        }
        above += h;
      }
      if (chosen < 0) {  // rounding left the target unreached: keep the whole range
        chosen = lowest_nonempty;
        above = 0.f;  // unused after the last digit; keeps `remaining` positive before it
      }
      s.prefix = prefix | (static_cast<uint32_t>(chosen) << shift);
      s.remaining = fmaxf(s.remaining - above, FLT_MIN);
    }
    __syncthreads();
  }
  return s.prefix;
}

}  // namespace sampling

__global__ void __launch_bounds__(sampling::kThreads)
    sample_tokens_kernel(const __grid_constant__ SamplingParams p) {
  using namespace sampling;
  __shared__ Shared s;
  const int row = blockIdx.x;
  const int vocab = static_cast<int>(p.vocab_size);
  const float* logits = p.logits + static_cast<int64_t>(row) * vocab;
  const int tid = threadIdx.x;

  // Pass 1: the maximum and its lowest index (NaN logits never win).
  float best = -FLT_MAX;
  int best_i = vocab;  // none yet
  for (int i = tid; i < vocab; i += kThreads) {
    const float x = logits[i];
    if (x > best || (best_i == vocab && x == best)) {
      best = x;
      best_i = i;
    }
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float ob = __shfl_xor_sync(device::kFullMask, best, offset);
    const int oi = __shfl_xor_sync(device::kFullMask, best_i, offset);
    if (ob > best || (ob == best && oi < best_i)) {
      best = ob;
      best_i = oi;
    }
  }
  if ((tid & 31) == 0) {
    s.warp_f[tid >> 5] = best;
    s.warp_i[tid >> 5] = best_i;
  }
  __syncthreads();
  if (tid == 0) {
    for (int w = 1; w < kWarps; ++w) {
      if (s.warp_f[w] > best || (s.warp_f[w] == best && s.warp_i[w] < best_i)) {
        best = s.warp_f[w];
        best_i = s.warp_i[w];
      }
    }
    s.token = best_i < vocab ? best_i : 0;
    s.warp_f[0] = best;
  }
  __syncthreads();
  const float logit_max = s.warp_f[0];
  const float temperature = p.temperature ? p.temperature[row] : 0.f;
  const int top_k = p.top_k ? p.top_k[row] : 0;
  if (!(temperature > 0.f) || top_k == 1) {
    if (tid == 0) p.tokens[row] = s.token;
    return;
  }
  __syncthreads();  // warp_f is reused below

  const float inv_t = 1.f / temperature;
  const float x_max = logit_max * inv_t;
  uint32_t threshold = 0;
  if (top_k > 1 && top_k < vocab)
    threshold = radix_select(logits, vocab, inv_t, x_max, false, static_cast<float>(top_k), 0, s);
  const float top_p = p.top_p ? p.top_p[row] : 1.f;
  if (top_p > 0.f && top_p < 1.f) {
    float z = 0.f;
    for (int i = tid; i < vocab; i += kThreads) {
      const float x = logits[i] * inv_t;
      if (order_key(x) >= threshold) z += __expf(x - x_max);
    }
    z = block_sum(z, s);
    threshold = radix_select(logits, vocab, inv_t, x_max, true, top_p * z, threshold, s);
  }

  // The draw: contiguous ranges per thread, a scan of their kept mass.
  const int per = (vocab + kThreads - 1) / kThreads;
  const int begin = min(vocab, tid * per), end = min(vocab, begin + per);
  float local = 0.f;
  int last_kept = -1;
  for (int i = begin; i < end; ++i) {
    const float x = logits[i] * inv_t;
    if (order_key(x) >= threshold) {
      local += __expf(x - x_max);
      last_kept = i;
    }
  }
  if (tid == 0) {
    curandStatePhilox4_32_10_t state;
    curand_init(p.seeds[row], p.steps[row], 0, &state);
    s.u = curand_uniform(&state);  // (0, 1]
    s.token = -1;
    s.last_kept = -1;
  }
  float total;
  const float before = block_exclusive_scan(local, s, &total);  // synchronises: s.u visible
  if (last_kept >= 0) atomicMax(&s.last_kept, last_kept);
  const float target = s.u * total;
  if (local > 0.f && before < target && target <= before + local) {
    float acc = before;
    int chosen = last_kept;
    for (int i = begin; i < end; ++i) {
      const float x = logits[i] * inv_t;
      if (order_key(x) >= threshold) {
        acc += __expf(x - x_max);
        if (acc >= target) {
          chosen = i;
          break;
        }
      }
    }
    atomicMax(&s.token, chosen);  // one owner in exact arithmetic; the max breaks rounding ties
  }
  __syncthreads();
  if (tid == 0) p.tokens[row] = s.token >= 0 ? s.token : s.last_kept;
}

}  // namespace moeinfer::cuda

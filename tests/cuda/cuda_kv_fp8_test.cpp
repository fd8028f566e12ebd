// The GPU's fp8 KV rows (--kv-dtype fp8 on cuda, backend/cuda/kv_fp8.cuh) held to the CPU pool's
// format (kv/kv_format.h), their oracle:
//   write    attention_inputs (the fused path) and kv_cache_write_fp8 (the unfused one) store
//            each k and v head as exactly the codes and float32 scale encode_kv_row gives for the
//            same bf16 values (byte for byte, bit for bit), padding codes zero; their k / v
//            copies are decode_kv_row's values rounded to bf16; slots skipped stay poisoned
//   decode   paged decode attention over an fp8 cache (tensor-core and CUDA-core kernels, odd
//            lengths, GQA groups past 16, windows, fixed chunks) against a float64 attention over
//            the rows decode_kv_row gives: bf16 tolerance as cuda_attention_test.cpp's
//            (1e-2 of the output's natural scale; the tensor-core kernel rounds the decoded K/V
//            and P to bf16, so its scale includes sum_t p_t |v_t|)
//   decoder  the GPU decoder with fp8 rows against the CPU decoder with --kv-dtype fp8 on every
//            GQA fixture the GPU runs and on random GQA models, over the sweep's scripted
//            steps (prefill, chunked prefill, graph-replayed decode): relative logit error per
//            route <= 2e-2 (the GPU parity bound) + the CPU's own fp8-vs-f32 error, no routing
//            mismatch under wider ties (expect_fp8_parity says why), the pool the fp8 one;
//            the same for every MLA fixture (DeepSeek-V2/V3, Kimi K2: the latent and the rope
//            key as two scale groups, CudaMlaKvFp8Decoder), random DeepSeek models and two
//            wide latents (the streaming kernel)
// Host-side (no GPU needed): the launchers refuse mixed or unsupported fp8 arguments by name.
// Kernel tests are registered only where a CUDA device is visible; seeds are printed.
#if defined(MOE_HAVE_CUDA) && MOE_HAVE_CUDA

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "../support/model_fixtures.h"
#include "backend/cuda/attention.h"
#include "backend/cuda/decoder_ops.h"
#include "backend/cuda/mla_attention.h"
#include "cuda_test_util.h"
#include "gpu_cpu_compare.h"
#include "kv/kv_format.h"
#include "model/cuda/device_weights.h"
#include "model/gpu_decoder.h"
#include "model/model.h"

namespace moeinfer::cuda {
namespace {

using testing_util::DeviceBuffer;
using testing_util::fresh_seed;

constexpr uint32_t kPoisonScale = 0xFFFFFFFFu;  // a NaN, as DeviceBuffer::poison leaves it
constexpr uint8_t kPoisonCode = 0xFF;

// ---- host-side refusals -------------------------------------------------------------------

// Stand-in device pointers: the launchers check them for null and alignment only and refuse
// before any launch, so nothing is dereferenced.
template <typename T>
T* fake(uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

TEST(CudaKvFp8Checks, DecodeRefusesMixedRowTypesAndWideHeads) {
  PagedDecodeParams p{.q = fake<const __nv_bfloat16>(0x1000),
                      .k_cache = fake<const __nv_bfloat16>(0x2000),
                      .v_cache = fake<const __nv_bfloat16>(0x3000),
                      .k_codes = fake<const uint8_t>(0x4000),
                      .v_codes = fake<const uint8_t>(0x5000),
                      .k_scales = fake<const float>(0x6000),
                      .v_scales = fake<const float>(0x7000),
                      .block_tables = fake<const int32_t>(0x8000),
                      .seq_lens = fake<const int32_t>(0x9000),
                      .out = fake<__nv_bfloat16>(0xa000),
                      .num_seqs = 1,
                      .num_q_heads = 8,
                      .num_kv_heads = 2,
                      .head_dim = 128,
                      .block_size = 16,
                      .num_blocks = 4,
                      .max_blocks_per_seq = 4,
                      .max_seq_len = 64,
                      .scale = 0.1f};
  testing_util::expect_error_naming([&] { paged_decode_attention(p, nullptr); }, "exclusive");
  p.k_cache = p.v_cache = nullptr;
  p.v_scales = nullptr;
  testing_util::expect_error_naming([&] { paged_decode_attention(p, nullptr); }, "v_scales");
  p.v_scales = fake<const float>(0x7000);
  p.k_codes = fake<const uint8_t>(0x4008);
  testing_util::expect_error_naming([&] { paged_decode_attention(p, nullptr); }, "k_codes");
  p.k_codes = fake<const uint8_t>(0x4000);
  p.head_dim = 320;
  testing_util::expect_error_naming([&] { paged_decode_attention(p, nullptr); },
                                    "fp8 KV rows are read by the decode kernels of head dims 64");
}

TEST(CudaKvFp8Checks, WritersRefuseMixedRowTypesAndWideHeads) {
  AttentionInputsParams p{.qkv = fake<const __nv_bfloat16>(0x1000),
                          .qkv_stride = (8 + 2 * 2) * 128,
                          .positions = fake<const int32_t>(0x2000),
                          .inv_freq = fake<const float>(0x3000),
                          .slots = fake<const int32_t>(0x4000),
                          .k_cache = fake<__nv_bfloat16>(0x5000),
                          .v_cache = nullptr,
                          .k_codes = fake<uint8_t>(0x6000),
                          .v_codes = fake<uint8_t>(0x7000),
                          .k_scales = fake<float>(0x8000),
                          .v_scales = fake<float>(0x9000),
                          .num_slots = 64,
                          .q_out = fake<__nv_bfloat16>(0xa000),
                          .num_tokens = 3,
                          .num_q_heads = 8,
                          .num_kv_heads = 2,
                          .head_dim = 128,
                          .padded_head_dim = 128,
                          .rotary_dim = 128};
  testing_util::expect_error_naming([&] { attention_inputs(p, nullptr); }, "exclusive");
  p.k_cache = nullptr;
  p.padded_head_dim = p.head_dim = 320;
  p.rotary_dim = 64;
  p.qkv_stride = (8 + 2 * 2) * 320;
  testing_util::expect_error_naming([&] { attention_inputs(p, nullptr); },
                                    "fp8 KV rows are written for head dims up to 256");
  testing_util::expect_error_naming(
      [&] {
        kv_cache_write_fp8({.src = fake<__nv_bfloat16>(0x1000),
                            .codes = fake<uint8_t>(0x2000),
                            .scales = fake<float>(0x3000),
                            .slots = fake<const int32_t>(0x4000),
                            .num_tokens = 2,
                            .num_heads = 2,
                            .head_width = 64,
                            .src_stride = 100,
                            .num_slots = 8},
                           nullptr);
      },
      "src_stride = 100");
  testing_util::expect_error_naming(
      [&] {
        kv_cache_write_fp8({.src = fake<__nv_bfloat16>(0x1000),
                            .codes = nullptr,
                            .scales = fake<float>(0x3000),
                            .slots = fake<const int32_t>(0x4000),
                            .num_tokens = 2,
                            .num_heads = 2,
                            .head_width = 64,
                            .src_stride = 128,
                            .num_slots = 8},
                           nullptr);
      },
      "codes");
}

// ---- the CPU oracle -------------------------------------------------------------------------

// One head of `width` floats encoded by the CPU pool's encoder: its scale and codes.
struct CpuRow {
  float scale = 0.0f;
  std::vector<uint8_t> codes;
  std::vector<float> decoded;  // decode_kv_row of the encoding
};

CpuRow cpu_encode(const float* values, int64_t width) {
  const int64_t groups[] = {width};
  std::vector<std::byte> bytes(static_cast<size_t>(kv_row_bytes(KvDType::kFP8, groups)));
  encode_kv_row(KvDType::kFP8, groups, values, bytes.data());
  CpuRow row;
  std::memcpy(&row.scale, bytes.data(), sizeof(float));
  row.codes.resize(width);
  std::memcpy(row.codes.data(), bytes.data() + sizeof(float), static_cast<size_t>(width));
  row.decoded.resize(width);
  decode_kv_row(KvDType::kFP8, groups, bytes.data(), 0, width, row.decoded.data());
  return row;
}

uint32_t bits_of(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return b;
}

// Counts the differences between one GPU head (codes [Dp], scale, optional bf16 copy [Dp]) and
// the CPU's encoding of its first D values (the rest is zero padding: code 0, copy +0).
struct WriteDiffs {
  int64_t scales = 0, codes = 0, copies = 0;
  std::string first;
  void note(const std::string& what) {
    if (first.empty()) first = what;
  }
};

void compare_head(const CpuRow& want, const uint8_t* codes, uint32_t scale_bits,
                  const uint16_t* copy, int64_t D, int64_t Dp, const std::string& where,
                  WriteDiffs& diffs) {
  if (codes) {
    if (scale_bits != bits_of(want.scale)) {
      ++diffs.scales;
      float got;
      std::memcpy(&got, &scale_bits, 4);
      diffs.note(where + ": scale " + std::to_string(got) + ", want " + std::to_string(want.scale));
    }
    for (int64_t d = 0; d < Dp; ++d) {
      const uint8_t expect = d < D ? want.codes[d] : 0;
      if (codes[d] != expect) {
        ++diffs.codes;
        diffs.note(where + " dim " + std::to_string(d) + ": code " + std::to_string(codes[d]) +
                   ", want " + std::to_string(expect));
      }
    }
  }
  if (copy) {
    for (int64_t d = 0; d < Dp; ++d) {
      const uint16_t expect = d < D ? f32_to_bf16(want.decoded[d]) : 0;
      if (copy[d] != expect) {
        ++diffs.copies;
        diffs.note(where + " dim " + std::to_string(d) + ": copy " +
                   std::to_string(bf16_to_f32(copy[d])) + ", want " +
                   std::to_string(bf16_to_f32(expect)));
      }
    }
  }
}

void expect_no_diffs(const WriteDiffs& d) {
  EXPECT_EQ(d.scales, 0) << "scales that differ from encode_kv_row's; first: " << d.first;
  EXPECT_EQ(d.codes, 0) << "codes that differ from encode_kv_row's; first: " << d.first;
  EXPECT_EQ(d.copies, 0) << "copies that differ from decode_kv_row's; first: " << d.first;
}

// ---- quantise on write ----------------------------------------------------------------------

struct InputsShape {
  int64_t T, Nq, Nkv, D, Dp;
  bool norm, interleaved;
};

// attention_inputs twice on the same projection: bf16 rows (whose k / v copies are the values
// the fp8 run encodes) and fp8 rows; the fp8 cache must be the CPU encoding of the bf16 copies.
void attention_inputs_encode_as_cpu(const InputsShape& s) {
  std::mt19937 rng(fresh_seed() ^ static_cast<uint32_t>(s.T * 131 + s.Dp));
  const int64_t Nqkv = (s.Nq + 2 * s.Nkv) * s.Dp, num_slots = 4 * s.T + 8;
  std::vector<uint16_t> qkv = testing_util::random_bf16(s.T * Nqkv, rng);
  for (int64_t i = 0; i < s.T * Nqkv; ++i) {
    if ((i % Nqkv) % s.Dp >= s.D) qkv[i] = 0;
  }
  // Heads of very different sizes, so the scales differ: each k / v head times 2^[-8, 6].
  std::uniform_int_distribution<int> exponent(-8, 6);
  for (int64_t t = 0; t < s.T; ++t) {
    for (int64_t h = s.Nq; h < s.Nq + 2 * s.Nkv; ++h) {
      const float factor = std::ldexp(1.0f, exponent(rng));
      for (int64_t d = 0; d < s.D; ++d) {
        uint16_t& x = qkv[t * Nqkv + h * s.Dp + d];
        x = f32_to_bf16(bf16_to_f32(x) * factor);
      }
    }
  }
  std::vector<int32_t> positions(s.T), slots(s.T);
  std::uniform_int_distribution<int32_t> pos(0, 100000);
  for (int64_t t = 0; t < s.T; ++t) {
    positions[t] = pos(rng);
    slots[t] = t % 5 == 3 ? -1 : static_cast<int32_t>(4 * t + 1);  // some skipped
  }
  std::vector<float> inv_freq(s.D / 2);
  for (int64_t i = 0; i < s.D / 2; ++i) inv_freq[i] = std::pow(10000.0f, -2.0f * i / s.D);
  const auto q_norm = testing_util::random_bf16(s.D, rng, 0.5f);
  const auto k_norm = testing_util::random_bf16(s.D, rng, 0.5f);

  DeviceBuffer<uint16_t> d_qkv(qkv), d_qn(q_norm), d_kn(k_norm);
  DeviceBuffer<int32_t> d_pos(positions), d_slots(slots);
  DeviceBuffer<float> d_freq(inv_freq);
  const int64_t q_elems = s.T * s.Nq * s.Dp, kv_elems = s.T * s.Nkv * s.Dp;
  const int64_t cache_elems = num_slots * s.Nkv * s.Dp, scale_elems = num_slots * s.Nkv;
  DeviceBuffer<uint16_t> q1(q_elems), k1(kv_elems), v1(kv_elems), kc(cache_elems), vc(cache_elems);
  DeviceBuffer<uint16_t> q2(q_elems), k2(kv_elems), v2(kv_elems);
  DeviceBuffer<uint8_t> k_codes(cache_elems), v_codes(cache_elems);
  DeviceBuffer<float> k_scales(scale_elems), v_scales(scale_elems);
  for (auto* b : {&q1, &k1, &v1, &kc, &vc, &q2, &k2, &v2}) b->poison();
  k_codes.poison();
  v_codes.poison();
  k_scales.poison();
  v_scales.poison();

  AttentionInputsParams p{.qkv = d_qkv.as_bf16(),
                          .qkv_stride = Nqkv,
                          .positions = d_pos.get(),
                          .inv_freq = d_freq.get(),
                          .q_norm = s.norm ? d_qn.as_bf16() : nullptr,
                          .k_norm = s.norm ? d_kn.as_bf16() : nullptr,
                          .eps = 1e-6f,
                          .slots = d_slots.get(),
                          .k_cache = kc.as_bf16(),
                          .v_cache = vc.as_bf16(),
                          .num_slots = num_slots,
                          .q_out = q1.as_bf16(),
                          .k_out = k1.as_bf16(),
                          .v_out = v1.as_bf16(),
                          .num_tokens = s.T,
                          .num_q_heads = s.Nq,
                          .num_kv_heads = s.Nkv,
                          .head_dim = s.D,
                          .padded_head_dim = s.Dp,
                          .rotary_dim = s.D,
                          .attention_scaling = 0.9f,
                          .interleaved = s.interleaved};
  attention_inputs(p, nullptr);
  p.k_cache = p.v_cache = nullptr;
  p.k_codes = k_codes.get();
  p.v_codes = v_codes.get();
  p.k_scales = k_scales.get();
  p.v_scales = v_scales.get();
  p.q_out = q2.as_bf16();
  p.k_out = k2.as_bf16();
  p.v_out = v2.as_bf16();
  attention_inputs(p, nullptr);
  testing_util::synchronize();

  // q is untouched by the row type.
  EXPECT_EQ(q1.download(), q2.download()) << "q differs between the bf16 and the fp8 run";
  const auto k_bf16 = k1.download(), v_bf16 = v1.download();
  const auto k_copy = k2.download(), v_copy = v2.download();
  const auto kcodes = k_codes.download(), vcodes = v_codes.download();
  const auto kscales = k_scales.download(), vscales = v_scales.download();
  WriteDiffs diffs;
  std::vector<bool> written(num_slots, false);
  std::vector<float> head(s.D);
  for (int64_t t = 0; t < s.T; ++t) {
    const int32_t slot = slots[t];
    if (slot >= 0) written[slot] = true;
    for (int plane = 0; plane < 2; ++plane) {
      const auto& bf16_rows = plane == 0 ? k_bf16 : v_bf16;
      const auto& copy = plane == 0 ? k_copy : v_copy;
      const auto& codes = plane == 0 ? kcodes : vcodes;
      const auto& scales = plane == 0 ? kscales : vscales;
      for (int64_t h = 0; h < s.Nkv; ++h) {
        const int64_t at = (t * s.Nkv + h) * s.Dp;
        for (int64_t d = 0; d < s.D; ++d) head[d] = bf16_to_f32(bf16_rows[at + d]);
        const CpuRow want = cpu_encode(head.data(), s.D);
        const int64_t row = static_cast<int64_t>(slot) * s.Nkv + h;
        const std::string where = std::string(plane == 0 ? "k" : "v") + " token " +
                                  std::to_string(t) + " head " + std::to_string(h);
        compare_head(want, slot >= 0 ? &codes[row * s.Dp] : nullptr,
                     slot >= 0 ? bits_of(scales[row]) : 0, &copy[at], s.D, s.Dp, where, diffs);
      }
    }
  }
  expect_no_diffs(diffs);
  int64_t touched = 0;
  for (int64_t slot = 0; slot < num_slots; ++slot) {
    if (written[slot]) continue;
    for (int64_t i = slot * s.Nkv * s.Dp; i < (slot + 1) * s.Nkv * s.Dp; ++i)
      touched += (kcodes[i] != kPoisonCode) + (vcodes[i] != kPoisonCode);
    for (int64_t h = 0; h < s.Nkv; ++h)
      touched += (bits_of(kscales[slot * s.Nkv + h]) != kPoisonScale) +
                 (bits_of(vscales[slot * s.Nkv + h]) != kPoisonScale);
  }
  EXPECT_EQ(touched, 0) << "codes or scales written outside the rows' slots";
}

// kv_cache_write_fp8 over rows of num_heads heads of `width` in a wider stride: codes and scales
// as the CPU encodes the rows, the rows rewritten in place with the decoded values, the rest of
// each row untouched. Token 0's head 0 is all zeros (scale 1, codes 0).
void kv_write_encodes_as_cpu(int64_t T, int64_t num_heads, int64_t width, int64_t stride) {
  std::mt19937 rng(fresh_seed() ^ static_cast<uint32_t>(T * 7 + width));
  const int64_t num_slots = 2 * T + 5;
  std::vector<uint16_t> src = testing_util::random_bf16(T * stride, rng, 3.0f);
  std::fill_n(src.begin(), width, uint16_t{0});
  std::vector<int32_t> slots(T);
  for (int64_t t = 0; t < T; ++t) slots[t] = t % 4 == 2 ? -1 : static_cast<int32_t>(2 * t + 3);
  DeviceBuffer<uint16_t> d_src(src);
  DeviceBuffer<int32_t> d_slots(slots);
  DeviceBuffer<uint8_t> codes(num_slots * num_heads * width);
  DeviceBuffer<float> scales(num_slots * num_heads);
  codes.poison();
  scales.poison();
  kv_cache_write_fp8({.src = d_src.as_bf16(),
                      .codes = codes.get(),
                      .scales = scales.get(),
                      .slots = d_slots.get(),
                      .num_tokens = T,
                      .num_heads = num_heads,
                      .head_width = width,
                      .src_stride = stride,
                      .num_slots = num_slots,
                      .write_back = true},
                     nullptr);
  testing_util::synchronize();
  const auto got_codes = codes.download();
  const auto got_scales = scales.download();
  const auto rewritten = d_src.download();
  WriteDiffs diffs;
  std::vector<float> head(width);
  int64_t beyond = 0;
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t h = 0; h < num_heads; ++h) {
      const int64_t at = t * stride + h * width;
      for (int64_t d = 0; d < width; ++d) head[d] = bf16_to_f32(src[at + d]);
      const CpuRow want = cpu_encode(head.data(), width);
      if (t == 0 && h == 0) EXPECT_EQ(want.scale, 1.0f) << "an all-zero head's scale";
      const int64_t row = static_cast<int64_t>(slots[t]) * num_heads + h;
      compare_head(want, slots[t] >= 0 ? &got_codes[row * width] : nullptr,
                   slots[t] >= 0 ? bits_of(got_scales[row]) : 0, &rewritten[at], width, width,
                   "token " + std::to_string(t) + " head " + std::to_string(h), diffs);
    }
    for (int64_t i = num_heads * width; i < stride; ++i)
      beyond += rewritten[t * stride + i] != src[t * stride + i];
  }
  expect_no_diffs(diffs);
  EXPECT_EQ(beyond, 0) << "elements past the heads were rewritten";
}

// ---- decode over an fp8 cache ---------------------------------------------------------------

struct DecodeCase {
  std::vector<int32_t> seq_lens;
  int64_t Nq, Nkv, D, block_size;
  int64_t window = 0;
  int64_t fixed_chunk = 0;
  bool sinks = false;  // a random sink logit per query head (GPT-OSS), in [-1, 3]
  int64_t attention_chunk = 0;  // Llama 4's chunked layers: keys of the query's own chunk
};

void decode_over_fp8(const DecodeCase& c, bool tensor_cores) {
  std::mt19937 rng(fresh_seed() ^
                   static_cast<uint32_t>(c.D * 13 + c.Nq + c.seq_lens.size() + c.window * 7919));
  const int64_t B = static_cast<int64_t>(c.seq_lens.size());
  const int64_t max_len =
      std::max<int64_t>(1, *std::max_element(c.seq_lens.begin(), c.seq_lens.end()));
  const int64_t max_blocks = (max_len + c.block_size - 1) / c.block_size;
  const int64_t num_blocks = B * max_blocks + 3;
  std::vector<int32_t> pool(num_blocks);
  std::iota(pool.begin(), pool.end(), 0);
  std::shuffle(pool.begin(), pool.end(), rng);
  std::vector<int32_t> tables(B * max_blocks);
  for (int64_t i = 0; i < B * max_blocks; ++i) tables[i] = pool[i];

  // Rows in float32, each (slot, KV head) of its own size (keys within 2^[-2, 0], values within
  // 2^[-6, 3]: scales of every size, scores that stay O(1)), encoded by the CPU encoder.
  const int64_t rows = num_blocks * c.block_size * c.Nkv;
  std::vector<uint8_t> k_codes(rows * c.D), v_codes(rows * c.D);
  std::vector<float> k_scales(rows), v_scales(rows), k_ref(rows * c.D), v_ref(rows * c.D);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> k_exp(-2, 0), v_exp(-6, 3);
  std::vector<float> head(c.D);
  for (int64_t r = 0; r < rows; ++r) {
    for (int plane = 0; plane < 2; ++plane) {
      const float factor = std::ldexp(1.0f, plane == 0 ? k_exp(rng) : v_exp(rng));
      for (auto& x : head) x = normal(rng) * factor;
      const CpuRow enc = cpu_encode(head.data(), c.D);
      (plane == 0 ? k_scales : v_scales)[r] = enc.scale;
      std::copy(enc.codes.begin(), enc.codes.end(),
                (plane == 0 ? k_codes : v_codes).begin() + r * c.D);
      std::copy(enc.decoded.begin(), enc.decoded.end(),
                (plane == 0 ? k_ref : v_ref).begin() + r * c.D);
    }
  }
  auto slot_row = [&](int64_t b, int64_t t) {  // (slot, head 0) row of position t of sequence b
    return (tables[b * max_blocks + t / c.block_size] * c.block_size + t % c.block_size) * c.Nkv;
  };
  // Rows before each sequence's window hold the NaN code: reading one would poison the output.
  auto first_key = [&](int64_t len) {
    if (c.attention_chunk > 0) return len > 0 ? (len - 1) / c.attention_chunk * c.attention_chunk
                                              : int64_t{0};
    return c.window > 0 ? std::max<int64_t>(0, len - c.window) : int64_t{0};
  };
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < first_key(c.seq_lens[b]); ++t)
      for (int64_t i = 0; i < c.Nkv * c.D; ++i)
        k_codes[slot_row(b, t) * c.D + i] = v_codes[slot_row(b, t) * c.D + i] = 0x7f;
  const auto q = testing_util::random_bf16(B * c.Nq * c.D, rng);
  std::vector<float> sinks(c.Nq, 0.0f);
  for (float& x : sinks) x = std::uniform_real_distribution<float>(-1.0f, 3.0f)(rng);
  const float scale = 1.0f / std::sqrt(static_cast<float>(c.D));
  PagedDecodeParams p{.num_seqs = B,
                      .num_q_heads = c.Nq,
                      .num_kv_heads = c.Nkv,
                      .head_dim = c.D,
                      .block_size = c.block_size,
                      .num_blocks = num_blocks,
                      .max_blocks_per_seq = max_blocks,
                      .max_seq_len = max_len,
                      .scale = scale,
                      .sliding_window = c.window,
                      .attention_chunk = c.attention_chunk,
                      .tensor_cores = tensor_cores,
                      .fixed_chunk = c.fixed_chunk};
  DeviceBuffer<uint16_t> d_q(q), d_out(B * c.Nq * c.D);
  DeviceBuffer<uint8_t> d_kc(k_codes), d_vc(v_codes);
  DeviceBuffer<float> d_ks(k_scales), d_vs(v_scales);
  DeviceBuffer<int32_t> d_tables(tables), d_lens(c.seq_lens);
  DeviceBuffer<float> d_ws(std::max<int64_t>(1, paged_decode_workspace_size(p)));
  DeviceBuffer<float> d_sinks(sinks);
  d_out.poison();
  d_ws.poison();
  if (c.sinks) p.sinks = d_sinks.get();
  p.q = d_q.as_bf16();
  p.k_codes = d_kc.get();
  p.v_codes = d_vc.get();
  p.k_scales = d_ks.get();
  p.v_scales = d_vs.get();
  p.block_tables = d_tables.get();
  p.seq_lens = d_lens.get();
  p.out = d_out.as_bf16();
  p.workspace = d_ws.get();
  paged_decode_attention(p, nullptr);
  testing_util::synchronize();

  const auto qf = testing_util::to_float(q);
  const int64_t G = c.Nq / c.Nkv;
  std::vector<double> want(B * c.Nq * c.D, 0.0), bound(want.size(), 1e-3);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t len = c.seq_lens[b];
    const int64_t first = first_key(len), count = len - first;
    for (int64_t h = 0; h < c.Nq; ++h) {
      const int64_t kvh = h / G;
      std::vector<double> s(count);
      double m = -1e300;
      for (int64_t i = 0; i < count; ++i) {
        const int64_t base = (slot_row(b, first + i) + kvh) * c.D;
        double dot = 0;
        for (int64_t d = 0; d < c.D; ++d)
          dot += static_cast<double>(qf[(b * c.Nq + h) * c.D + d]) * k_ref[base + d];
        s[i] = dot * scale;
        m = std::max(m, s[i]);
      }
      // A sink: one more logit of the softmax, with no value row.
      if (c.sinks) m = std::max(m, static_cast<double>(sinks[h]));
      double z = c.sinks ? std::exp(sinks[h] - m) : 0.0;
      for (auto& x : s) z += (x = std::exp(x - m));
      std::vector<double> magnitude(c.D, 0.0);
      for (int64_t i = 0; i < count; ++i) {
        const int64_t base = (slot_row(b, first + i) + kvh) * c.D;
        for (int64_t d = 0; d < c.D; ++d) {
          want[(b * c.Nq + h) * c.D + d] += s[i] / z * v_ref[base + d];
          magnitude[d] += std::fabs(s[i] / z * v_ref[base + d]);
        }
      }
      // As cuda_attention_test.cpp: the natural scale is at least 1/sqrt(keys seen) times the
      // values' size; the tensor-core kernel rounds P and the decoded K and V to bf16, whose
      // error is bounded by a few 2^-9 of sum_t p_t |v_t|.
      for (int64_t d = 0; d < c.D; ++d) {
        const double spread =
            count > 0 ? magnitude[d] / std::sqrt(static_cast<double>(count)) : 1e-6;
        bound[(b * c.Nq + h) * c.D + d] =
            tensor_cores ? std::max(spread, magnitude[d]) : std::max(spread, 1e-6);
      }
    }
  }
  testing_util::expect_bf16_near(d_out.download(), want, bound, "fp8 decode out");
}

// ---- the whole decoder against the CPU's fp8 rows --------------------------------------------

constexpr double kMaxRelError = 2e-2;  // the GPU parity bound (cuda_parity_test.cpp)

// The GPU's fp8 run against the CPU's. The two encode keys and values that differ by the GPU's
// bf16 rounding upstream (its parity error), and e4m3 has 8 codes per binade: where a value lies
// that close to the midpoint of two codes, the devices pick neighbouring codes, an error of one
// code step (6 to 12% of the value) in that element. So the logits differ by the parity error
// plus a share of fp8 rounding's own effect, which on the CPU (fp8 rows against float32 rows, the
// same steps) is 1e-2 to 1e-1 of the logits on the fixtures and random models: the bare parity
// bound cannot hold. Per route the test asserts
//   rel(GPU fp8, CPU fp8) <= 2e-2 + rel(CPU fp8, CPU f32)
// with no routing mismatch, ties being kFp8RoutingTieScale times wider than the sweep's. A CPU
// simulation of the GPU (the same model with its weights moved by 2^-9 to 2^-7 relative noise,
// parity errors of 4e-3 to 2e-2) held both on 189 of 189 random GQA configurations; with the
// sweep's ties, 19 of 126 had routing mismatches. The GPU pool must also be the fp8 one: its bytes
// per token are gpu_kv_bytes_per_token's at kFP8. The distance to the CPU's float32 run is printed.
void expect_fp8_parity(const ModelConfig& config, const testing::ConfigResult& r,
                       const std::string& what) {
  ASSERT_GT(r.positions, 0) << what << ": no logits rows compared";
  // MLA: the padded latent row's codes and two scales.
  const int64_t fp8_bytes =
      config.mla ? gpu_kv_bytes_per_token(config, 0, gpu::padded_mla_dims(config).cache_width(),
                                          KvDType::kFP8)
                 : gpu_kv_bytes_per_token(config, decode_padded_head_dim(config.head_dim), 0,
                                          KvDType::kFP8);
  EXPECT_EQ(r.gpu_kv_bytes_per_token, fp8_bytes) << what << ": the GPU pool is not the fp8 one";
  testing::RouteError to_f32;
  for (const testing::RouteError& e : r.unrounded) {
    to_f32.diff += e.diff;
    to_f32.norm += e.norm;
  }
  std::printf(
      "%s: %lld positions; GPU fp8 vs CPU fp8 %.3e %.3e %.3e (prefill chunked decode), vs CPU "
      "f32 %.3e; CPU fp8 vs f32 %.3e %.3e %.3e; top-1 %lld/%lld, near-tie routes %lld/%lld\n",
      what.c_str(), static_cast<long long>(r.positions), r.routes[0].rel(), r.routes[1].rel(),
      r.routes[2].rel(), to_f32.rel(), r.cpu_rounding[0].rel(), r.cpu_rounding[1].rel(),
      r.cpu_rounding[2].rel(), static_cast<long long>(r.same_top1),
      static_cast<long long>(r.positions), static_cast<long long>(r.near_ties),
      static_cast<long long>(r.routed));
  for (int i = 0; i < 3; ++i) {
    EXPECT_LE(r.routes[i].rel(), kMaxRelError + r.cpu_rounding[i].rel())
        << what << " route " << testing::route_name(static_cast<testing::ScheduleRoute>(i))
        << ": CPU fp8 vs f32 " << r.cpu_rounding[i].rel();
  }
  EXPECT_EQ(r.routing_mismatches, 0) << what << ": " << r.first_mismatch;
}

// Every fixture the GPU runs with fp8 rows, GQA ones or (mla) MLA ones.
void fixtures_match_cpu_fp8(bool mla) {
  int64_t run = 0;
  std::string families;
  for (const std::string& name : testing_support::model_fixture_names()) {
    const auto dir = testing_support::kModelFixtures / name;
    const ModelConfig config = load_model_config(dir / "config.json");
    if (config.mla.has_value() != mla) continue;
    if (gpu_unsupported(config) || gpu_kv_unsupported(config, KvDType::kFP8)) continue;
    SCOPED_TRACE(name);
    auto model = Model::load(dir, LoadOptions{.prefault = false});
    const testing::ConfigResult r = testing::compare_gpu_with_cpu(
        model->config(), model->decoder().weights(), fresh_seed() ^ 0xf8f8, false,
        GpuWeightDtype::kCheckpoint, KvDType::kFP8);
    expect_fp8_parity(model->config(), r, name);
    ++run;
    families += " " + config.model_type;
  }
  if (!mla) {
    EXPECT_GE(run, 8) << "GQA fixtures missing under " << testing_support::kModelFixtures;
    return;
  }
  // deepseek_v2*, deepseek_v3* and kimi_k2* (one of them with a latent and rope key that need
  // padding: deepseek_v2_l36_r12_bf16).
  EXPECT_GE(run, 6) << "MLA fixtures missing under " << testing_support::kModelFixtures;
  for (const char* type : {"deepseek_v2", "deepseek_v3", "kimi_k2"}) {
    EXPECT_NE(families.find(type), std::string::npos)
        << "no " << type << " fixture ran:" << families;
  }
}

void random_model_matches_cpu_fp8(ModelFamily family, bool deterministic) {
  const uint64_t seed = fresh_seed() ^ (static_cast<uint64_t>(family) * 0x9e3779b9ull);
  testing::RandomModel model = testing::make_random_model(family, seed);
  SCOPED_TRACE(::testing::Message()
               << family_name(family) << " seed " << seed << "\n  config " << model.config_json);
  if (gpu_unsupported(model.config) || gpu_kv_unsupported(model.config, KvDType::kFP8)) {
    GTEST_SKIP() << "the GPU does not run this configuration with fp8 rows";
  }
  const testing::ConfigResult r = testing::compare_gpu_with_cpu(
      model, seed ^ 0x5eed, deterministic, GpuWeightDtype::kCheckpoint, KvDType::kFP8);
  expect_fp8_parity(model.config, r,
                    std::string(family_name(family)) + (deterministic ? " deterministic" : ""));
}

// A random DeepSeek model whose latent and rope key are overridden past 512 + 64, so that its
// fp8 rows are read by the streaming kernel (mla_decode_wide_kernel<true>).
void wide_mla_matches_cpu_fp8(ModelFamily family, const nlohmann::json& overrides,
                              bool deterministic, uint64_t seed) {
  testing::RandomModel model = testing::make_random_model(family, seed, overrides);
  SCOPED_TRACE(::testing::Message()
               << family_name(family) << " seed " << seed << "\n  config " << model.config_json);
  const gpu::MlaPaddedDims dims = gpu::padded_mla_dims(model.config);
  ASSERT_TRUE(mla_decode_is_wide({.latent_dim = dims.latent, .rope_dim = dims.rope}))
      << "padded latent " << dims.latent << " + rope " << dims.rope;
  ASSERT_EQ(gpu_kv_unsupported(model.config, KvDType::kFP8), std::nullopt);
  const testing::ConfigResult r = testing::compare_gpu_with_cpu(
      model, seed ^ 0x5eed, deterministic, GpuWeightDtype::kCheckpoint, KvDType::kFP8);
  expect_fp8_parity(
      model.config, r,
      std::string(family_name(family)) + " wide" + (deterministic ? " deterministic" : ""));
}

[[maybe_unused]] const bool kRegistered = [] {
  if (!testing_util::cuda_device_present("fp8 KV")) return false;
  const InputsShape inputs[] = {
      {1, 32, 4, 128, 128, true, false}, {37, 32, 4, 128, 128, true, false},
      {19, 4, 2, 16, 64, true, false},   {19, 4, 4, 8, 64, false, false},
      {5, 16, 16, 64, 64, false, true},  {3, 8, 2, 256, 256, true, false},
      {99, 8, 2, 80, 128, true, true}};
  for (const InputsShape& s : inputs) {
    const std::string name = "AttentionInputs_T" + std::to_string(s.T) + "_Nq" +
                             std::to_string(s.Nq) + "_Nkv" + std::to_string(s.Nkv) + "_D" +
                             std::to_string(s.D) + "_Dp" + std::to_string(s.Dp) +
                             (s.norm ? "_Norm" : "") + (s.interleaved ? "_Interleaved" : "");
    testing_util::register_kernel_test(
        "CudaKvFp8Write", name, [s] { attention_inputs_encode_as_cpu(s); }, __FILE__, __LINE__);
  }
  struct WriteShape {
    int64_t T, heads, width, stride;
  };
  for (const WriteShape& w :
       {WriteShape{1, 4, 128, 512}, WriteShape{19, 2, 64, 136}, WriteShape{99, 3, 80, 400},
        WriteShape{5, 1, 1000, 1000}, WriteShape{37, 8, 256, 3 * 8 * 256}}) {
    const std::string name = "KvCacheWrite_T" + std::to_string(w.T) + "_H" +
                             std::to_string(w.heads) + "_W" + std::to_string(w.width) + "_S" +
                             std::to_string(w.stride);
    testing_util::register_kernel_test(
        "CudaKvFp8Write", name, [w] { kv_write_encodes_as_cpu(w.T, w.heads, w.width, w.stride); },
        __FILE__, __LINE__);
  }
  struct Dc {
    const char* name;
    DecodeCase c;
  };
  const Dc decode_cases[] = {
      {"B1_Len1_G8_D128", {{1}, 32, 4, 128, 16}},
      {"B1_Len989_G8_D128", {{989}, 32, 4, 128, 16}},
      {"B3_Mixed_G4_D64", {{17, 0, 300}, 8, 2, 64, 32}},
      {"B2_Len3000_G1_D128", {{3000, 1234}, 4, 4, 128, 16}},
      {"B5_Mixed_G8_D256", {{1, 64, 65, 511, 700}, 16, 2, 256, 8}},
      {"B3_Mixed_G40_D128", {{1, 300, 1000}, 80, 2, 128, 16}},
      {"B4_Odd_G6_D64_Block1", {{19, 99, 1, 7}, 12, 2, 64, 1}},
      {"Win50_B2_G24_D256", {{77, 130}, 48, 2, 256, 8, 50}},
      {"Win200_B5_AroundWindow_G4_D64", {{199, 200, 201, 17, 1000}, 8, 2, 64, 16, 200}},
      // Attention sinks (GPT-OSS's shapes: 64 query heads over 8 KV heads of 64, window 128),
      // one split and several.
      {"Sinks_B3_Mixed_G4_D64", {{1, 17, 300}, 8, 2, 64, 32, 0, 0, true}},
      {"Sinks_Win128_B2_Len1000_G8_D64", {{1000, 129}, 64, 8, 64, 16, 128, 0, true}},
      {"Sinks_B2_Len3000_G1_D128", {{3000, 1234}, 4, 4, 128, 16, 0, 0, true}},
      // Chunked local attention (Llama 4): chunk starts mid-block and mid-split, on a boundary
      // (len 201, C 200: one key), and an empty sequence.
      {"Chunk100_B2_Len1000_3000_G8_D128", {{1000, 3000}, 32, 4, 128, 16, 0, 0, false, 100}},
      {"Chunk200_B5_AroundBoundary_G4_D64",
       {{199, 200, 201, 0, 1000}, 8, 2, 64, 16, 0, 0, false, 200}},
  };
  for (const Dc& d : decode_cases) {
    for (bool tc : {true, false}) {
      const DecodeCase c = d.c;
      testing_util::register_kernel_test(
          "CudaKvFp8Decode", std::string(d.name) + (tc ? "_TensorCores" : "_CudaCores"),
          [c, tc] { decode_over_fp8(c, tc); }, __FILE__, __LINE__);
    }
  }
  // Fixed chunks (--deterministic) through the workspace and the combine kernel: tensor cores.
  testing_util::register_kernel_test(
      "CudaKvFp8Decode", "Chunk256_B3_Odd_G4_D128_TensorCores",
      [] {
        decode_over_fp8({{989, 1, 257}, 8, 2, 128, 16, 0, 256}, true);
      },
      __FILE__, __LINE__);
  testing_util::register_kernel_test(
      "CudaKvFp8Decode", "Sinks_Chunk256_B3_Odd_G4_D64_TensorCores",
      [] {
        decode_over_fp8({{989, 1, 257}, 8, 2, 64, 16, 0, 256, true}, true);
      },
      __FILE__, __LINE__);
  testing_util::register_kernel_test(
      "CudaKvFp8Decode", "Chunk64_Win300_B2_G24_D64_TensorCores",
      [] {
        decode_over_fp8({{989, 300}, 24, 1, 64, 16, 300, 64}, true);
      },
      __FILE__, __LINE__);

  testing_util::register_kernel_test(
      "CudaKvFp8Decoder", "GqaFixturesMatchTheCpuFp8Cache", [] { fixtures_match_cpu_fp8(false); },
      __FILE__, __LINE__);
  testing_util::register_kernel_test(
      "CudaMlaKvFp8Decoder", "MlaFixturesMatchTheCpuFp8Cache", [] { fixtures_match_cpu_fp8(true); },
      __FILE__, __LINE__);
  for (ModelFamily family : {ModelFamily::kDeepseekV2, ModelFamily::kDeepseekV3}) {
    testing_util::register_kernel_test(
        "CudaMlaKvFp8Decoder", "Random_" + std::string(family_name(family)),
        [family] { random_model_matches_cpu_fp8(family, false); }, __FILE__, __LINE__);
  }
  testing_util::register_kernel_test(
      "CudaMlaKvFp8Decoder", "Random_deepseek_v3_Deterministic",
      [] { random_model_matches_cpu_fp8(ModelFamily::kDeepseekV3, true); }, __FILE__, __LINE__);
  // Wide latents (the streaming kernel), as cuda_mla_wide_decoder_test.cpp's: neither dim a
  // multiple of 8 (padded to 1008 + 64), and 1024 + 64 under --deterministic.
  const uint64_t wide_seed = fresh_seed();
  testing_util::register_kernel_test(
      "CudaMlaKvFp8Decoder", "Wide_deepseek_v2_L1001_R62",
      [wide_seed] {
        wide_mla_matches_cpu_fp8(ModelFamily::kDeepseekV2,
                                 {{"kv_lora_rank", 1001}, {"qk_rope_head_dim", 62}}, false,
                                 wide_seed);
      },
      __FILE__, __LINE__);
  testing_util::register_kernel_test(
      "CudaMlaKvFp8Decoder", "Wide_deepseek_v3_L1024_R64_Deterministic",
      [wide_seed] {
        wide_mla_matches_cpu_fp8(ModelFamily::kDeepseekV3,
                                 {{"kv_lora_rank", 1024}, {"qk_rope_head_dim", 64}}, true,
                                 wide_seed + 1000003);
      },
      __FILE__, __LINE__);
  for (ModelFamily family : {ModelFamily::kQwen3Moe, ModelFamily::kMixtral, ModelFamily::kOlmoe,
                             ModelFamily::kQwen2Moe}) {
    testing_util::register_kernel_test(
        "CudaKvFp8Decoder", "Random_" + std::string(family_name(family)),
        [family] { random_model_matches_cpu_fp8(family, false); }, __FILE__, __LINE__);
  }
  testing_util::register_kernel_test(
      "CudaKvFp8Decoder", "Random_qwen3_moe_Deterministic",
      [] { random_model_matches_cpu_fp8(ModelFamily::kQwen3Moe, true); }, __FILE__, __LINE__);
  return true;
}();

}  // namespace
}  // namespace moeinfer::cuda

#endif  // MOE_HAVE_CUDA

// The Gated DeltaNet kernels (backend/cuda/gated_delta_net.h) against a float64 host reference
// of Decoder::linear_attention's conv and delta rule: fresh random inputs every run
// (MOE_TEST_SEED replays one), outputs poisoned first, and the state slots of fresh sequences
// poisoned too (a sequence at position 0 must not read its slot's old contents).
//
// The scenario, per shape: a prefill of three sequences of lengths 5, 1 and 17 in slots 3, 0
// and 2; then three decode steps of those sequences continuing their state, with a padding
// sequence (slot -1) after them as a graph bucket has; then the 17-token prompt again in slot 4
// as chunks of 7 and 10, which must give the whole prefill's rows and state bit for bit (the
// arithmetic per token does not depend on the chunking). Shapes: key dims 24 and 72 (a partial
// warp, three warps), value dims 40 and 16 (two tiles, the second partial; one partial tile),
// two value heads per key head and one, conv kernels of 4 and 3 taps.
//
// Tolerances: float32 outputs and states against float64: |got - want| <= 1e-4 (|want| + rms),
// rms the root mean square of the reference's row (the recurrence sums Dk products a step over
// up to 20 steps, and expf/log1pf are within a few ulps). bf16 outputs (gated norm, output gate):
// the 1e-2 contract of CONVENTIONS.md.
#include <gtest/gtest.h>

#if defined(MOE_HAVE_CUDA) && MOE_HAVE_CUDA

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/gated_delta_net.h"
#include "core/dtype.h"
#include "core/error.h"
#include "cuda_test_util.h"

namespace moeinfer::cuda {
namespace {

using testing_util::cuda_device_present;
using testing_util::DeviceBuffer;
using testing_util::expect_error_naming;
using testing_util::fresh_seed;
using testing_util::register_kernel_test;
using testing_util::synchronize;

struct Shape {
  int64_t Nk, Nv, Dk, Dv, taps;
  int64_t key_dim() const { return Nk * Dk; }
  int64_t C() const { return 2 * Nk * Dk + Nv * Dv; }
  int64_t Vd() const { return Nv * Dv; }
};

// ---------------------------------------------------------------------------------------------
// Host-side checks: need no device; each refusal comes before any pointer is used.

template <typename T>
T* fake(uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

DeltaNetSequences fake_sequences() {
  return {.cu_seqlens = fake<const int32_t>(0x100),
          .state_slots = fake<const int32_t>(0x200),
          .positions = fake<const int32_t>(0x300),
          .num_seqs = 1,
          .num_slots = 1};
}

TEST(GatedDeltaNetChecks, RefusesShapesTheKernelsDoNotTake) {
  DeltaNetConvParams conv{.seqs = fake_sequences(), .x = fake<const float>(0x400), .x_stride = 8,
                          .weight = fake<const float>(0x500), .conv_state = fake<float>(0x600),
                          .out = fake<float>(0x700), .num_channels = 8, .taps = 9};
  expect_error_naming([&] { delta_net_conv(conv, nullptr); }, "conv taps = 9");
  conv.taps = 4;
  conv.x_stride = 7;
  expect_error_naming([&] { delta_net_conv(conv, nullptr); }, "x_stride = 7");

  DeltaNetRecurrenceParams rec{.seqs = fake_sequences(), .qkv = fake<const float>(0x400),
                               .qkv_stride = 1 << 20, .b = fake<const float>(0x500),
                               .a = fake<const float>(0x500), .ba_stride = 8,
                               .a_log = fake<const float>(0x600),
                               .dt_bias = fake<const float>(0x600), .state = fake<float>(0x700),
                               .out = fake<float>(0x800), .num_key_heads = 2,
                               .num_value_heads = 3, .key_dim = 64, .value_dim = 64};
  expect_error_naming([&] { delta_net_recurrence(rec, nullptr); }, "num_value_heads = 3");
  rec.num_value_heads = 4;
  rec.key_dim = 300;
  expect_error_naming([&] { delta_net_recurrence(rec, nullptr); }, "key_dim = 300");
  rec.key_dim = 64;
  rec.qkv_stride = 100;
  expect_error_naming([&] { delta_net_recurrence(rec, nullptr); }, "qkv_stride = 100");
  rec.qkv_stride = 1 << 20;
  rec.seqs.num_slots = 0;
  expect_error_naming([&] { delta_net_recurrence(rec, nullptr); }, "num_slots = 0");

  GatedRmsNormParams norm{.x = fake<const float>(0x400), .z = fake<const float>(0x500),
                          .z_stride = 8, .heads = 2, .weight = fake<const float>(0x600),
                          .out = fake<__nv_bfloat16>(0x700), .rows = 3, .width = 4};
  expect_error_naming([&] { gated_rms_norm(norm, nullptr); }, "rows = 3");
}

// ---------------------------------------------------------------------------------------------
// Host reference (float64), Decoder::linear_attention's order of operations.

double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }
double softplus(double x) { return x > 20.0 ? x : std::log1p(std::exp(x)); }

struct Weights {
  std::vector<float> conv;     // [C, taps]
  std::vector<float> a_log;    // [Nv]
  std::vector<float> dt_bias;  // [Nv]
};

struct HostState {
  std::vector<double> conv;   // [slots, C, taps - 1]
  std::vector<double> delta;  // [slots, Nv, Dk, Dv]
};

struct Seq {
  int32_t slot;
  int32_t position;  // of its first row
  int32_t length;
};

// One step of `seqs` over rows x [T, x_stride] and ba [T, 2 Nv] (b then a): the conv's output
// [T, C] and the recurrence's [T, Vd]; padding sequences (slot < 0) give zero output rows.
void reference_step(const Shape& s, const Weights& w, const std::vector<float>& x,
                    int64_t x_stride, const std::vector<float>& ba, const std::vector<Seq>& seqs,
                    HostState& state, std::vector<double>& conv_out, std::vector<double>& out) {
  const int64_t C = s.C(), hist = s.taps - 1, r = s.Nv / s.Nk, key_dim = s.key_dim();
  int64_t T = 0;
  for (const Seq& q : seqs) T += q.length;
  conv_out.assign(T * C, 0.0);
  out.assign(T * s.Vd(), 0.0);
  int64_t first = 0;
  for (const Seq& q : seqs) {
    if (q.slot < 0) {
      first += q.length;
      continue;
    }
    double* cs = state.conv.data() + q.slot * C * hist;
    double* S_all = state.delta.data() + q.slot * s.Nv * s.Dk * s.Dv;
    if (q.position == 0) {
      std::fill_n(cs, C * hist, 0.0);
      std::fill_n(S_all, s.Nv * s.Dk * s.Dv, 0.0);
    }
    for (int64_t c = 0; c < C; ++c) {
      std::vector<double> window(cs + c * hist, cs + (c + 1) * hist);
      for (int64_t t = 0; t < q.length; ++t) window.push_back(x[(first + t) * x_stride + c]);
      for (int64_t t = 0; t < q.length; ++t) {
        double acc = 0.0;
        for (int64_t j = 0; j < s.taps; ++j) acc += w.conv[c * s.taps + j] * window[t + j];
        conv_out[(first + t) * C + c] = acc * sigmoid(acc);
      }
      std::copy(window.end() - hist, window.end(), cs + c * hist);
    }
    for (int64_t h = 0; h < s.Nv; ++h) {
      const int64_t g = h / r;
      double* S = S_all + h * s.Dk * s.Dv;
      for (int64_t t = first; t < first + q.length; ++t) {
        const double* row = conv_out.data() + t * C;
        std::vector<double> qv(s.Dk), kv(s.Dk);
        double q_sq = 0.0, k_sq = 0.0;
        for (int64_t d = 0; d < s.Dk; ++d) {
          qv[d] = row[g * s.Dk + d];
          kv[d] = row[key_dim + g * s.Dk + d];
          q_sq += qv[d] * qv[d];
          k_sq += kv[d] * kv[d];
        }
        const double qn = 1.0 / std::sqrt(static_cast<double>(s.Dk)) / std::sqrt(q_sq + 1e-6);
        const double kn = 1.0 / std::sqrt(k_sq + 1e-6);
        for (int64_t d = 0; d < s.Dk; ++d) {
          qv[d] *= qn;
          kv[d] *= kn;
        }
        const double beta = sigmoid(ba[t * 2 * s.Nv + h]);
        const double decay = std::exp(-std::exp(static_cast<double>(w.a_log[h])) *
                                      softplus(ba[t * 2 * s.Nv + s.Nv + h] + w.dt_bias[h]));
        std::vector<double> mem(s.Dv, 0.0);
        for (int64_t i = 0; i < s.Dk; ++i) {
          for (int64_t j = 0; j < s.Dv; ++j) {
            S[i * s.Dv + j] *= decay;
            mem[j] += S[i * s.Dv + j] * kv[i];
          }
        }
        for (int64_t j = 0; j < s.Dv; ++j) mem[j] = (row[2 * key_dim + h * s.Dv + j] - mem[j]) * beta;
        for (int64_t i = 0; i < s.Dk; ++i) {
          for (int64_t j = 0; j < s.Dv; ++j) {
            S[i * s.Dv + j] += kv[i] * mem[j];
            out[t * s.Vd() + h * s.Dv + j] += S[i * s.Dv + j] * qv[i];
          }
        }
      }
    }
    first += q.length;
  }
}

// |got - want| <= 1e-4 (|want| + rms of the row), rows of `width`; NaN fails.
void expect_f32_near(const std::vector<float>& got, const std::vector<double>& want,
                     int64_t width, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int64_t bad = 0;
  for (size_t row = 0; row * width < want.size(); ++row) {
    double sq = 0.0;
    for (int64_t i = 0; i < width; ++i) sq += want[row * width + i] * want[row * width + i];
    const double rms = std::sqrt(sq / static_cast<double>(width));
    for (int64_t i = 0; i < width; ++i) {
      const size_t k = row * width + i;
      const double bound = 1e-4 * (std::fabs(want[k]) + rms) + 1e-30;
      if (!(std::fabs(got[k] - want[k]) <= bound)) {
        if (bad++ < 5) {
          ADD_FAILURE() << what << "[" << row << ", " << i << "] = " << got[k] << ", want "
                        << want[k] << " (bound " << bound << ")";
        }
      }
    }
  }
  EXPECT_EQ(bad, 0) << what;
}

// ---------------------------------------------------------------------------------------------
// The device side of the scenario.

class DeviceRun {
 public:
  DeviceRun(const Shape& s, const Weights& w, int64_t num_slots)
      : s_(s),
        num_slots_(num_slots),
        conv_w_(w.conv),
        a_log_(w.a_log),
        dt_bias_(w.dt_bias),
        conv_state_(static_cast<size_t>(num_slots * s.C() * (s.taps - 1))),
        delta_state_(static_cast<size_t>(num_slots * s.Nv * s.Dk * s.Dv)) {
    conv_state_.poison();  // NaN: a fresh sequence must not read it
    delta_state_.poison();
  }

  // Runs one step; returns the conv's output [T, C] and the recurrence's [T, Vd].
  void step(const std::vector<float>& x, int64_t x_stride, const std::vector<float>& ba,
            const std::vector<Seq>& seqs, std::vector<float>& conv_out, std::vector<float>& out) {
    std::vector<int32_t> cu{0}, slots, positions;
    for (const Seq& q : seqs) {
      slots.push_back(q.slot);
      for (int32_t t = 0; t < q.length; ++t) positions.push_back(q.position + t);
      cu.push_back(cu.back() + q.length);
    }
    const int64_t T = cu.back();
    DeviceBuffer<int32_t> d_cu(cu), d_slots(slots), d_pos(positions);
    DeviceBuffer<float> d_x(x), d_ba(ba);
    DeviceBuffer<float> d_conv(static_cast<size_t>(T * s_.C())), d_out(static_cast<size_t>(T * s_.Vd()));
    d_conv.poison();
    d_out.poison();
    const DeltaNetSequences sq{.cu_seqlens = d_cu.get(), .state_slots = d_slots.get(),
                               .positions = d_pos.get(),
                               .num_seqs = static_cast<int64_t>(seqs.size()),
                               .num_slots = num_slots_};
    delta_net_conv({.seqs = sq, .x = d_x.get(), .x_stride = x_stride, .weight = conv_w_.get(),
                    .conv_state = conv_state_.get(), .out = d_conv.get(),
                    .num_channels = s_.C(), .taps = s_.taps},
                   nullptr);
    delta_net_recurrence({.seqs = sq, .qkv = d_conv.get(), .qkv_stride = s_.C(),
                          .b = d_ba.get(), .a = d_ba.get() + s_.Nv, .ba_stride = 2 * s_.Nv,
                          .a_log = a_log_.get(), .dt_bias = dt_bias_.get(),
                          .state = delta_state_.get(), .out = d_out.get(),
                          .num_key_heads = s_.Nk, .num_value_heads = s_.Nv, .key_dim = s_.Dk,
                          .value_dim = s_.Dv},
                         nullptr);
    synchronize();
    conv_out = d_conv.download();
    out = d_out.download();
  }

  std::vector<float> conv_state() const { return conv_state_.download(); }
  std::vector<float> delta_state() const { return delta_state_.download(); }

 private:
  Shape s_;
  int64_t num_slots_;
  DeviceBuffer<float> conv_w_, a_log_, dt_bias_, conv_state_, delta_state_;
};

std::vector<float> normal(size_t n, std::mt19937& rng, float scale) {
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(n);
  for (float& value : v) value = dist(rng);
  return v;
}

// The rows of a slot's state, for comparing one slot.
template <typename T>
std::vector<T> slot_of(const std::vector<T>& all, int64_t slot, int64_t per_slot) {
  return std::vector<T>(all.begin() + slot * per_slot, all.begin() + (slot + 1) * per_slot);
}

void prefill_decode_and_chunks(const Shape& s) {
  std::mt19937 rng(fresh_seed());
  const int64_t C = s.C(), hist = s.taps - 1, slots = 5;
  const int64_t x_stride = C + 5;  // the decoder's rows carry z, b and a after the channels
  const Weights w{.conv = normal(C * s.taps, rng, 0.5f), .a_log = normal(s.Nv, rng, 0.5f),
                  .dt_bias = normal(s.Nv, rng, 1.0f)};
  DeviceRun gpu(s, w, slots);
  HostState host{.conv = std::vector<double>(slots * C * hist, 0.0),
                 .delta = std::vector<double>(slots * s.Nv * s.Dk * s.Dv, 0.0)};
  std::vector<float> conv_got, out_got;
  std::vector<double> conv_want, out_want;
  const int64_t conv_slot = C * hist, delta_slot = s.Nv * s.Dk * s.Dv;

  // Prefill: lengths 5, 1, 17 in slots 3, 0, 2.
  const std::vector<Seq> prefill{{3, 0, 5}, {0, 0, 1}, {2, 0, 17}};
  const int64_t T = 23;
  const std::vector<float> x = normal(T * x_stride, rng, 1.0f);
  const std::vector<float> ba = normal(T * 2 * s.Nv, rng, 1.0f);
  gpu.step(x, x_stride, ba, prefill, conv_got, out_got);
  reference_step(s, w, x, x_stride, ba, prefill, host, conv_want, out_want);
  expect_f32_near(conv_got, conv_want, C, "prefill conv");
  expect_f32_near(out_got, out_want, s.Vd(), "prefill out");

  // Decode: one token each, three steps, and a padding sequence after them.
  std::vector<int32_t> positions{5, 1, 17};
  for (int step = 0; step < 3; ++step) {
    std::vector<Seq> decode;
    for (int i = 0; i < 3; ++i) decode.push_back({prefill[i].slot, positions[i]++, 1});
    decode.push_back({-1, 0, 1});
    const std::vector<float> dx = normal(4 * x_stride, rng, 1.0f);
    const std::vector<float> dba = normal(4 * 2 * s.Nv, rng, 1.0f);
    gpu.step(dx, x_stride, dba, decode, conv_got, out_got);
    reference_step(s, w, dx, x_stride, dba, decode, host, conv_want, out_want);
    // The padding row's conv output is not written: compare the three sequences' rows only.
    conv_got.resize(3 * C);
    conv_want.resize(3 * C);
    expect_f32_near(conv_got, conv_want, C, "decode conv, step " + std::to_string(step));
    expect_f32_near(out_got, out_want, s.Vd(), "decode out, step " + std::to_string(step));
  }
  const std::vector<float> conv_state = gpu.conv_state(), delta_state = gpu.delta_state();
  for (int32_t slot : {0, 2, 3}) {
    expect_f32_near(slot_of(conv_state, slot, conv_slot),
                    std::vector<double>(host.conv.begin() + slot * conv_slot,
                                        host.conv.begin() + (slot + 1) * conv_slot),
                    hist, "conv state of slot " + std::to_string(slot));
    expect_f32_near(slot_of(delta_state, slot, delta_slot),
                    std::vector<double>(host.delta.begin() + slot * delta_slot,
                                        host.delta.begin() + (slot + 1) * delta_slot),
                    s.Dv, "delta state of slot " + std::to_string(slot));
  }

  // The 17-token prompt (rows 6..22 of the prefill) again, in slot 4, as chunks of 7 and 10:
  // bit for bit the whole prefill's rows and state.
  DeviceRun whole(s, w, slots), chunked(s, w, slots);
  const std::vector<float> px(x.begin() + 6 * x_stride, x.end());
  const std::vector<float> pba(ba.begin() + 6 * 2 * s.Nv, ba.end());
  std::vector<float> whole_conv, whole_out;
  whole.step(px, x_stride, pba, {{4, 0, 17}}, whole_conv, whole_out);
  std::vector<float> chunk_conv, chunk_out, part_conv, part_out;
  chunked.step(std::vector<float>(px.begin(), px.begin() + 7 * x_stride), x_stride,
               std::vector<float>(pba.begin(), pba.begin() + 7 * 2 * s.Nv), {{4, 0, 7}},
               chunk_conv, chunk_out);
  chunked.step(std::vector<float>(px.begin() + 7 * x_stride, px.end()), x_stride,
               std::vector<float>(pba.begin() + 7 * 2 * s.Nv, pba.end()), {{4, 7, 10}},
               part_conv, part_out);
  chunk_conv.insert(chunk_conv.end(), part_conv.begin(), part_conv.end());
  chunk_out.insert(chunk_out.end(), part_out.begin(), part_out.end());
  auto same_bits = [](const std::vector<float>& a, const std::vector<float>& b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
  };
  EXPECT_TRUE(same_bits(chunk_conv, whole_conv)) << "chunked conv output";
  EXPECT_TRUE(same_bits(chunk_out, whole_out)) << "chunked recurrence output";
  EXPECT_TRUE(same_bits(slot_of(chunked.conv_state(), 4, conv_slot),
                        slot_of(whole.conv_state(), 4, conv_slot)))
      << "chunked conv state";
  EXPECT_TRUE(same_bits(slot_of(chunked.delta_state(), 4, delta_slot),
                        slot_of(whole.delta_state(), 4, delta_slot)))
      << "chunked delta state";
}

void gated_rms_norm_matches() {
  std::mt19937 rng(fresh_seed());
  const int64_t T = 7, heads = 3, width = 40, z_stride = heads * width + 9;
  const std::vector<float> x = normal(T * heads * width, rng, 2.0f);
  const std::vector<float> z = normal(T * z_stride, rng, 1.5f);
  const std::vector<float> weight = normal(width, rng, 1.0f);
  DeviceBuffer<float> d_x(x), d_z(z), d_w(weight);
  DeviceBuffer<uint16_t> d_out(static_cast<size_t>(T * heads * width));
  d_out.poison();
  gated_rms_norm({.x = d_x.get(), .z = d_z.get(), .z_stride = z_stride, .heads = heads,
                  .weight = d_w.get(), .out = d_out.as_bf16(), .rows = T * heads, .width = width,
                  .eps = 1e-6f},
                 nullptr);
  synchronize();
  std::vector<double> want(x.size()), scale(x.size());
  for (int64_t r = 0; r < T * heads; ++r) {
    double sq = 0.0;
    for (int64_t i = 0; i < width; ++i) sq += double{x[r * width + i]} * x[r * width + i];
    const double inv = 1.0 / std::sqrt(sq / width + 1e-6);
    for (int64_t i = 0; i < width; ++i) {
      const double zi = z[(r / heads) * z_stride + (r % heads) * width + i];
      want[r * width + i] = weight[i] * (x[r * width + i] * inv) * zi * sigmoid(zi);
      scale[r * width + i] = 0.0;
    }
  }
  testing_util::expect_bf16_near(d_out.download(), want, scale, "gated_rms_norm");
}

void output_gate_matches() {
  std::mt19937 rng(fresh_seed());
  const int64_t rows = 9, width = 72, gate_stride = 3 * width + 8;
  std::vector<uint16_t> x = testing_util::random_bf16(rows * width, rng);
  const std::vector<uint16_t> gate = testing_util::random_bf16(rows * gate_stride, rng, 2.0f);
  DeviceBuffer<uint16_t> d_x(x), d_gate(gate);
  attention_output_gate({.x = d_x.as_bf16(), .gate = d_gate.as_bf16(),
                         .gate_stride = gate_stride, .rows = rows, .width = width},
                        nullptr);
  synchronize();
  std::vector<double> want(x.size()), scale(x.size(), 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < width; ++i) {
      want[r * width + i] =
          bf16_to_f32(x[r * width + i]) * sigmoid(bf16_to_f32(gate[r * gate_stride + i]));
    }
  }
  testing_util::expect_bf16_near(d_x.download(), want, scale, "attention_output_gate");
}

[[maybe_unused]] const bool kRegistered = [] {
  if (!cuda_device_present("Gated DeltaNet")) return false;
  register_kernel_test(
      "GatedDeltaNet", "PrefillDecodeAndChunksMatchTheHostKeyDim24",
      [] { prefill_decode_and_chunks({.Nk = 2, .Nv = 4, .Dk = 24, .Dv = 40, .taps = 4}); },
      __FILE__, __LINE__);
  register_kernel_test(
      "GatedDeltaNet", "PrefillDecodeAndChunksMatchTheHostKeyDim72",
      [] { prefill_decode_and_chunks({.Nk = 1, .Nv = 1, .Dk = 72, .Dv = 16, .taps = 3}); },
      __FILE__, __LINE__);
  register_kernel_test("GatedDeltaNet", "GatedRmsNormMatchesTheHost", gated_rms_norm_matches,
                       __FILE__, __LINE__);
  register_kernel_test("GatedDeltaNet", "OutputGateMatchesTheHost", output_gate_matches, __FILE__,
                       __LINE__);
  return true;
}();

}  // namespace
}  // namespace moeinfer::cuda

#endif  // MOE_HAVE_CUDA

// GPTQ and AWQ 4-bit linears: known packed words give known values in both layouts (nibble
// order, GPTQ's zero-minus-one, g_idx groups), and WeightSource names the tensor and the problem
// for every malformed checkpoint instead of reading past a buffer.
#include "model/packed_int4.h"

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <vector>

#include "../support/temp_path.h"
#include "core/dtype.h"
#include "core/error.h"
#include "io/safetensors.h"
#include "model/weight_quant.h"
#include "model/weight_source.h"

namespace moeinfer {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

std::vector<float> dequantize(const PackedInt4Linear& linear, Int4Packing packing,
                              bool zero_minus_one) {
  std::vector<uint16_t> out(static_cast<size_t>(linear.num_rows * linear.num_cols), 0xFFFF);
  dequantize_packed_int4(linear, packing, zero_minus_one, out.data());
  std::vector<float> values(out.size());
  for (size_t i = 0; i < out.size(); ++i) values[i] = bf16_to_f32(out[i]);
  return values;
}

TEST(PackedInt4, GptqPacksInputsLowNibbleFirst) {
  // N 8, K 16, one group of 16. Output n's word in packed row i holds inputs 8i..8i+7.
  const int64_t N = 8, K = 16;
  std::vector<int32_t> qweight(2 * N);
  for (int64_t n = 0; n < N; ++n) {
    qweight[n] = 0x76543210;                             // inputs 0..7: codes 0..7
    qweight[N + n] = static_cast<int32_t>(0xFEDCBA98u);  // inputs 8..15: codes 8..15
  }
  const std::vector<int32_t> qzeros = {static_cast<int32_t>(0x87654321u)};  // output n: n + 1
  std::vector<float> scales(N);
  for (int64_t n = 0; n < N; ++n) scales[n] = 0.25f * static_cast<float>(n + 1);
  const PackedInt4Linear linear{.qweight = qweight.data(),
                                .qzeros = qzeros.data(),
                                .scales = scales.data(),
                                .num_rows = N,
                                .num_cols = K,
                                .group_size = K};
  const std::vector<float> v2 = dequantize(linear, Int4Packing::kGptq, false);
  const std::vector<float> v1 = dequantize(linear, Int4Packing::kGptq, true);
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t k = 0; k < K; ++k) {
      EXPECT_EQ(v2[n * K + k], static_cast<float>(k - (n + 1)) * scales[n]) << n << "," << k;
      EXPECT_EQ(v1[n * K + k], static_cast<float>(k - (n + 2)) * scales[n]) << n << "," << k;
    }
  }
}

TEST(PackedInt4, GptqFirstFormatReadsAStoredFifteenAsSixteen) {
  const int64_t N = 8, K = 8;
  std::vector<int32_t> qweight(N, 0);  // every code 0
  const std::vector<int32_t> qzeros = {static_cast<int32_t>(0xFFFFFFFFu)};
  const std::vector<float> scales(N, 1.0f);
  const PackedInt4Linear linear{.qweight = qweight.data(),
                                .qzeros = qzeros.data(),
                                .scales = scales.data(),
                                .num_rows = N,
                                .num_cols = K,
                                .group_size = K};
  for (float v : dequantize(linear, Int4Packing::kGptq, true)) EXPECT_EQ(v, -16.0f);
  for (float v : dequantize(linear, Int4Packing::kGptq, false)) EXPECT_EQ(v, -15.0f);
}

TEST(PackedInt4, AwqPacksOutputsInItsInterleavedOrder) {
  // N 16, K 2: each input's row is two words, nibble i of a word holding output AWQ_ORDER[i]
  // (0, 2, 4, 6, 1, 3, 5, 7) of its eight.
  const int64_t N = 16, K = 2;
  const std::vector<int32_t> qweight = {0x76543210, static_cast<int32_t>(0xFEDCBA98u),
                                        static_cast<int32_t>(0x89ABCDEFu), 0x01234567};
  const std::vector<int32_t> qzeros = {0x11111111,
                                       0x00000000};  // outputs 0..7 zero 1, 8..15 zero 0
  const std::vector<float> scales(N, 1.0f);
  const PackedInt4Linear linear{.qweight = qweight.data(),
                                .qzeros = qzeros.data(),
                                .scales = scales.data(),
                                .num_rows = N,
                                .num_cols = K,
                                .group_size = K};
  const std::vector<float> out = dequantize(linear, Int4Packing::kAwq, false);
  // Nibble of each output within its word: 0 -> 0, 1 -> 4, 2 -> 1, 3 -> 5, ...
  const int nibble_of[8] = {0, 4, 1, 5, 2, 6, 3, 7};
  for (int64_t n = 0; n < N; ++n) {
    const int j = nibble_of[n % 8];
    const float zero = n < 8 ? 1.0f : 0.0f;
    const float k0 = static_cast<float>(n < 8 ? j : 8 + j);       // words 0x76543210, 0xFEDCBA98
    const float k1 = static_cast<float>(n < 8 ? 15 - j : 7 - j);  // 0x89ABCDEF, 0x01234567
    EXPECT_EQ(out[n * K + 0], k0 - zero) << n;
    EXPECT_EQ(out[n * K + 1], k1 - zero) << n;
  }
}

TEST(PackedInt4, GroupsComeFromGIdxWhenGiven) {
  // K 16 in two groups of 8; g_idx interleaves them (act order), overriding k / 8.
  const int64_t N = 8, K = 16;
  std::vector<int32_t> qweight(2 * N, 0x33333333);               // every code 3
  const std::vector<int32_t> qzeros = {0x11111111, 0x22222222};  // group 0 zero 1, group 1 zero 2
  std::vector<float> scales(2 * N);
  for (int64_t n = 0; n < N; ++n) {
    scales[n] = 1.0f;       // group 0
    scales[N + n] = 10.0f;  // group 1
  }
  std::vector<int32_t> g_idx(K);
  for (int64_t k = 0; k < K; ++k) g_idx[k] = static_cast<int32_t>(k % 2);
  PackedInt4Linear linear{.qweight = qweight.data(),
                          .qzeros = qzeros.data(),
                          .scales = scales.data(),
                          .g_idx = g_idx.data(),
                          .num_rows = N,
                          .num_cols = K,
                          .group_size = 8};
  const std::vector<float> by_g_idx = dequantize(linear, Int4Packing::kGptq, false);
  linear.g_idx = nullptr;
  const std::vector<float> by_position = dequantize(linear, Int4Packing::kGptq, false);
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t k = 0; k < K; ++k) {
      EXPECT_EQ(by_g_idx[n * K + k], k % 2 == 0 ? 2.0f : 10.0f) << n << "," << k;
      EXPECT_EQ(by_position[n * K + k], k < 8 ? 2.0f : 10.0f) << n << "," << k;
    }
  }
}

// A one-linear checkpoint on disk, for WeightSource's checks.
struct Stored {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;  // zeros of the right size unless given
};

Stored tensor(std::string name, std::string dtype, std::vector<int64_t> shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  const size_t elem = dtype == "F16" ? 2 : 4;
  return {std::move(name), std::move(dtype), std::move(shape),
          std::vector<uint8_t>(static_cast<size_t>(n) * elem, 0)};
}

class PackedInt4Checkpoint : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing::unique_temp_path("packed_int4");
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // The error of loading `m.weight` [N, K] from `tensors` ("" when it loads).
  std::string error_of(const std::vector<Stored>& tensors, const PackedInt4Quantization& quant,
                       int64_t N = 16, int64_t K = 64) {
    write(tensors);
    const WeightStore store = WeightStore::open(dir_);
    ModelConfig config;
    config.packed_int4 = quant;
    WeightSource source(store, config);
    try {
      source.matrix("m.weight", {N, K});
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  }

  void write(const std::vector<Stored>& tensors) {
    json header = json::object();
    std::vector<uint8_t> data;
    for (const Stored& t : tensors) {
      header[t.name] = {{"dtype", t.dtype},
                        {"shape", t.shape},
                        {"data_offsets", {data.size(), data.size() + t.bytes.size()}}};
      data.insert(data.end(), t.bytes.begin(), t.bytes.end());
    }
    std::string text = header.dump();
    while (text.size() % 8) text += ' ';
    std::ofstream out(dir_ / "model.safetensors", std::ios::binary);
    const uint64_t n = text.size();
    out.write(reinterpret_cast<const char*>(&n), 8);
    out.write(text.data(), static_cast<std::streamsize>(text.size()));
    out.write(reinterpret_cast<const char*>(data.data()),
              static_cast<std::streamsize>(data.size()));
  }

  fs::path dir_;
};

const PackedInt4Quantization kGptq{.packing = Int4Packing::kGptq, .group_size = 32};
const PackedInt4Quantization kAwq{.packing = Int4Packing::kAwq, .group_size = 32};

// A well-formed GPTQ linear of 16 outputs and 64 inputs in groups of 32.
std::vector<Stored> gptq_linear() {
  return {tensor("m.qweight", "I32", {8, 16}), tensor("m.qzeros", "I32", {2, 2}),
          tensor("m.scales", "F16", {2, 16}), tensor("m.g_idx", "I32", {64})};
}

TEST_F(PackedInt4Checkpoint, WellFormedLinearsLoad) {
  EXPECT_EQ(error_of(gptq_linear(), kGptq), "");
  EXPECT_EQ(error_of({tensor("m.qweight", "I32", {64, 2}), tensor("m.qzeros", "I32", {2, 2}),
                      tensor("m.scales", "F16", {2, 16})},
                     kAwq),
            "");
  EXPECT_EQ(error_of({tensor("m.weight", "F16", {16, 64})}, kGptq), "");  // kept in 16 bits
}

TEST_F(PackedInt4Checkpoint, NamesTheTensorAndTheProblem) {
  struct Case {
    const char* what;
    std::vector<Stored> tensors;
    PackedInt4Quantization quant;
    std::vector<std::string> needles;
  };
  std::vector<Case> cases;
  {
    auto t = gptq_linear();
    t.erase(t.begin() + 2);
    cases.push_back({"no scales", t, kGptq, {"'m.scales'", "gptq linear 'm'"}});
  }
  {
    auto t = gptq_linear();
    t.erase(t.begin() + 1);
    cases.push_back({"no qzeros", t, kGptq, {"'m.qzeros'"}});
  }
  {
    auto t = gptq_linear();
    t[0] = tensor("m.qweight", "I32", {16, 8});  // AWQ's shape in a GPTQ checkpoint
    cases.push_back({"qweight shape", t, kGptq, {"'m.qweight'", "[16, 8]", "expected [8, 16]"}});
  }
  {
    auto t = gptq_linear();
    t[2] = tensor("m.scales", "F16", {4, 16});
    cases.push_back({"scales shape", t, kGptq, {"'m.scales'", "expected [2, 16]"}});
  }
  {
    auto t = gptq_linear();
    t[0] = tensor("m.qweight", "F16", {8, 16});
    cases.push_back({"qweight dtype", t, kGptq, {"'m.qweight'", "dtype F16"}});
  }
  {
    auto t = gptq_linear();
    std::vector<int32_t> g_idx(64, 0);
    g_idx[37] = 2;  // two groups: 0 and 1
    std::memcpy(t[3].bytes.data(), g_idx.data(), g_idx.size() * 4);
    cases.push_back({"g_idx range", t, kGptq, {"'m.g_idx'", "input 37", "group 2"}});
  }
  {
    auto t = gptq_linear();
    t.pop_back();
    PackedInt4Quantization act_order = kGptq;
    act_order.desc_act = true;
    cases.push_back({"desc_act without g_idx", t, act_order, {"desc_act", "'m.g_idx'"}});
  }
  {
    PackedInt4Quantization groups_of_48 = kGptq;
    groups_of_48.group_size = 48;
    cases.push_back({"group_size", gptq_linear(), groups_of_48, {"group_size 48", "64 inputs"}});
  }
  cases.push_back({"neither weight nor qweight",
                   {tensor("m.scales", "F16", {2, 16})},
                   kAwq,
                   {"'m'", "'m.weight'", "'m.qweight'"}});
  for (const Case& c : cases) {
    const std::string error = error_of(c.tensors, c.quant);
    ASSERT_NE(error, "") << c.what << " loaded";
    for (const std::string& needle : c.needles) {
      EXPECT_NE(error.find(needle), std::string::npos) << c.what << ": " << error;
    }
  }
}

TEST_F(PackedInt4Checkpoint, RefusesWidthsThatDoNotPack) {
  // 12 outputs: not whole words of qzeros; 60 inputs: not whole words of GPTQ's qweight.
  EXPECT_NE(error_of(gptq_linear(), kGptq, 12, 64).find("12 outputs"), std::string::npos);
  PackedInt4Quantization one_group = kGptq;
  one_group.group_size = 0;
  EXPECT_NE(error_of(gptq_linear(), one_group, 16, 60).find("60 inputs"), std::string::npos);
}

TEST(PackedInt4, WeightsFlagIsRefusedOnA4BitCheckpointNamingIt) {
  for (const PackedInt4Quantization& quant : {kGptq, kAwq}) {
    ModelConfig config;
    config.packed_int4 = quant;
    const std::string method(quant_method_name(quant.packing));
    for (WeightFormat format : {WeightFormat::kFp8, WeightFormat::kInt4}) {
      try {
        check_weight_format(format, config, /*cuda=*/false);
        ADD_FAILURE() << "--weights " << weight_format_name(format) << " accepted on " << method;
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("already 4-bit " + method), std::string::npos)
            << e.what();
      }
    }
    EXPECT_NO_THROW(check_weight_format(WeightFormat::kBf16, config, false));
    EXPECT_NO_THROW(check_weight_format(WeightFormat::kCheckpoint, config, false));
  }
}

}  // namespace
}  // namespace moeinfer

// Safetensors reading: valid files in every float dtype, sharded checkpoints, and each way a
// file can lie (truncation, header length, offsets, dtype, shape), checking the error names the
// file and the tensor.
#include "io/safetensors.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "core/error.h"
#include "core/progress.h"

namespace moeinfer {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

struct FakeTensor {
  std::string name;
  std::string dtype;  // safetensors spelling
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
};

std::vector<uint8_t> f32_bytes(std::vector<float> values) {
  std::vector<uint8_t> out(values.size() * 4);
  std::memcpy(out.data(), values.data(), out.size());
  return out;
}
std::vector<uint8_t> u16_bytes(const std::vector<uint16_t>& values) {
  std::vector<uint8_t> out(values.size() * 2);
  std::memcpy(out.data(), values.data(), out.size());
  return out;
}

// The whole file for `header` (as text) followed by `data`; the header is padded with spaces to
// a multiple of 8 bytes as the reference writer does.
std::vector<uint8_t> raw_file(std::string header, const std::vector<uint8_t>& data,
                              std::optional<uint64_t> length_override = std::nullopt) {
  while (header.size() % 8) header += ' ';
  const uint64_t n = length_override.value_or(header.size());
  std::vector<uint8_t> out(8);
  for (int i = 0; i < 8; ++i) out[i] = static_cast<uint8_t>(n >> (8 * i));
  out.insert(out.end(), header.begin(), header.end());
  out.insert(out.end(), data.begin(), data.end());
  return out;
}

std::vector<uint8_t> make_file(const std::vector<FakeTensor>& tensors, json metadata = nullptr) {
  json header = json::object();
  std::vector<uint8_t> data;
  for (const auto& t : tensors) {
    header[t.name] = {{"dtype", t.dtype},
                      {"shape", t.shape},
                      {"data_offsets", {data.size(), data.size() + t.bytes.size()}}};
    data.insert(data.end(), t.bytes.begin(), t.bytes.end());
  }
  if (!metadata.is_null()) header["__metadata__"] = metadata;
  return raw_file(header.dump(), data);
}

class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::random_device rd;
    dir_ = fs::temp_directory_path() /
           ("moe_safetensors_test_" + std::to_string(::getpid()) + "_" + std::to_string(rd()));
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  fs::path write(const std::string& name, const std::vector<uint8_t>& bytes) {
    const fs::path path = dir_ / name;
    std::ofstream out(path, std::ios::binary);
    out.write(reinterpret_cast<const char*>(bytes.data()),
              static_cast<std::streamsize>(bytes.size()));
    return path;
  }
  void write_text(const std::string& name, const std::string& text) {
    std::ofstream(dir_ / name) << text;
  }

  // Opens the folder and returns the error text ("" when it opened).
  std::string open_error() {
    try {
      WeightStore::open(dir_);
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  }

  std::vector<FakeTensor> three_dtypes() {
    return {
        {"w.f32", "F32", {2, 3}, f32_bytes({1, 2, 3, 4, 5, 6})},
        {"w.bf16",
         "BF16",
         {3},
         u16_bytes({f32_to_bf16(1.5f), f32_to_bf16(-2.0f), f32_to_bf16(0.25f)})},
        {"w.f16", "F16", {1, 2}, u16_bytes({f32_to_f16(0.5f), f32_to_f16(-3.0f)})},
    };
  }

  fs::path dir_;
};

TEST_F(SafetensorsTest, ReadsF32Bf16F16) {
  write("model.safetensors", make_file(three_dtypes(), json{{"format", "pt"}}));
  const WeightStore store = WeightStore::open(dir_);
  EXPECT_EQ(store.names(), (std::vector<std::string>{"w.bf16", "w.f16", "w.f32"}));
  EXPECT_TRUE(store.has("w.f32"));
  EXPECT_FALSE(store.has("w.f64"));
  EXPECT_EQ(store.total_bytes(), 24u + 6u + 4u);
  EXPECT_EQ(store.file_of("w.f16"), (dir_ / "model.safetensors").string());

  const TensorView f32 = store.require("w.f32", Shape{2, 3});
  EXPECT_EQ(f32.dtype, DType::kF32);
  const float* values = static_cast<const float*>(f32.data);
  EXPECT_EQ(values[0], 1.0f);
  EXPECT_EQ(values[5], 6.0f);
  EXPECT_EQ(*static_cast<const float*>(f32.row(1)), 4.0f);

  const TensorView bf16 = store.require("w.bf16", Shape{3});
  const auto* b = static_cast<const uint16_t*>(bf16.data);
  EXPECT_EQ(bf16.dtype, DType::kBF16);
  EXPECT_EQ(bf16_to_f32(b[0]), 1.5f);
  EXPECT_EQ(bf16_to_f32(b[1]), -2.0f);
  EXPECT_EQ(bf16_to_f32(b[2]), 0.25f);

  const TensorView f16 = store.require("w.f16", Shape{1, 2});
  const auto* h = static_cast<const uint16_t*>(f16.data);
  EXPECT_EQ(f16.dtype, DType::kF16);
  EXPECT_EQ(f16_to_f32(h[0]), 0.5f);
  EXPECT_EQ(f16_to_f32(h[1]), -3.0f);
}

TEST_F(SafetensorsTest, ScalarAndEmptyTensors) {
  write("model.safetensors", make_file({{"scalar", "F32", {}, f32_bytes({7})},
                                        {"empty", "BF16", {0, 4}, {}},
                                        {"after", "F32", {1}, f32_bytes({8})}}));
  const WeightStore store = WeightStore::open(dir_);
  EXPECT_EQ(*static_cast<const float*>(store.require("scalar", Shape{}).data), 7.0f);
  EXPECT_EQ(store.require("empty", Shape{0, 4}).numel(), 0);
  EXPECT_EQ(*static_cast<const float*>(store.require("after", Shape{1}).data), 8.0f);
}

TEST_F(SafetensorsTest, StoreIsMovableAndViewsSurviveTheMove) {
  write("model.safetensors", make_file(three_dtypes()));
  WeightStore first = WeightStore::open(dir_);
  const TensorView before = first.require("w.f32", Shape{2, 3});
  WeightStore second = std::move(first);
  const TensorView after = second.require("w.f32", Shape{2, 3});
  EXPECT_EQ(before.data, after.data);
  EXPECT_EQ(static_cast<const float*>(after.data)[2], 3.0f);
}

TEST_F(SafetensorsTest, ShardedIndex) {
  write("model-00001-of-00002.safetensors", make_file({{"a", "F32", {2}, f32_bytes({1, 2})}}));
  write("model-00002-of-00002.safetensors",
        make_file({{"b", "BF16", {1}, u16_bytes({f32_to_bf16(3.0f)})},
                   {"c", "F32", {1}, f32_bytes({4})}}));
  write_text("model.safetensors.index.json", json{{"metadata", {{"total_size", 14}}},
                                                  {"weight_map",
                                                   {{"a", "model-00001-of-00002.safetensors"},
                                                    {"b", "model-00002-of-00002.safetensors"},
                                                    {"c", "model-00002-of-00002.safetensors"}}}}
                                                 .dump());
  const WeightStore store = WeightStore::open(dir_);
  EXPECT_EQ(store.num_files(), 2u);
  EXPECT_EQ(store.names(), (std::vector<std::string>{"a", "b", "c"}));
  EXPECT_EQ(store.file_of("a"), (dir_ / "model-00001-of-00002.safetensors").string());
  EXPECT_EQ(store.file_of("c"), (dir_ / "model-00002-of-00002.safetensors").string());
  EXPECT_EQ(static_cast<const float*>(store.require("a", Shape{2}).data)[1], 2.0f);
  EXPECT_EQ(bf16_to_f32(*static_cast<const uint16_t*>(store.require("b", Shape{1}).data)), 3.0f);
  EXPECT_EQ(store.total_bytes(), 14u);
  EXPECT_GE(store.prefault(), 0.0);
}

TEST_F(SafetensorsTest, IndexWinsOverSingleFile) {
  write("model.safetensors", make_file({{"stale", "F32", {1}, f32_bytes({0})}}));
  write("shard.safetensors", make_file({{"fresh", "F32", {1}, f32_bytes({1})}}));
  write_text("model.safetensors.index.json",
             json{{"weight_map", {{"fresh", "shard.safetensors"}}}}.dump());
  const WeightStore store = WeightStore::open(dir_);
  EXPECT_TRUE(store.has("fresh"));
  EXPECT_FALSE(store.has("stale"));
}

TEST_F(SafetensorsTest, MissingShardNamesIndexAndShard) {
  write("model-00001-of-00002.safetensors", make_file({{"a", "F32", {1}, f32_bytes({1})}}));
  write_text(
      "model.safetensors.index.json",
      json{{"weight_map",
            {{"a", "model-00001-of-00002.safetensors"}, {"b", "model-00002-of-00002.safetensors"}}}}
          .dump());
  const std::string error = open_error();
  EXPECT_NE(error.find("model.safetensors.index.json"), std::string::npos) << error;
  EXPECT_NE(error.find("model-00002-of-00002.safetensors"), std::string::npos) << error;
  EXPECT_NE(error.find("'b'"), std::string::npos) << error;
}

TEST_F(SafetensorsTest, IndexedTensorAbsentFromItsShard) {
  write("s1.safetensors", make_file({{"a", "F32", {1}, f32_bytes({1})}}));
  write("s2.safetensors", make_file({{"b", "F32", {1}, f32_bytes({1})}}));
  write_text("model.safetensors.index.json",
             json{{"weight_map", {{"a", "s1.safetensors"}, {"b", "s1.safetensors"}}}}.dump());
  const std::string error = open_error();
  EXPECT_NE(error.find("'b'"), std::string::npos) << error;
  EXPECT_NE(error.find("s1.safetensors"), std::string::npos) << error;
  EXPECT_NE(error.find("does not contain"), std::string::npos) << error;
}

// A tensor held by two shards is ambiguous (transformers takes the last shard it reads): refused
// whether the index names one of them or neither.
TEST_F(SafetensorsTest, TensorInTwoShardsIsRefused) {
  write("s1.safetensors", make_file({{"a", "F32", {1}, f32_bytes({1})}}));
  write("s2.safetensors",
        make_file({{"a", "F32", {1}, f32_bytes({2})}, {"b", "F32", {1}, f32_bytes({3})}}));
  write_text("model.safetensors.index.json",
             json{{"weight_map", {{"a", "s1.safetensors"}, {"b", "s2.safetensors"}}}}.dump());
  std::string error = open_error();
  EXPECT_NE(error.find("model.safetensors.index.json"), std::string::npos) << error;
  EXPECT_NE(error.find("'a'"), std::string::npos) << error;
  EXPECT_NE(error.find("two shards, s1.safetensors and s2.safetensors"), std::string::npos)
      << error;
  write("s1.safetensors",
        make_file({{"a", "F32", {1}, f32_bytes({1})}, {"c", "F32", {1}, f32_bytes({1})}}));
  write("s2.safetensors",
        make_file({{"b", "F32", {1}, f32_bytes({3})}, {"c", "F32", {1}, f32_bytes({2})}}));
  error = open_error();
  EXPECT_NE(error.find("'c'"), std::string::npos) << error;
  EXPECT_NE(error.find("two shards"), std::string::npos) << error;
}

TEST_F(SafetensorsTest, IndexShardOutsideTheFolderIsRefused) {
  write_text("model.safetensors.index.json",
             json{{"weight_map", {{"a", "../elsewhere.safetensors"}}}}.dump());
  const std::string error = open_error();
  EXPECT_NE(error.find("elsewhere.safetensors"), std::string::npos) << error;
  EXPECT_NE(error.find("'a'"), std::string::npos) << error;
}

TEST_F(SafetensorsTest, BadIndexJson) {
  write_text("model.safetensors.index.json", "{\"weight_map\": [1, 2]}");
  const std::string error = open_error();
  EXPECT_NE(error.find("model.safetensors.index.json"), std::string::npos) << error;
  EXPECT_NE(error.find("weight_map"), std::string::npos) << error;
}

TEST_F(SafetensorsTest, NoCheckpointInFolder) {
  const std::string error = open_error();
  EXPECT_NE(error.find(dir_.string()), std::string::npos) << error;
  EXPECT_NE(error.find("model.safetensors"), std::string::npos) << error;
}

TEST_F(SafetensorsTest, TruncatedFileNamesFileAndTensor) {
  std::vector<uint8_t> bytes = make_file(three_dtypes());
  bytes.resize(bytes.size() - 3);  // cuts into the last tensor, w.f16
  const fs::path path = write("model.safetensors", bytes);
  const std::string error = open_error();
  EXPECT_NE(error.find(path.string()), std::string::npos) << error;
  EXPECT_NE(error.find("'w.f16'"), std::string::npos) << error;
  EXPECT_NE(error.find("truncated"), std::string::npos) << error;
}

TEST_F(SafetensorsTest, FileShorterThanLengthPrefix) {
  const fs::path path = write("model.safetensors", {1, 2, 3});
  const std::string error = open_error();
  EXPECT_NE(error.find(path.string()), std::string::npos) << error;
  EXPECT_NE(error.find("too short"), std::string::npos) << error;
}

TEST_F(SafetensorsTest, HeaderLengthBeyondFile) {
  const fs::path path = write("model.safetensors", raw_file("{}", {}, /*length=*/4096));
  const std::string error = open_error();
  EXPECT_NE(error.find(path.string()), std::string::npos) << error;
  EXPECT_NE(error.find("header length 4096"), std::string::npos) << error;
}

TEST_F(SafetensorsTest, HugeHeaderLengthDoesNotWrap) {
  const fs::path path = write("model.safetensors", raw_file("{}", {}, /*length=*/~uint64_t{0} - 3));
  const std::string error = open_error();
  EXPECT_NE(error.find(path.string()), std::string::npos) << error;
  EXPECT_NE(error.find("header length"), std::string::npos) << error;
}

TEST_F(SafetensorsTest, OverlappingTensors) {
  const std::string header = R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                             R"("y":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})";
  const fs::path path = write("model.safetensors", raw_file(header, std::vector<uint8_t>(12)));
  const std::string error = open_error();
  EXPECT_NE(error.find(path.string()), std::string::npos) << error;
  EXPECT_NE(error.find("'x'"), std::string::npos) << error;
  EXPECT_NE(error.find("'y'"), std::string::npos) << error;
  EXPECT_NE(error.find("overlap"), std::string::npos) << error;
}

TEST_F(SafetensorsTest, OffsetsPastTheEnd) {
  const std::string header = R"({"x":{"dtype":"F32","shape":[4],"data_offsets":[8,24]}})";
  const fs::path path = write("model.safetensors", raw_file(header, std::vector<uint8_t>(16)));
  const std::string error = open_error();
  EXPECT_NE(error.find(path.string()), std::string::npos) << error;
  EXPECT_NE(error.find("'x'"), std::string::npos) << error;
  EXPECT_NE(error.find("past the end"), std::string::npos) << error;
}

TEST_F(SafetensorsTest, OffsetsDisagreeWithShape) {
  const std::string header = R"({"x":{"dtype":"BF16","shape":[3],"data_offsets":[0,8]}})";
  const fs::path path = write("model.safetensors", raw_file(header, std::vector<uint8_t>(8)));
  const std::string error = open_error();
  EXPECT_NE(error.find(path.string()), std::string::npos) << error;
  EXPECT_NE(error.find("'x'"), std::string::npos) << error;
  EXPECT_NE(error.find("need 6"), std::string::npos) << error;
}

TEST_F(SafetensorsTest, OffsetsReversed) {
  const std::string header = R"({"x":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}})";
  write("model.safetensors", raw_file(header, std::vector<uint8_t>(8)));
  const std::string error = open_error();
  EXPECT_NE(error.find("'x'"), std::string::npos) << error;
}

TEST_F(SafetensorsTest, ShapeOverflowIsRefused) {
  const std::string header =
      R"({"x":{"dtype":"F32","shape":[4294967296,4294967296,16],"data_offsets":[0,0]}})";
  write("model.safetensors", raw_file(header, {}));
  const std::string error = open_error();
  EXPECT_NE(error.find("'x'"), std::string::npos) << error;
  EXPECT_NE(error.find("too large"), std::string::npos) << error;
}

TEST_F(SafetensorsTest, BadJson) {
  const fs::path path = write("model.safetensors", raw_file("{\"x\": [1, 2", {}));
  const std::string error = open_error();
  EXPECT_NE(error.find(path.string()), std::string::npos) << error;
  EXPECT_NE(error.find("JSON"), std::string::npos) << error;
}

TEST_F(SafetensorsTest, HeaderNotAnObject) {
  write("model.safetensors", raw_file("[1, 2, 3]", {}));
  EXPECT_NE(open_error().find("object"), std::string::npos);
}

TEST_F(SafetensorsTest, UnknownDtype) {
  const std::string header = R"({"x":{"dtype":"F64","shape":[1],"data_offsets":[0,8]}})";
  const fs::path path = write("model.safetensors", raw_file(header, std::vector<uint8_t>(8)));
  const std::string error = open_error();
  EXPECT_NE(error.find(path.string()), std::string::npos) << error;
  EXPECT_NE(error.find("'x'"), std::string::npos) << error;
  EXPECT_NE(error.find("'F64'"), std::string::npos) << error;
}

TEST_F(SafetensorsTest, NegativeAndNonIntegerDimensions) {
  write("model.safetensors",
        raw_file(R"({"x":{"dtype":"F32","shape":[-1],"data_offsets":[0,0]}})", {}));
  std::string error = open_error();
  EXPECT_NE(error.find("'x'"), std::string::npos) << error;
  EXPECT_NE(error.find("negative"), std::string::npos) << error;
  write("model.safetensors",
        raw_file(R"({"x":{"dtype":"F32","shape":[1.5],"data_offsets":[0,4]}})", {0, 0, 0, 0}));
  error = open_error();
  EXPECT_NE(error.find("'x'"), std::string::npos) << error;
  EXPECT_NE(error.find("shape"), std::string::npos) << error;
}

TEST_F(SafetensorsTest, MissingEntryFields) {
  write("model.safetensors", raw_file(R"({"x":{"dtype":"F32","shape":[1]}})", {0, 0, 0, 0}));
  const std::string error = open_error();
  EXPECT_NE(error.find("'x'"), std::string::npos) << error;
  EXPECT_NE(error.find("data_offsets"), std::string::npos) << error;
}

TEST_F(SafetensorsTest, BadMetadata) {
  write("model.safetensors", raw_file(R"({"__metadata__":{"format":1}})", {}));
  const std::string error = open_error();
  EXPECT_NE(error.find("__metadata__"), std::string::npos) << error;
  EXPECT_NE(error.find("'format'"), std::string::npos) << error;
}

TEST_F(SafetensorsTest, MissingTensorNamesFolder) {
  write("model.safetensors", make_file(three_dtypes()));
  const WeightStore store = WeightStore::open(dir_);
  try {
    store.require("model.layers.0.mlp.gate.weight", Shape{4, 4});
    FAIL() << "expected an error";
  } catch (const Error& e) {
    const std::string error = e.what();
    EXPECT_NE(error.find("missing tensor 'model.layers.0.mlp.gate.weight'"), std::string::npos)
        << error;
    EXPECT_NE(error.find(dir_.string()), std::string::npos) << error;
  }
}

TEST_F(SafetensorsTest, WrongShapeNamesFileTensorAndBothShapes) {
  write("model.safetensors", make_file(three_dtypes()));
  const WeightStore store = WeightStore::open(dir_);
  try {
    store.require("w.f32", Shape{3, 2});
    FAIL() << "expected an error";
  } catch (const Error& e) {
    const std::string error = e.what();
    EXPECT_NE(error.find((dir_ / "model.safetensors").string()), std::string::npos) << error;
    EXPECT_NE(error.find("'w.f32'"), std::string::npos) << error;
    EXPECT_NE(error.find("[2, 3]"), std::string::npos) << error;
    EXPECT_NE(error.find("expected [3, 2]"), std::string::npos) << error;
  }
}

TEST_F(SafetensorsTest, WrongDtype) {
  write("model.safetensors",
        make_file({{"ids", "I64", {2}, std::vector<uint8_t>(16)}, {"w", "BF16", {1}, {0, 0}}}));
  const WeightStore store = WeightStore::open(dir_);
  try {
    store.require("ids", Shape{2});  // default: floating point only
    FAIL() << "expected an error";
  } catch (const Error& e) {
    const std::string error = e.what();
    EXPECT_NE(error.find("'ids'"), std::string::npos) << error;
    EXPECT_NE(error.find("I64"), std::string::npos) << error;
    EXPECT_NE(error.find("F32, BF16, F16"), std::string::npos) << error;
  }
  const DType only_f32[] = {DType::kF32};
  EXPECT_THROW(store.require("w", Shape{1}, only_f32), Error);
  const DType ints[] = {DType::kI64};
  EXPECT_EQ(store.require("ids", Shape{2}, ints).dtype, DType::kI64);
}

TEST_F(SafetensorsTest, ParseHeaderInMemory) {
  const std::vector<uint8_t> bytes = make_file(three_dtypes());
  uint64_t data_offset = 0;
  const auto entries = parse_safetensors_header(bytes.data(), bytes.size(), "mem", &data_offset);
  ASSERT_EQ(entries.size(), 3u);
  EXPECT_EQ(entries[0].name, "w.f32");  // data order
  EXPECT_EQ(entries[0].begin, 0u);
  EXPECT_EQ(entries[2].end, 34u);
  EXPECT_EQ(data_offset + 34, bytes.size());
  EXPECT_EQ(data_offset % 8, 0u);
  try {
    parse_safetensors_header(bytes.data(), bytes.size() - 1, "mem-source", &data_offset);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("mem-source"), std::string::npos);
  }
}

TEST_F(SafetensorsTest, PrefaultReportsThroughput) {
  std::vector<float> big(1 << 18, 1.0f);  // 1 MiB
  write("model.safetensors", make_file({{"big", "F32", {1 << 18}, f32_bytes(big)}}));
  const WeightStore store = WeightStore::open(dir_);
  EXPECT_GT(store.prefault(), 0.0);
}

// Checkpoints written by the reference stack (transformers + safetensors) for the parity tests.
TEST(SafetensorsReferenceTest, OpensEveryFixtureCheckpoint) {
  const fs::path models = fs::path(MOE_FIXTURES_DIR) / "models";
  ASSERT_TRUE(fs::is_directory(models)) << "no fixture checkpoints in " << models;
  int opened = 0;
  for (const auto& dir : fs::directory_iterator(models)) {
    if (!fs::exists(dir.path() / "model.safetensors") &&
        !fs::exists(dir.path() / "model.safetensors.index.json"))
      continue;
    SCOPED_TRACE(dir.path().string());
    const WeightStore store = WeightStore::open(dir.path());
    ASSERT_FALSE(store.names().empty());
    for (const std::string& name : store.names()) {
      const TensorEntry& entry = store.entry(name);
      const DType any[] = {entry.dtype};
      const TensorView view = store.require(name, entry.shape, any);
      EXPECT_EQ(view.nbytes(), entry.end - entry.begin) << name;
    }
    EXPECT_GT(store.total_bytes(), 0u);
    EXPECT_GE(store.prefault(), 0.0);
    ++opened;
  }
  EXPECT_GT(opened, 0);
}

TEST(ProgressBarTest, SilentUnlessForcedThenDrawsAndEndsLine) {
  std::FILE* out = std::tmpfile();
  ASSERT_NE(out, nullptr);
  {
    ProgressBar quiet("quiet", 100, ProgressOptions{.force = false, .stream = out});
    quiet.update(50);  // a temp file is not a terminal
    EXPECT_FALSE(quiet.drawn());
  }
  {
    ProgressBar bar("loading", 2048,
                    ProgressOptions{.force = true, .delay_s = 0.0, .stream = out, .unit = "B"});
    bar.update(1024);
    EXPECT_TRUE(bar.drawn());
    bar.update(4096);  // clamped
    EXPECT_EQ(bar.done(), 2048u);
  }
  std::fflush(out);
  std::rewind(out);
  char buf[512] = {};
  const size_t n = std::fread(buf, 1, sizeof(buf) - 1, out);
  std::fclose(out);
  const std::string text(buf, n);
  EXPECT_EQ(text.find("quiet"), std::string::npos) << text;
  EXPECT_NE(text.find("loading"), std::string::npos) << text;
  EXPECT_NE(text.find("2.0 KiB"), std::string::npos) << text;
  EXPECT_EQ(text.back(), '\n');
}

}  // namespace
}  // namespace moeinfer

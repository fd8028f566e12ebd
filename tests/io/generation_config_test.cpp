// generation_config.json -> GenerationDefaults: the fields vLLM reads, transformers' defaults
// left out as to_diff_dict() leaves them, errors that name the file and the field.
#include "io/generation_config.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "core/error.h"
#include "../support/temp_path.h"

namespace moeinfer {
namespace {

TEST(GenerationConfig, ReadsTheSamplingFields) {
  const GenerationDefaults d = GenerationDefaults::parse(
      R"({"bos_token_id": 1, "do_sample": true, "temperature": 0.6, "top_p": 0.95, "top_k": 20,
          "min_p": 0.05, "repetition_penalty": 1.1, "max_new_tokens": 64,
          "transformers_version": "4.51.0"})",
      "generation_config.json");
  EXPECT_FLOAT_EQ(*d.temperature, 0.6f);
  EXPECT_FLOAT_EQ(*d.top_p, 0.95f);
  EXPECT_EQ(*d.top_k, 20);
  EXPECT_FLOAT_EQ(*d.min_p, 0.05f);
  EXPECT_FLOAT_EQ(*d.repetition_penalty, 1.1f);
  EXPECT_EQ(*d.max_tokens, 64);
  EXPECT_EQ(d.describe(),
            "temperature=0.6 top_p=0.95 top_k=20 min_p=0.05 repetition_penalty=1.1 max_tokens=64");
}

TEST(GenerationConfig, TransformersDefaultsAreNoDefaults) {
  const GenerationDefaults d = GenerationDefaults::parse(
      R"({"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0,
          "max_new_tokens": null})",
      "g.json");
  EXPECT_TRUE(d.empty()) << d.describe();
  EXPECT_EQ(d.describe(), "none");
  EXPECT_TRUE(GenerationDefaults::parse("{}", "g.json").empty());
  // temperature 0 (greedy) is a real default.
  EXPECT_FLOAT_EQ(*GenerationDefaults::parse(R"({"temperature": 0})", "g.json").temperature, 0.0f);
}

TEST(GenerationConfig, ErrorsNameTheField) {
  const auto message = [](const std::string& text) -> std::string {
    try {
      GenerationDefaults::parse(text, "ckpt/generation_config.json");
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  };
  EXPECT_NE(message(R"({"top_p": "high"})").find("'top_p' must be a number"), std::string::npos);
  EXPECT_NE(message(R"({"top_p": 1.5})").find("'top_p'"), std::string::npos);
  EXPECT_NE(message(R"({"top_k": 2.5})").find("'top_k' must be an integer"), std::string::npos);
  EXPECT_NE(message(R"({"max_new_tokens": 0})").find("'max_new_tokens'"), std::string::npos);
  EXPECT_NE(message(R"({"temperature": -1})").find("'temperature'"), std::string::npos);
  EXPECT_NE(message("[1, 2]").find("ckpt/generation_config.json"), std::string::npos);
  EXPECT_NE(message("{nope").find("not valid JSON"), std::string::npos);
}

TEST(GenerationConfig, LoadsFromTheFolderOrNothing) {
  const std::filesystem::path dir =
      moeinfer::testing::unique_temp_path("moe_genconfig");
  std::filesystem::create_directories(dir);
  EXPECT_TRUE(GenerationDefaults::load(dir).empty());
  std::ofstream(dir / "generation_config.json") << R"({"top_k": 7})";
  EXPECT_EQ(*GenerationDefaults::load(dir).top_k, 7);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace moeinfer

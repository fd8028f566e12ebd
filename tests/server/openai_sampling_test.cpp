// The OpenAI wire format of logit_bias, n / best_of, echo with prompt logprobs, prompt_logprobs
// and generation_config defaults: what parse_request makes of a body, and what ChoiceSet makes
// of the engine's outputs (choices by index, the best n of best_of, the echoed prompt's
// logprobs with the first one null).
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <map>

#include "io/unicode.h"
#include "server/openai_api.h"

namespace moeinfer::server {
namespace {

using json = nlohmann::json;

const std::filesystem::path kDemo =
    std::filesystem::path(MOE_FIXTURES_DIR) / ".." / ".." / "models" / "demo";

int status_of(const std::string& body, Endpoint endpoint, std::string* param = nullptr) {
  try {
    parse_request(body, endpoint);
  } catch (const ApiError& e) {
    if (param) *param = e.param;
    return e.status;
  }
  return 200;
}

TEST(OpenAiSampling, StreamOptionsNeedAStream) {
  std::string param;
  EXPECT_EQ(status_of(R"({"prompt": "hi", "stream_options": {"include_usage": true}})",
                      Endpoint::kCompletions, &param),
            400);
  EXPECT_EQ(param, "stream_options");
  EXPECT_EQ(status_of(R"({"prompt": "hi", "stream": true, "stream_options": {"x": 1}})",
                      Endpoint::kCompletions, &param),
            400);
  EXPECT_EQ(param, "stream_options");
  EXPECT_EQ(
      status_of(R"({"prompt": "hi", "stream": true, "stream_options": {"include_usage": true}})",
                Endpoint::kCompletions),
      200);
  EXPECT_EQ(status_of(R"({"prompt": "hi", "stream_options": null})", Endpoint::kCompletions), 200);
}

TEST(OpenAiSampling, MaxCompletionTokensWinsOverMaxTokens) {
  const char* both = R"({"messages": [{"role": "user", "content": "x"}], "max_tokens": 9,
                         "max_completion_tokens": 3})";
  EXPECT_EQ(parse_request(both, Endpoint::kChat).params.max_tokens, 3);
  std::string param;
  EXPECT_EQ(status_of(R"({"messages": [{"role": "user", "content": "x"}],
                          "max_completion_tokens": 0})",
                      Endpoint::kChat, &param),
            400);
  EXPECT_EQ(param, "max_completion_tokens");
}

TEST(OpenAiSampling, CodePointsCountCharacters) {
  EXPECT_EQ(unicode::count_code_points(""), 0);
  EXPECT_EQ(unicode::count_code_points("abc"), 3);
  EXPECT_EQ(unicode::count_code_points("caf\xc3\xa9 \xe2\x82\xac"), 6);  // café €
  // Pieces of one character: counted where its first byte is.
  EXPECT_EQ(unicode::count_code_points("h\xc3"), 2);
  EXPECT_EQ(unicode::count_code_points("\xa9llo"), 3);
}

TEST(OpenAiSampling, LogitBiasIsParsedAndClamped) {
  const ApiRequest r =
      parse_request(R"({"prompt": "hi", "logit_bias": {"5": -100, "17": 3.5, "9": 250}})",
                    Endpoint::kCompletions);
  const auto& bias = r.params.sampling.logit_bias;
  ASSERT_EQ(bias.size(), 3u);
  std::map<int32_t, float> by_id(bias.begin(), bias.end());
  EXPECT_FLOAT_EQ(by_id[5], -100.0f);
  EXPECT_FLOAT_EQ(by_id[17], 3.5f);
  EXPECT_FLOAT_EQ(by_id[9], 100.0f);  // clamped, as vLLM does
  std::string param;
  for (const char* body : {R"({"prompt": "hi", "logit_bias": {"x": 1}})",
                           R"({"prompt": "hi", "logit_bias": {"-3": 1}})",
                           R"({"prompt": "hi", "logit_bias": {"3": "a"}})",
                           R"({"prompt": "hi", "logit_bias": [1, 2]})",
                           R"({"prompt": "hi", "logit_bias": {"99999999999": 1}})"}) {
    EXPECT_EQ(status_of(body, Endpoint::kCompletions, &param), 400) << body;
    EXPECT_EQ(param, "logit_bias") << body;
  }
  const ApiRequest chat =
      parse_request(R"({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"3": 2}})",
                    Endpoint::kChat);
  EXPECT_EQ(chat.params.sampling.logit_bias.size(), 1u);
}

// Stop token ids are range-checked before they narrow to int32: an id past it is a 400 naming
// the field, not another token's id.
TEST(OpenAiSampling, StopTokenIdsOutOfRangeAreRefused) {
  const ApiRequest r = parse_request(R"({"prompt": "hi", "stop_token_ids": [7, 2147483647]})",
                                     Endpoint::kCompletions);
  EXPECT_EQ(r.params.stop_token_ids, (std::vector<int32_t>{7, 2147483647}));
  for (const char* ids : {"[1099511627776]", "[-1]", "[18446744073709551615]", "[1.5]"}) {
    std::string param;
    EXPECT_EQ(status_of(std::string(R"({"prompt": "hi", "stop_token_ids": )") + ids + "}",
                        Endpoint::kCompletions, &param),
              400)
        << ids;
    EXPECT_EQ(param, "stop_token_ids") << ids;
  }
}

TEST(OpenAiSampling, NAndBestOf) {
  ApiRequest r = parse_request(R"({"prompt": "hi", "n": 3})", Endpoint::kCompletions);
  EXPECT_EQ(r.n, 3);
  EXPECT_EQ(r.best_of, 3);
  EXPECT_EQ(r.params.num_sequences, 3);
  EXPECT_FALSE(r.params.score_sequences);
  r = parse_request(R"({"prompt": "hi", "n": 2, "best_of": 5})", Endpoint::kCompletions);
  EXPECT_EQ(r.params.num_sequences, 5);
  EXPECT_TRUE(r.params.score_sequences);
  std::string param;
  EXPECT_EQ(status_of(R"({"prompt": "hi", "n": 0})", Endpoint::kCompletions, &param), 400);
  EXPECT_EQ(param, "n");
  EXPECT_EQ(status_of(R"({"prompt": "hi", "n": 129})", Endpoint::kCompletions, &param), 400);
  EXPECT_EQ(status_of(R"({"prompt": "hi", "n": 3, "best_of": 2})", Endpoint::kCompletions, &param),
            400);
  EXPECT_EQ(param, "best_of");
  EXPECT_EQ(status_of(R"({"prompt": "hi", "n": 1, "best_of": 2, "stream": true})",
                      Endpoint::kCompletions, &param),
            400);
  EXPECT_EQ(param, "best_of");
  EXPECT_EQ(status_of(R"({"prompt": "hi", "n": 2, "stream": true})", Endpoint::kCompletions), 200);
}

TEST(OpenAiSampling, EchoScoresThePrompt) {
  ApiRequest r = parse_request(R"({"prompt": "hi", "echo": true, "logprobs": 2, "max_tokens": 0})",
                               Endpoint::kCompletions);
  EXPECT_TRUE(r.echo);
  EXPECT_EQ(r.params.max_tokens, 0);
  EXPECT_EQ(r.params.prompt_logprobs, 2);
  r = parse_request(R"({"prompt": "hi", "echo": true})", Endpoint::kCompletions);
  EXPECT_EQ(r.params.prompt_logprobs, -1) << "echo without logprobs scores nothing";
  r = parse_request(R"({"prompt": "hi", "echo": true, "max_tokens": 0})", Endpoint::kCompletions);
  EXPECT_EQ(r.params.prompt_logprobs, 0) << "the prompt alone runs as a scored prompt";
  EXPECT_EQ(r.prompt_logprobs, -1) << "and the response shows no prompt_logprobs";
  std::string param;
  EXPECT_EQ(status_of(R"({"prompt": "hi", "max_tokens": 0})", Endpoint::kCompletions, &param), 400);
  EXPECT_EQ(param, "max_tokens");
  r = parse_request(R"({"prompt": "hi", "prompt_logprobs": 3})", Endpoint::kCompletions);
  EXPECT_EQ(r.params.prompt_logprobs, 3);
  EXPECT_EQ(status_of(R"({"prompt": "hi", "prompt_logprobs": 21})", Endpoint::kCompletions), 400);
  EXPECT_EQ(status_of(R"({"prompt": "hi", "prompt_logprobs": 2, "stream": true})",
                      Endpoint::kCompletions, &param),
            400);
  EXPECT_EQ(param, "prompt_logprobs");
  // echo belongs to completions only.
  EXPECT_EQ(status_of(R"({"messages": [{"role": "user", "content": "x"}], "echo": true})",
                      Endpoint::kChat, &param),
            400);
  EXPECT_EQ(param, "echo");
}

TEST(OpenAiSampling, GenerationDefaultsFillWhatTheRequestLeavesOut) {
  const GenerationDefaults defaults{
      .temperature = 0.6f, .top_p = 0.9f, .top_k = 20, .repetition_penalty = 1.2f, .max_tokens = 8};
  ApiRequest r = parse_request(R"({"prompt": "hi"})", Endpoint::kCompletions, defaults);
  EXPECT_FLOAT_EQ(r.params.sampling.temperature, 0.6f);
  EXPECT_FLOAT_EQ(r.params.sampling.top_p, 0.9f);
  EXPECT_EQ(r.params.sampling.top_k, 20);
  EXPECT_FLOAT_EQ(r.params.sampling.repetition_penalty, 1.2f);
  EXPECT_FLOAT_EQ(r.params.sampling.min_p, 0.0f);
  resolve_max_tokens(r, 5, 100, 16);
  EXPECT_EQ(r.params.max_tokens, 8) << "max_new_tokens caps the default";
  r = parse_request(R"({"prompt": "hi", "temperature": 0, "top_k": -1, "max_tokens": 50})",
                    Endpoint::kCompletions, defaults);
  EXPECT_FLOAT_EQ(r.params.sampling.temperature, 0.0f);
  EXPECT_EQ(r.params.sampling.top_k, 0);
  resolve_max_tokens(r, 5, 100, 16);
  EXPECT_EQ(r.params.max_tokens, 8) << "and a given max_tokens, as vLLM";
  // Without defaults: OpenAI's.
  r = parse_request(R"({"messages": [{"role": "user", "content": "x"}]})", Endpoint::kChat);
  EXPECT_FLOAT_EQ(r.params.sampling.temperature, 1.0f);
  resolve_max_tokens(r, 5, 100, 16);
  EXPECT_EQ(r.params.max_tokens, 95);
}

TEST(OpenAiSampling, ResolveMaxTokensKeepsTheContextChecks) {
  ApiRequest r = parse_request(R"({"prompt": "hi", "max_tokens": 96})", Endpoint::kCompletions);
  try {
    resolve_max_tokens(r, 5, 100, 16);
    FAIL();
  } catch (const ApiError& e) {
    EXPECT_EQ(e.status, 400);
    EXPECT_EQ(e.param, "max_tokens");
  }
  r = parse_request(R"({"prompt": "hi"})", Endpoint::kCompletions);
  try {
    resolve_max_tokens(r, 100, 100, 16);
    FAIL();
  } catch (const ApiError& e) {
    EXPECT_EQ(e.status, 413);
    EXPECT_EQ(e.code, "context_length_exceeded");
  }
  resolve_max_tokens(r, 90, 100, 16);
  EXPECT_EQ(r.params.max_tokens, 10);
}

TEST(OpenAiSampling, MaxTokensErrorsNameTheFieldGiven) {
  // Past the context, and chat's max_completion_tokens given: the error names that field.
  for (const char* body : {R"({"messages": [{"role": "user", "content": "x"}],
                               "max_completion_tokens": 96})",
                           R"({"messages": [{"role": "user", "content": "x"}], "max_tokens": 9,
                               "max_completion_tokens": 96})"}) {
    ApiRequest r = parse_request(body, Endpoint::kChat);
    try {
      resolve_max_tokens(r, 5, 100, 16);
      FAIL() << body;
    } catch (const ApiError& e) {
      EXPECT_EQ(e.param, "max_completion_tokens") << body;
      EXPECT_NE(std::string(e.what()).find("max_completion_tokens is 96"), std::string::npos)
          << e.what();
    }
  }
  ApiRequest r = parse_request(R"({"messages": [{"role": "user", "content": "x"}],
                                   "max_tokens": 96})",
                               Endpoint::kChat);
  EXPECT_THROW(resolve_max_tokens(r, 5, 100, 16), ApiError);
  EXPECT_EQ(r.max_tokens_field, "max_tokens");
}

TEST(OpenAiSampling, TokenIdsOutsideTheVocabularyAreRefusedByName) {
  const auto param_of = [](const char* body) -> std::string {
    try {
      check_token_ids(parse_request(body, Endpoint::kCompletions).params, 100);
    } catch (const ApiError& e) {
      EXPECT_EQ(e.status, 400) << body;
      return e.param;
    }
    return "";
  };
  EXPECT_EQ(param_of(R"({"prompt": "hi", "logit_bias": {"100": 5}})"), "logit_bias");
  EXPECT_EQ(param_of(R"({"prompt": "hi", "stop_token_ids": [3, 100]})"), "stop_token_ids");
  EXPECT_EQ(param_of(R"({"prompt": "hi", "logit_bias": {"99": 5}, "stop_token_ids": [0, 99]})"),
            "");
}

TEST(OpenAiSampling, MessagesAndUserAreHeldToOpenAisShapes) {
  std::string param;
  const auto chat = [&](const std::string& messages, const std::string& more = "") {
    return status_of(R"({"messages": )" + messages + more + "}", Endpoint::kChat, &param);
  };
  EXPECT_EQ(chat(R"([{"role": "banana", "content": "hi"}])"), 400);
  EXPECT_EQ(param, "messages[0].role");
  EXPECT_EQ(chat(R"([{"role": "system", "content": "s"}, {"role": "User", "content": "hi"}])"),
            400);
  EXPECT_EQ(param, "messages[1].role");
  for (const char* user : {R"([{"role": "user"}])", R"([{"role": "user", "content": null}])"}) {
    EXPECT_EQ(chat(user), 400) << user;
    EXPECT_EQ(param, "messages[0].content") << user;
  }
  EXPECT_EQ(chat(R"([{"role": "tool", "tool_call_id": "c"}])"), 400);
  EXPECT_EQ(param, "messages[0].content");
  for (const char* role : {"system", "developer", "user", "assistant", "tool"}) {
    EXPECT_EQ(chat(std::string(R"([{"role": ")") + role + R"(", "content": ""}])"), 200) << role;
  }
  // An assistant turn of tool calls has no content.
  EXPECT_EQ(chat(R"([{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls":
                    [{"id": "c", "type": "function", "function": {"name": "f",
                    "arguments": "{}"}}]}, {"role": "tool", "tool_call_id": "c",
                    "content": "1"}])"),
            200);
  EXPECT_EQ(chat(R"([{"role": "user", "content": "hi"}])", R"(, "user": 5)"), 400);
  EXPECT_EQ(param, "user");
  EXPECT_EQ(chat(R"([{"role": "user", "content": "hi"}])", R"(, "user": "u-1")"), 200);
  EXPECT_EQ(status_of(R"({"prompt": "hi", "user": ["u"]})", Endpoint::kCompletions, &param), 400);
  EXPECT_EQ(param, "user");
}

TEST(OpenAiSampling, TokenizeOptionsApplyToTheirForm) {
  const auto param_of = [](const char* body) -> std::string {
    try {
      parse_tokenize_request(body);
    } catch (const ApiError& e) {
      return e.param;
    }
    return "";
  };
  EXPECT_EQ(param_of(R"({"prompt": "hi", "add_generation_prompt": false})"),
            "add_generation_prompt");
  EXPECT_EQ(param_of(R"({"messages": [{"role": "user", "content": "hi"}],
                         "add_special_tokens": true})"),
            "add_special_tokens");
  EXPECT_EQ(param_of(R"({"prompt": "hi", "add_special_tokens": false})"), "");
  const TokenizeRequest chat = parse_tokenize_request(
      R"({"messages": [{"role": "user", "content": "hi"}], "add_special_tokens": false,
          "add_generation_prompt": false})");
  EXPECT_FALSE(chat.add_generation_prompt);
}

class ChoiceSetTest : public testing::Test {
 protected:
  static void SetUpTestSuite() {
    tokenizer_ = std::make_unique<Tokenizer>(Tokenizer::from_file(kDemo / "tokenizer.json"));
  }
  static ResponseInfo info(Endpoint e) {
    return {.endpoint = e, .id = "cmpl-1", .created = 1, .model = "demo"};
  }
  static RequestOutput output(int64_t index, const std::string& text, double cumulative,
                              bool finish, bool last) {
    RequestOutput out{.id = 1, .index = index, .token_ids = {42}, .text = text};
    out.cumulative_logprob = cumulative;
    out.finish = finish ? FinishReason::kLength : FinishReason::kNone;
    out.last = last;
    out.num_prompt_tokens = 3;
    out.num_output_tokens = 1;
    return out;
  }
  static std::unique_ptr<Tokenizer> tokenizer_;
};
std::unique_ptr<Tokenizer> ChoiceSetTest::tokenizer_;

TEST_F(ChoiceSetTest, BestOfKeepsTheHighestCumulativeLogprobs) {
  ApiRequest r = parse_request(R"({"prompt": "hi", "n": 2, "best_of": 4})", Endpoint::kCompletions);
  ChoiceSet set(r, info(Endpoint::kCompletions), *tokenizer_, {1, 2, 3});
  const double scores[4] = {-5.0, -1.0, -3.0, -0.5};
  for (int64_t i = 0; i < 4; ++i) {
    set.add(output(i, "s" + std::to_string(i), scores[i], true, i == 3));
  }
  const json res = set.response();
  ASSERT_EQ(res["choices"].size(), 2u);
  EXPECT_EQ(res["choices"][0]["text"], "s3");
  EXPECT_EQ(res["choices"][0]["index"], 0);
  EXPECT_EQ(res["choices"][1]["text"], "s1");
  EXPECT_EQ(res["choices"][1]["index"], 1);
  EXPECT_EQ(res["usage"]["completion_tokens"], 2);
  EXPECT_EQ(res["usage"]["prompt_tokens"], 3);
}

TEST_F(ChoiceSetTest, StreamedChoicesCarryTheirIndex) {
  ApiRequest r = parse_request(R"({"messages": [{"role": "user", "content": "x"}], "n": 2,
                                   "stream": true})",
                               Endpoint::kChat);
  ChoiceSet set(r, info(Endpoint::kChat), *tokenizer_, {1, 2, 3});
  std::vector<json> chunks;
  for (const RequestOutput& out : {output(0, "a", 0, false, false), output(1, "b", 0, false, false),
                                   output(1, "c", 0, true, false), output(0, "d", 0, true, true)}) {
    for (json& c : set.stream(out)) chunks.push_back(std::move(c));
  }
  ASSERT_EQ(chunks.size(), 4u);
  EXPECT_EQ(chunks[0]["choices"][0]["index"], 0);
  EXPECT_EQ(chunks[0]["choices"][0]["delta"]["role"], "assistant");
  EXPECT_EQ(chunks[1]["choices"][0]["index"], 1);
  EXPECT_EQ(chunks[1]["choices"][0]["delta"]["role"], "assistant");
  EXPECT_FALSE(chunks[2]["choices"][0]["delta"].contains("role"));
  EXPECT_EQ(chunks[2]["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(chunks[3]["choices"][0]["index"], 0);
  EXPECT_EQ(set.usage()["completion_tokens"], 2);
}

TEST_F(ChoiceSetTest, EchoedPromptLogprobsStartWithNull) {
  ApiRequest r = parse_request(R"({"prompt": [5, 6, 7], "echo": true, "logprobs": 1,
                                   "max_tokens": 0})",
                               Endpoint::kCompletions);
  const std::vector<int32_t> prompt = {5, 6, 7};
  ChoiceSet set(r, info(Endpoint::kCompletions), *tokenizer_, prompt);
  RequestOutput out = output(0, "", 0, true, true);
  out.token_ids.clear();
  out.num_output_tokens = 0;
  out.prompt_logprobs = {{.token = 6, .logprob = -2.5f, .rank = 3, .top = {{9, -0.5f}}},
                         {.token = 7, .logprob = -0.25f, .rank = 1, .top = {{7, -0.25f}}}};
  set.add(out);
  const json res = set.response();
  const json& choice = res["choices"][0];
  EXPECT_EQ(choice["text"], tokenizer_->decode(prompt, true));
  const json& lp = choice["logprobs"];
  ASSERT_EQ(lp["tokens"].size(), 3u);
  EXPECT_TRUE(lp["token_logprobs"][0].is_null());
  EXPECT_TRUE(lp["top_logprobs"][0].is_null());
  EXPECT_FLOAT_EQ(lp["token_logprobs"][1].get<float>(), -2.5f);
  EXPECT_FLOAT_EQ(lp["token_logprobs"][2].get<float>(), -0.25f);
  EXPECT_EQ(lp["text_offset"][0], 0);
  EXPECT_EQ(res["usage"]["completion_tokens"], 0);
  EXPECT_FALSE(choice.contains("prompt_logprobs"));
}

// text_offset indexes the returned text in characters: a special token skipped from the text (the
// BOS, 4093) adds nothing, and the generated tokens continue where the echoed prompt ends.
TEST_F(ChoiceSetTest, EchoedTextOffsetsIndexTheReturnedText) {
  ApiRequest r = parse_request(R"({"prompt": [4093, 5, 6], "echo": true, "logprobs": 1,
                                   "max_tokens": 1})",
                               Endpoint::kCompletions);
  const std::vector<int32_t> prompt = {4093, 5, 6};
  ChoiceSet set(r, info(Endpoint::kCompletions), *tokenizer_, prompt);
  const std::string generated = tokenizer_->decode(std::vector<int32_t>{7}, true);
  RequestOutput out = output(0, generated, -1.0, true, true);
  out.token_ids = {7};
  out.logprobs = {{.token = 7, .logprob = -1.0f}};
  out.prompt_logprobs = {{.token = 5, .logprob = -2.5f}, {.token = 6, .logprob = -0.25f}};
  set.add(out);
  const json choice = set.response()["choices"][0];
  const std::string text = choice["text"];
  const std::string echo = tokenizer_->decode(prompt, true);
  EXPECT_EQ(text, echo + generated);
  const json& lp = choice["logprobs"];
  EXPECT_EQ(lp["tokens"][0], "<|endoftext|>");
  const std::string first = tokenizer_->decode(std::vector<int32_t>{5}, true);
  const std::vector<int64_t> want = {0, 0, unicode::count_code_points(first),
                                     unicode::count_code_points(echo)};
  EXPECT_EQ(lp["text_offset"].get<std::vector<int64_t>>(), want) << text;
}

// A character split over two tokens (byte fallback) is counted once: the token after it starts
// one character later.
TEST_F(ChoiceSetTest, TextOffsetsCountASplitCharacterOnce) {
  const std::vector<int32_t> ids = tokenizer_->encode("h\xc3\xa9llo", false);
  std::vector<TokenLogprob> entries;
  for (int32_t id : ids) entries.push_back({.token = id});
  const json lp = logprobs_json(Endpoint::kCompletions, *tokenizer_, entries, 0, true);
  const std::vector<int64_t> offsets = lp["text_offset"].get<std::vector<int64_t>>();
  ASSERT_EQ(offsets.size(), ids.size());
  EXPECT_EQ(tokenizer_->decode(ids, true), "h\xc3\xa9llo");
  // The last token ends the text; "llo" (3 characters) is at 2 whatever splits it.
  int64_t end = offsets.back() +
                unicode::count_code_points(tokenizer_->decode(std::vector<int32_t>{ids.back()}));
  EXPECT_EQ(end, 5) << lp.dump();
  for (size_t i = 1; i < offsets.size(); ++i) EXPECT_LE(offsets[i - 1], offsets[i]);
}

// Completions' top_logprobs: the chosen token always (N + 1 entries where it is not among the
// top N), and of two tokens that decode to one text the more likely.
TEST_F(ChoiceSetTest, CompletionTopLogprobsHoldTheChosenToken) {
  const std::vector<int32_t> ab = tokenizer_->encode("ab", false);
  ASSERT_GE(ab.size(), 1u);
  const int32_t chosen = ab[0];
  const int32_t other = tokenizer_->encode("the", false)[0];
  ASSERT_NE(chosen, other);
  const std::string chosen_text = tokenizer_->decode(std::vector<int32_t>{chosen}, false);
  const std::string other_text = tokenizer_->decode(std::vector<int32_t>{other}, false);
  const std::vector<TokenLogprob> entries = {
      {.token = chosen, .logprob = -3.0f, .top = {{other, -0.5f}}},   // not in the top
      {.token = chosen, .logprob = -0.5f, .top = {{chosen, -0.5f}}},  // in the top
      {.token = other, .logprob = -2.0f, .top = {{other, -1.0f}, {other, -4.0f}}},  // one text
  };
  const json lp = logprobs_json(Endpoint::kCompletions, *tokenizer_, entries, 0, false);
  const json& top = lp["top_logprobs"];
  ASSERT_EQ(top.size(), 3u);
  EXPECT_EQ(top[0].size(), 2u) << top[0].dump();
  EXPECT_FLOAT_EQ(top[0][chosen_text].get<float>(), -3.0f);
  EXPECT_FLOAT_EQ(top[0][other_text].get<float>(), -0.5f);
  EXPECT_EQ(top[1].size(), 1u) << top[1].dump();
  EXPECT_EQ(top[2].size(), 1u) << top[2].dump();
  EXPECT_FLOAT_EQ(top[2][other_text].get<float>(), -1.0f);
}

TEST_F(ChoiceSetTest, ChatLogprobBytesAddUpToASplitCharacter) {
  const std::string text = "\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80";  // é€😀
  const std::vector<int32_t> ids = tokenizer_->encode(text, false);
  ASSERT_GT(ids.size(), 3u) << "the demo vocabulary should split these characters";
  std::vector<TokenLogprob> entries;
  for (int32_t id : ids) entries.push_back({.token = id, .top = {{id, -1.0f}}});
  const json lp = logprobs_json(Endpoint::kChat, *tokenizer_, entries, 0, true);
  std::string joined, top_joined;
  for (const json& entry : lp["content"]) {
    for (int b : entry["bytes"]) joined.push_back(static_cast<char>(b));
    for (int b : entry["top_logprobs"][0]["bytes"]) top_joined.push_back(static_cast<char>(b));
    // The token text is JSON text: a piece of a character shows as U+FFFD there.
    EXPECT_TRUE(entry["token"].is_string());
  }
  EXPECT_EQ(joined, text) << lp.dump();
  EXPECT_EQ(top_joined, text);
}

TEST_F(ChoiceSetTest, PromptLogprobsInVllmsFormat) {
  ApiRequest r =
      parse_request(R"({"prompt": [5, 6, 7], "prompt_logprobs": 1})", Endpoint::kCompletions);
  ChoiceSet set(r, info(Endpoint::kCompletions), *tokenizer_, {5, 6, 7});
  RequestOutput out = output(0, "x", 0, true, true);
  out.prompt_logprobs = {{.token = 6, .logprob = -2.5f, .rank = 3, .top = {{9, -0.5f}}},
                         {.token = 7, .logprob = -0.25f, .rank = 1, .top = {{7, -0.25f}}}};
  set.add(out);
  const json pl = set.response()["choices"][0]["prompt_logprobs"];
  ASSERT_EQ(pl.size(), 3u);
  EXPECT_TRUE(pl[0].is_null());
  EXPECT_EQ(pl[1].size(), 2u);
  EXPECT_EQ(pl[1]["6"]["rank"], 3);
  EXPECT_EQ(pl[1]["9"]["rank"], 1);
  EXPECT_EQ(pl[2].size(), 1u) << "the prompt token is its own top entry";
  EXPECT_TRUE(pl[2]["7"].contains("decoded_token"));
}

}  // namespace
}  // namespace moeinfer::server

#include "runtime/rank_link.h"

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "core/error.h"

namespace moeinfer {

int least_loaded_rank(std::span<const RankLoad> loads) {
  MOE_CHECK(!loads.empty(), "least_loaded_rank: no ranks");
  const auto fewer = [](const RankLoad& a, const RankLoad& b) {
    if (a.num_requests() != b.num_requests()) return a.num_requests() < b.num_requests();
    return a.num_queued_tokens < b.num_queued_tokens;
  };
  // min_element keeps the first of equals: the lowest rank.
  return static_cast<int>(std::min_element(loads.begin(), loads.end(), fewer) - loads.begin());
}

namespace {

class ByteWriter {
 public:
  template <typename T>
  requires std::is_arithmetic_v<T>
  void put(T value) {
    const size_t at = bytes_.size();
    bytes_.resize(at + sizeof(T));
    std::memcpy(bytes_.data() + at, &value, sizeof(T));
  }
  void put(const std::string& text) {
    put<uint64_t>(text.size());
    bytes_.insert(bytes_.end(), text.begin(), text.end());
  }
  template <typename T>
  requires std::is_arithmetic_v<T>
  void put(const std::vector<T>& values) {
    put<uint64_t>(values.size());
    const size_t at = bytes_.size();
    bytes_.resize(at + values.size() * sizeof(T));
    if (!values.empty()) std::memcpy(bytes_.data() + at, values.data(), values.size() * sizeof(T));
  }
  std::vector<uint8_t> take() { return std::move(bytes_); }

 private:
  std::vector<uint8_t> bytes_;
};

class ByteReader {
 public:
  explicit ByteReader(std::span<const uint8_t> bytes) : bytes_(bytes) {}
  template <typename T>
  requires std::is_arithmetic_v<T> T get() {
    need(sizeof(T), "a value");
    T value;
    std::memcpy(&value, bytes_.data() + at_, sizeof(T));
    at_ += sizeof(T);
    return value;
  }
  std::string get_string() {
    const uint64_t n = get<uint64_t>();
    need(n, "a string");
    std::string text(reinterpret_cast<const char*>(bytes_.data() + at_), n);
    at_ += n;
    return text;
  }
  template <typename T>
  std::vector<T> get_vector() {
    const uint64_t n = count(sizeof(T));
    std::vector<T> values(n);
    if (n > 0) std::memcpy(values.data(), bytes_.data() + at_, n * sizeof(T));
    at_ += n * sizeof(T);
    return values;
  }
  // A sequence length whose items take at least min_item_bytes each, checked against the rest.
  uint64_t count(uint64_t min_item_bytes) {
    const uint64_t n = get<uint64_t>();
    MOE_CHECK(min_item_bytes == 0 || n <= (bytes_.size() - at_) / min_item_bytes,
              "rank link: a sequence of ", n, " items does not fit the ", bytes_.size() - at_,
              " bytes left");
    return n;
  }
  void expect_end() const {
    MOE_CHECK(at_ == bytes_.size(), "rank link: ", bytes_.size() - at_, " bytes left over");
  }

 private:
  void need(uint64_t n, const char* what) const {
    MOE_CHECK(n <= bytes_.size() - at_, "rank link: ", what, " of ", n, " bytes past the end (",
              bytes_.size() - at_, " left)");
  }
  std::span<const uint8_t> bytes_;
  size_t at_ = 0;
};

void put_pairs(ByteWriter& w, const std::vector<std::pair<int32_t, float>>& pairs) {
  w.put<uint64_t>(pairs.size());
  for (const auto& [token, value] : pairs) {
    w.put(token);
    w.put(value);
  }
}

std::vector<std::pair<int32_t, float>> get_pairs(ByteReader& r) {
  std::vector<std::pair<int32_t, float>> pairs(r.count(sizeof(int32_t) + sizeof(float)));
  for (auto& [token, value] : pairs) {
    token = r.get<int32_t>();
    value = r.get<float>();
  }
  return pairs;
}

void put_params(ByteWriter& w, const GenerationParams& p) {
  MOE_CHECK(p.grammar == nullptr,
            "rank link: a constrained request (response_format) runs on rank 0 only");
  const SamplingParams& s = p.sampling;
  w.put(s.temperature);
  w.put(s.top_k);
  w.put(s.top_p);
  w.put(s.min_p);
  w.put(s.repetition_penalty);
  w.put(s.presence_penalty);
  w.put(s.frequency_penalty);
  put_pairs(w, s.logit_bias);
  w.put(s.seed);
  w.put<uint8_t>(p.has_seed);
  w.put(p.max_tokens);
  w.put<uint64_t>(p.stop.size());
  for (const std::string& text : p.stop) w.put(text);
  w.put(p.stop_token_ids);
  w.put<uint8_t>(p.ignore_eos);
  w.put<uint8_t>(p.include_stop_str_in_output);
  w.put<uint8_t>(p.skip_special_tokens);
  w.put(p.logprobs);
  w.put(p.prompt_logprobs);
  w.put(p.num_sequences);
  w.put<uint8_t>(p.score_sequences);
}

GenerationParams get_params(ByteReader& r) {
  GenerationParams p;
  SamplingParams& s = p.sampling;
  s.temperature = r.get<float>();
  s.top_k = r.get<int64_t>();
  s.top_p = r.get<float>();
  s.min_p = r.get<float>();
  s.repetition_penalty = r.get<float>();
  s.presence_penalty = r.get<float>();
  s.frequency_penalty = r.get<float>();
  s.logit_bias = get_pairs(r);
  s.seed = r.get<uint64_t>();
  p.has_seed = r.get<uint8_t>() != 0;
  p.max_tokens = r.get<int64_t>();
  p.stop.resize(r.count(sizeof(uint64_t)));
  for (std::string& text : p.stop) text = r.get_string();
  p.stop_token_ids = r.get_vector<int32_t>();
  p.ignore_eos = r.get<uint8_t>() != 0;
  p.include_stop_str_in_output = r.get<uint8_t>() != 0;
  p.skip_special_tokens = r.get<uint8_t>() != 0;
  p.logprobs = r.get<int64_t>();
  p.prompt_logprobs = r.get<int64_t>();
  p.num_sequences = r.get<int64_t>();
  p.score_sequences = r.get<uint8_t>() != 0;
  return p;
}

void put_logprobs(ByteWriter& w, const std::vector<TokenLogprob>& logprobs) {
  w.put<uint64_t>(logprobs.size());
  for (const TokenLogprob& l : logprobs) {
    w.put(l.token);
    w.put(l.logprob);
    w.put(l.rank);
    put_pairs(w, l.top);
  }
}

std::vector<TokenLogprob> get_logprobs(ByteReader& r) {
  std::vector<TokenLogprob> logprobs(r.count(sizeof(int32_t) + sizeof(float) + 2 * 8));
  for (TokenLogprob& l : logprobs) {
    l.token = r.get<int32_t>();
    l.logprob = r.get<float>();
    l.rank = r.get<int64_t>();
    l.top = get_pairs(r);
  }
  return logprobs;
}

void put_output(ByteWriter& w, const RequestOutput& o) {
  w.put(o.id);
  w.put(o.index);
  w.put(o.token_ids);
  w.put(o.text);
  put_logprobs(w, o.logprobs);
  put_logprobs(w, o.prompt_logprobs);
  w.put(o.cumulative_logprob);
  w.put<uint8_t>(static_cast<uint8_t>(o.finish));
  w.put<uint8_t>(o.last);
  w.put(o.num_prompt_tokens);
  w.put(o.num_output_tokens);
  w.put(o.num_cached_tokens);
}

RequestOutput get_output(ByteReader& r) {
  RequestOutput o;
  o.id = r.get<RequestId>();
  o.index = r.get<int64_t>();
  o.token_ids = r.get_vector<int32_t>();
  o.text = r.get_string();
  o.logprobs = get_logprobs(r);
  o.prompt_logprobs = get_logprobs(r);
  o.cumulative_logprob = r.get<double>();
  const uint8_t finish = r.get<uint8_t>();
  MOE_CHECK(finish <= static_cast<uint8_t>(FinishReason::kAbort), "rank link: finish reason ",
            int{finish}, " is not one of ours");
  o.finish = static_cast<FinishReason>(finish);
  o.last = r.get<uint8_t>() != 0;
  o.num_prompt_tokens = r.get<int64_t>();
  o.num_output_tokens = r.get<int64_t>();
  o.num_cached_tokens = r.get<int64_t>();
  return o;
}

void put_load(ByteWriter& w, const RankLoad& l) {
  for (int64_t v :
       {l.num_running, l.num_waiting, l.num_queued_tokens, static_cast<int64_t>(l.has_unfinished),
        l.prompt_tokens, l.generation_tokens, l.num_preemptions, l.kv_blocks, l.kv_used,
        l.kv_cached, l.prefix_queries, l.prefix_hits, l.network_bytes}) {
    w.put(v);
  }
}

RankLoad get_load(ByteReader& r) {
  RankLoad l;
  l.num_running = r.get<int64_t>();
  l.num_waiting = r.get<int64_t>();
  l.num_queued_tokens = r.get<int64_t>();
  l.has_unfinished = r.get<int64_t>() != 0;
  l.prompt_tokens = r.get<int64_t>();
  l.generation_tokens = r.get<int64_t>();
  l.num_preemptions = r.get<int64_t>();
  l.kv_blocks = r.get<int64_t>();
  l.kv_used = r.get<int64_t>();
  l.kv_cached = r.get<int64_t>();
  l.prefix_queries = r.get<int64_t>();
  l.prefix_hits = r.get<int64_t>();
  l.network_bytes = r.get<int64_t>();
  return l;
}

}  // namespace

std::vector<uint8_t> encode_orders(const RankOrders& orders) {
  ByteWriter w;
  w.put<uint64_t>(orders.requests.size());
  for (const RankRequest& request : orders.requests) {
    w.put(request.id);
    w.put(request.prompt);
    put_params(w, request.params);
  }
  w.put(orders.aborts);
  return w.take();
}

RankOrders decode_orders(std::span<const uint8_t> bytes) {
  ByteReader r(bytes);
  RankOrders orders;
  orders.requests.resize(r.count(sizeof(RequestId) + sizeof(uint64_t)));
  for (RankRequest& request : orders.requests) {
    request.id = r.get<RequestId>();
    request.prompt = r.get_vector<int32_t>();
    request.params = get_params(r);
  }
  orders.aborts = r.get_vector<RequestId>();
  r.expect_end();
  return orders;
}

std::vector<uint8_t> encode_report(const RankReport& report) {
  ByteWriter w;
  put_load(w, report.load);
  w.put<uint64_t>(report.outputs.size());
  for (const RequestOutput& out : report.outputs) put_output(w, out);
  w.put(report.started);
  w.put<uint64_t>(report.refused.size());
  for (const RankRefusal& refusal : report.refused) {
    w.put(refusal.id);
    w.put(refusal.message);
  }
  return w.take();
}

RankReport decode_report(std::span<const uint8_t> bytes) {
  ByteReader r(bytes);
  RankReport report;
  report.load = get_load(r);
  report.outputs.resize(r.count(sizeof(RequestId)));
  for (RequestOutput& out : report.outputs) out = get_output(r);
  report.started = r.get_vector<RequestId>();
  report.refused.resize(r.count(sizeof(RequestId) + sizeof(uint64_t)));
  for (RankRefusal& refusal : report.refused) {
    refusal.id = r.get<RequestId>();
    refusal.message = r.get_string();
  }
  r.expect_end();
  return report;
}

}  // namespace moeinfer

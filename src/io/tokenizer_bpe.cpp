// The BPE model of a tokenizer.json.
//
// A word is first split into characters (each looked up in the vocabulary, with the optional
// continuing-subword prefix and end-of-word suffix; unknown characters become <0xNN> byte tokens
// under byte_fallback, else the unk token, fused or not). Then merges are applied lowest rank
// first, leftmost first on ties, with a heap of candidate pairs whose stale entries are skipped
// exactly as `tokenizers` does, so ids agree even for vocabularies where two different pairs merge
// into the same token. Words up to 256 bytes are cached (10000 entries), which makes long texts
// cheap: most words repeat.
#include <queue>

#include "core/error.h"
#include "io/tokenizer_internal.h"
#include "io/unicode.h"

namespace moeinfer::tok {

namespace {

std::optional<std::string> optional_string(const Json& j, const char* key) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return std::nullopt;
  return it->get<std::string>();
}

bool optional_bool(const Json& j, const char* key, bool fallback) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return fallback;
  return it->get<bool>();
}

uint64_t pair_key(int32_t a, int32_t b) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
}

}  // namespace

BpeModel::BpeModel(const Json& j) {
  MOE_CHECK(j.contains("vocab") && j["vocab"].is_object(), "BPE model has no \"vocab\" object");
  MOE_CHECK(j.contains("merges") && j["merges"].is_array(), "BPE model has no \"merges\" list");
  if (auto it = j.find("dropout"); it != j.end() && !it->is_null()) {
    const double dropout = it->get<double>();
    MOE_CHECK(dropout == 0.0, "BPE dropout ", dropout,
              " is not supported (it makes encoding random)");
  }

  int64_t max_id = -1;
  vocab_.reserve(j["vocab"].size());
  for (const auto& [token, id_json] : j["vocab"].items()) {
    MOE_CHECK(id_json.is_number_integer(), "BPE vocab id of token '", token,
              "' is not an integer");
    const int64_t id = id_json.get<int64_t>();
    MOE_CHECK(id >= 0 && id < (int64_t{1} << 22), "BPE vocab id ", id, " of token '", token,
              "' is out of range");
    vocab_[token] = static_cast<int32_t>(id);
    max_id = std::max(max_id, id);
  }
  id_to_token_.resize(static_cast<size_t>(max_id + 1));
  has_id_.assign(static_cast<size_t>(max_id + 1), false);
  for (const auto& [token, id] : vocab_) {
    id_to_token_[id] = token;
    has_id_[id] = true;
  }

  if (auto unk = optional_string(j, "unk_token")) {
    unk_token_ = *unk;
    if (auto it = vocab_.find(*unk); it != vocab_.end()) unk_id_ = it->second;
  }
  continuing_subword_prefix_ = optional_string(j, "continuing_subword_prefix").value_or("");
  end_of_word_suffix_ = optional_string(j, "end_of_word_suffix").value_or("");
  fuse_unk_ = optional_bool(j, "fuse_unk", false);
  byte_fallback_ = optional_bool(j, "byte_fallback", false);
  ignore_merges_ = optional_bool(j, "ignore_merges", false);

  byte_ids_.fill(-1);
  for (int b = 0; b < 256; ++b) {
    static const char kHex[] = "0123456789ABCDEF";
    const std::string name = std::string("<0x") + kHex[b >> 4] + kHex[b & 15] + ">";
    if (auto it = vocab_.find(name); it != vocab_.end()) byte_ids_[b] = it->second;
  }

  const Json& merges = j["merges"];
  merges_.reserve(merges.size());
  const size_t prefix_len = continuing_subword_prefix_.size();
  int32_t rank = 0;
  for (const Json& m : merges) {
    std::string a, b;
    if (m.is_string()) {
      const std::string line = m.get<std::string>();
      const size_t space = line.find(' ');
      MOE_CHECK(space != std::string::npos && line.find(' ', space + 1) == std::string::npos,
                "BPE merge ", rank + 1, " '", line, "' is not of the form \"a b\"");
      a = line.substr(0, space);
      b = line.substr(space + 1);
    } else {
      MOE_CHECK(m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string(), "BPE merge ",
                rank + 1, " is neither \"a b\" nor [\"a\", \"b\"]");
      a = m[0].get<std::string>();
      b = m[1].get<std::string>();
    }
    auto ia = vocab_.find(a);
    auto ib = vocab_.find(b);
    MOE_CHECK(ia != vocab_.end(), "BPE merge ", rank + 1, ": token '", a,
              "' is not in the vocabulary");
    MOE_CHECK(ib != vocab_.end(), "BPE merge ", rank + 1, ": token '", b,
              "' is not in the vocabulary");
    MOE_CHECK(b.size() >= prefix_len, "BPE merge ", rank + 1, ": token '", b,
              "' is shorter than the continuing_subword_prefix");
    const std::string merged = a + b.substr(prefix_len);
    auto im = vocab_.find(merged);
    MOE_CHECK(im != vocab_.end(), "BPE merge ", rank + 1, ": merged token '", merged,
              "' is not in the vocabulary");
    // A repeated pair keeps the last rank, as a HashMap collect does.
    merges_[pair_key(ia->second, ib->second)] = {rank, im->second};
    ++rank;
  }
}

std::optional<int32_t> BpeModel::token_to_id(std::string_view token) const {
  auto it = vocab_.find(token);
  if (it == vocab_.end()) return std::nullopt;
  return it->second;
}

const std::string* BpeModel::id_to_token(int32_t id) const {
  if (id < 0 || static_cast<size_t>(id) >= has_id_.size() || !has_id_[id]) return nullptr;
  return &id_to_token_[id];
}

void BpeModel::tokenize(std::string_view word, std::vector<int32_t>& out) const {
  if (word.empty()) return;
  if (ignore_merges_) {
    if (auto it = vocab_.find(word); it != vocab_.end()) {
      out.push_back(it->second);
      return;
    }
  }
  {
    std::shared_lock lock(cache_mutex_);
    if (auto it = cache_.find(word); it != cache_.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  std::vector<int32_t> ids;
  merge_word(word, ids);
  out.insert(out.end(), ids.begin(), ids.end());
  if (word.size() < kMaxCachedWordBytes) {
    std::unique_lock lock(cache_mutex_);
    if (cache_.size() < kCacheCapacity) cache_.emplace(std::string(word), std::move(ids));
  }
}

void BpeModel::merge_word(std::string_view word, std::vector<int32_t>& out) const {
  struct Symbol {
    int32_t id;
    int32_t prev;
    int32_t next;
    uint32_t len;  // 0 once merged into its left neighbour
  };
  std::vector<Symbol> symbols;
  symbols.reserve(word.size());
  auto add = [&symbols](int32_t id, size_t len) {
    const auto n = static_cast<int32_t>(symbols.size());
    symbols.push_back({id, n - 1, -1, static_cast<uint32_t>(len)});
    if (n > 0) symbols[n - 1].next = n;
  };
  auto require_unk = [this]() -> int32_t {
    MOE_CHECK(unk_id_.has_value(), "BPE unk_token '", unk_token_.value_or(""),
              "' is not in the vocabulary");
    return *unk_id_;
  };

  std::optional<std::pair<int32_t, size_t>> unk;  // pending unk id and byte length
  const bool decorate = !continuing_subword_prefix_.empty() || !end_of_word_suffix_.empty();
  std::string decorated;
  for (size_t pos = 0; pos < word.size();) {
    const size_t start = pos;
    pos += unicode::utf8_length(static_cast<unsigned char>(word[pos]));
    const std::string_view ch = word.substr(start, pos - start);
    std::string_view key = ch;
    if (decorate) {
      decorated.clear();
      if (start != 0) decorated += continuing_subword_prefix_;
      decorated += ch;
      if (pos == word.size()) decorated += end_of_word_suffix_;
      key = decorated;
    }
    if (auto it = vocab_.find(key); it != vocab_.end()) {
      if (unk) {
        add(unk->first, unk->second);
        unk.reset();
      }
      add(it->second, ch.size());
      continue;
    }
    if (byte_fallback_) {
      bool all_bytes = true;
      for (const char c : key)
        all_bytes = all_bytes && byte_ids_[static_cast<unsigned char>(c)] >= 0;
      if (all_bytes) {
        for (const char c : key) add(byte_ids_[static_cast<unsigned char>(c)], 1);
        continue;
      }
    }
    if (unk_token_.has_value()) {
      if (unk && fuse_unk_) {
        unk->second += ch.size();
      } else {
        if (unk) add(unk->first, unk->second);
        unk = std::make_pair(require_unk(), ch.size());
      }
    }
    // Without an unk token an unknown character is dropped, as `tokenizers` does.
  }
  if (unk) add(unk->first, unk->second);

  struct Candidate {
    int32_t rank;
    int32_t pos;
    int32_t new_id;
  };
  auto later = [](const Candidate& x, const Candidate& y) {
    return x.rank != y.rank ? x.rank > y.rank : x.pos > y.pos;
  };
  std::priority_queue<Candidate, std::vector<Candidate>, decltype(later)> queue(later);
  auto find_merge = [this](int32_t a, int32_t b) -> const std::pair<int32_t, int32_t>* {
    auto it = merges_.find(pair_key(a, b));
    return it == merges_.end() ? nullptr : &it->second;
  };
  for (size_t i = 0; i + 1 < symbols.size(); ++i) {
    if (const auto* m = find_merge(symbols[i].id, symbols[i + 1].id)) {
      queue.push({m->first, static_cast<int32_t>(i), m->second});
    }
  }
  while (!queue.empty()) {
    const Candidate top = queue.top();
    queue.pop();
    Symbol& left = symbols[top.pos];
    if (left.len == 0 || left.next == -1) continue;
    const Symbol right = symbols[left.next];
    const auto* current = find_merge(left.id, right.id);
    if (current == nullptr || current->second != top.new_id) continue;  // stale entry
    const int32_t right_pos = left.next;
    left.id = top.new_id;
    left.len += right.len;
    left.next = right.next;
    symbols[right_pos].len = 0;
    if (right.next >= 0) symbols[right.next].prev = top.pos;
    if (left.prev >= 0) {
      if (const auto* m = find_merge(symbols[left.prev].id, left.id)) {
        queue.push({m->first, left.prev, m->second});
      }
    }
    if (left.next >= 0) {
      if (const auto* m = find_merge(left.id, symbols[left.next].id)) {
        queue.push({m->first, top.pos, m->second});
      }
    }
  }
  for (const Symbol& s : symbols) {
    if (s.len != 0) out.push_back(s.id);
  }
}

}  // namespace moeinfer::tok

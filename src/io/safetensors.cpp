// Safetensors reading: header validation, memory maps, and the checkpoint-wide WeightStore.
// Validation happens once at open time, so later accessors can trust every entry's offsets.
#include "io/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "core/error.h"
#include "core/progress.h"

namespace moeinfer {

namespace {

using json = nlohmann::json;

std::string quote_name(std::string_view text) {
  // Names come from untrusted files: keep messages on one line and of bounded length.
  std::string out = "'";
  for (char c : text.substr(0, 200)) out += (static_cast<unsigned char>(c) < 0x20) ? '?' : c;
  if (text.size() > 200) out += "...";
  return out + "'";
}

uint64_t read_u64_le(const uint8_t* p) {
  uint64_t value = 0;
  for (int i = 7; i >= 0; --i) value = (value << 8) | p[i];
  return value;
}

// A non-negative JSON integer, or an error naming the field.
uint64_t as_u64(const json& value, const std::string& source, const std::string& name,
                const char* field) {
  if (value.is_number_unsigned()) return value.get<uint64_t>();
  if (value.is_number_integer())
    MOE_FAIL(source, ": tensor ", quote_name(name), ": ", field, " holds a negative value ",
             value.get<int64_t>());
  MOE_FAIL(source, ": tensor ", quote_name(name), ": ", field, " must hold integers, found ",
           value.type_name());
}

TensorEntry parse_entry(const std::string& name, const json& value, const std::string& source) {
  MOE_CHECK(value.is_object(), source, ": tensor ", quote_name(name),
            ": entry must be an object, found ", value.type_name());
  TensorEntry entry;
  entry.name = name;

  const auto dtype_it = value.find("dtype");
  MOE_CHECK(dtype_it != value.end(), source, ": tensor ", quote_name(name),
            ": missing field 'dtype'");
  MOE_CHECK(dtype_it->is_string(), source, ": tensor ", quote_name(name),
            ": field 'dtype' must be a string, found ", dtype_it->type_name());
  const auto& dtype_text = dtype_it->get_ref<const std::string&>();
  MOE_CHECK(parse_safetensors_dtype(dtype_text, &entry.dtype), source, ": tensor ",
            quote_name(name), ": unsupported dtype ", quote_name(dtype_text));

  const auto shape_it = value.find("shape");
  MOE_CHECK(shape_it != value.end(), source, ": tensor ", quote_name(name),
            ": missing field 'shape'");
  MOE_CHECK(shape_it->is_array(), source, ": tensor ", quote_name(name),
            ": field 'shape' must be an array, found ", shape_it->type_name());
  MOE_CHECK(shape_it->size() <= static_cast<size_t>(Shape::kMaxRank), source, ": tensor ",
            quote_name(name), ": rank ", shape_it->size(), " exceeds the supported ",
            Shape::kMaxRank);
  uint64_t numel = 1;
  bool numel_overflow = false;
  for (const json& dim : *shape_it) {
    const uint64_t d = as_u64(dim, source, name, "shape");
    MOE_CHECK(d <= static_cast<uint64_t>(INT64_MAX), source, ": tensor ", quote_name(name),
              ": dimension ", d, " is too large");
    entry.shape.push_back(static_cast<int64_t>(d));
    numel_overflow |= __builtin_mul_overflow(numel, d, &numel);
  }

  const auto offsets_it = value.find("data_offsets");
  MOE_CHECK(offsets_it != value.end(), source, ": tensor ", quote_name(name),
            ": missing field 'data_offsets'");
  MOE_CHECK(offsets_it->is_array() && offsets_it->size() == 2, source, ": tensor ",
            quote_name(name), ": field 'data_offsets' must be an array [begin, end]");
  entry.begin = as_u64((*offsets_it)[0], source, name, "data_offsets");
  entry.end = as_u64((*offsets_it)[1], source, name, "data_offsets");
  MOE_CHECK(entry.begin <= entry.end, source, ": tensor ", quote_name(name), ": data_offsets [",
            entry.begin, ", ", entry.end, ") end before they begin");

  uint64_t nbytes = 0;
  const bool nbytes_overflow =
      numel_overflow || __builtin_mul_overflow(numel, dtype_size(entry.dtype), &nbytes);
  MOE_CHECK(!nbytes_overflow, source, ": tensor ", quote_name(name), ": shape ", entry.shape.str(),
            " is too large");
  MOE_CHECK(entry.end - entry.begin == nbytes, source, ": tensor ", quote_name(name),
            ": data_offsets [", entry.begin, ", ", entry.end, ") hold ", entry.end - entry.begin,
            " bytes, but dtype ", dtype_text, " and shape ", entry.shape.str(), " need ", nbytes);
  return entry;
}

}  // namespace

std::vector<TensorEntry> parse_safetensors_header(const uint8_t* bytes, size_t size,
                                                  const std::string& source,
                                                  uint64_t* data_offset) {
  MOE_CHECK(size >= 8, source, ": file is ", size,
            " bytes, too short for a safetensors header (truncated file?)");
  const uint64_t header_len = read_u64_le(bytes);
  MOE_CHECK(header_len <= size - 8, source, ": header length ", header_len,
            " runs past the end of the file (", size, " bytes; truncated file?)");
  MOE_CHECK(header_len <= kMaxSafetensorsHeaderBytes, source, ": header length ", header_len,
            " exceeds the limit of ", kMaxSafetensorsHeaderBytes, " bytes");
  MOE_CHECK(header_len >= 2, source, ": header length ", header_len, " is too short for JSON");
  const uint64_t data_size = size - 8 - header_len;

  const char* text = reinterpret_cast<const char*>(bytes + 8);
  json root;
  try {
    root = json::parse(text, text + header_len);
  } catch (const json::exception& e) {
    MOE_FAIL(source, ": header is not valid JSON: ", e.what());
  }
  MOE_CHECK(root.is_object(), source, ": header must be a JSON object, found ", root.type_name());

  std::vector<TensorEntry> entries;
  entries.reserve(root.size());
  for (const auto& [name, value] : root.items()) {
    if (name == "__metadata__") {
      MOE_CHECK(value.is_object(), source, ": '__metadata__' must be an object, found ",
                value.type_name());
      for (const auto& [key, item] : value.items())
        MOE_CHECK(item.is_string(), source, ": '__metadata__' entry ", quote_name(key),
                  " must be a string, found ", item.type_name());
      continue;
    }
    TensorEntry entry = parse_entry(name, value, source);
    MOE_CHECK(entry.end <= data_size, source, ": tensor ", quote_name(name), ": data_offsets [",
              entry.begin, ", ", entry.end, ") run past the end of the data section (", data_size,
              " bytes; truncated file?)");
    entries.push_back(std::move(entry));
  }

  std::sort(entries.begin(), entries.end(), [](const TensorEntry& a, const TensorEntry& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  const TensorEntry* previous = nullptr;  // the non-empty entry that ends last so far
  for (const TensorEntry& entry : entries) {
    if (entry.begin == entry.end) continue;  // empty tensors occupy no bytes
    if (previous) {
      MOE_CHECK(entry.begin >= previous->end, source, ": tensors ", quote_name(previous->name),
                " [", previous->begin, ", ", previous->end, ") and ", quote_name(entry.name), " [",
                entry.begin, ", ", entry.end, ") overlap");
    }
    previous = &entry;
  }
  if (data_offset) *data_offset = 8 + header_len;
  return entries;
}

// ---------------------------------------------------------------------------------------------
// SafetensorsFile

SafetensorsFile SafetensorsFile::open(const std::filesystem::path& path) {
  SafetensorsFile file;
  file.path_ = path;
  const std::string source = path.string();
  const int fd = ::open(source.c_str(), O_RDONLY | O_CLOEXEC);
  MOE_CHECK(fd >= 0, source, ": cannot open: ", std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    MOE_FAIL(source, ": not a regular file");
  }
  const size_t size = static_cast<size_t>(st.st_size);
  if (size < 8) {
    ::close(fd);
    MOE_FAIL(source, ": file is ", size,
             " bytes, too short for a safetensors header (truncated file?)");
  }
  void* base = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  const int map_errno = errno;
  ::close(fd);
  MOE_CHECK(base != MAP_FAILED, source, ": mmap of ", size,
            " bytes failed: ", std::strerror(map_errno));
  file.base_ = static_cast<const uint8_t*>(base);
  file.size_ = size;
  // From here on the destructor unmaps if validation throws.
  file.entries_ = parse_safetensors_header(file.base_, size, source, &file.data_offset_);
  for (size_t i = 0; i < file.entries_.size(); ++i) file.by_name_.emplace(file.entries_[i].name, i);
  return file;
}

SafetensorsFile::~SafetensorsFile() { reset(); }

void SafetensorsFile::reset() {
  if (base_) ::munmap(const_cast<uint8_t*>(base_), size_);
  base_ = nullptr;
  size_ = 0;
}

SafetensorsFile::SafetensorsFile(SafetensorsFile&& other) noexcept { *this = std::move(other); }

SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&& other) noexcept {
  if (this != &other) {
    reset();
    path_ = std::move(other.path_);
    base_ = std::exchange(other.base_, nullptr);
    size_ = std::exchange(other.size_, 0);
    data_offset_ = std::exchange(other.data_offset_, 0);
    entries_ = std::move(other.entries_);
    by_name_ = std::move(other.by_name_);
  }
  return *this;
}

const TensorEntry* SafetensorsFile::find(std::string_view name) const {
  const auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &entries_[it->second];
}

TensorView SafetensorsFile::view(const TensorEntry& entry) const {
  return TensorView{.dtype = entry.dtype, .shape = entry.shape, .data = data() + entry.begin};
}

// ---------------------------------------------------------------------------------------------
// WeightStore

namespace {

constexpr const char* kSingleFile = "model.safetensors";
constexpr const char* kIndexFile = "model.safetensors.index.json";

std::string dtype_list(std::span<const DType> allowed) {
  std::string out;
  for (size_t i = 0; i < allowed.size(); ++i) {
    out += (i ? ", " : "");
    out += dtype_name(allowed[i]);
  }
  return out;
}

// Reads the index's weight_map: tensor name -> shard file name.
std::map<std::string, std::string> read_index(const std::filesystem::path& index_path) {
  const std::string source = index_path.string();
  std::ifstream in(index_path, std::ios::binary);
  MOE_CHECK(in, source, ": cannot open: ", std::strerror(errno));
  std::stringstream buffer;
  buffer << in.rdbuf();
  json root;
  try {
    root = json::parse(buffer.str());
  } catch (const json::exception& e) {
    MOE_FAIL(source, ": not valid JSON: ", e.what());
  }
  MOE_CHECK(root.is_object(), source, ": must be a JSON object, found ", root.type_name());
  const auto map_it = root.find("weight_map");
  MOE_CHECK(map_it != root.end(), source, ": missing field 'weight_map'");
  MOE_CHECK(map_it->is_object(), source, ": field 'weight_map' must be an object, found ",
            map_it->type_name());
  MOE_CHECK(!map_it->empty(), source, ": field 'weight_map' is empty");
  std::map<std::string, std::string> weight_map;
  for (const auto& [name, shard] : map_it->items()) {
    MOE_CHECK(shard.is_string(), source, ": weight_map entry for tensor ", quote_name(name),
              " must be a file name string, found ", shard.type_name());
    const std::string& file = shard.get_ref<const std::string&>();
    const std::filesystem::path rel(file);
    bool escapes = file.empty() || rel.is_absolute();
    for (const auto& part : rel) escapes |= (part == "..");
    MOE_CHECK(!escapes, source, ": weight_map entry for tensor ", quote_name(name), " names shard ",
              quote_name(file), ", which is not a file inside the checkpoint folder");
    weight_map.emplace(name, file);
  }
  return weight_map;
}

}  // namespace

WeightStore WeightStore::open(const std::filesystem::path& model_dir) {
  WeightStore store;
  std::error_code ec;
  std::filesystem::path index_path, single_path;
  if (std::filesystem::is_directory(model_dir, ec)) {
    store.dir_ = model_dir;
    index_path = model_dir / kIndexFile;
    single_path = model_dir / kSingleFile;
    if (!std::filesystem::exists(index_path, ec)) index_path.clear();
  } else if (std::filesystem::is_regular_file(model_dir, ec)) {
    // A file given directly: an index (…index.json) or a single .safetensors file.
    store.dir_ = model_dir.parent_path();
    const std::string name = model_dir.filename().string();
    if (name.ends_with(".json"))
      index_path = model_dir;
    else
      single_path = model_dir;
  } else {
    MOE_FAIL(model_dir.string(), ": no such checkpoint folder");
  }

  if (!index_path.empty()) {
    const auto weight_map = read_index(index_path);
    std::map<std::string, uint32_t> shard_ids;
    for (const auto& [name, shard] : weight_map) {
      if (shard_ids.contains(shard)) continue;
      const std::filesystem::path shard_path = store.dir_ / shard;
      MOE_CHECK(std::filesystem::is_regular_file(shard_path, ec), index_path.string(), ": shard ",
                quote_name(shard), " (holding tensor ", quote_name(name),
                ") is missing: ", shard_path.string(), " does not exist");
      shard_ids.emplace(shard, static_cast<uint32_t>(store.files_.size()));
      store.files_.push_back(std::make_unique<SafetensorsFile>(SafetensorsFile::open(shard_path)));
    }
    for (const auto& [name, shard] : weight_map) {
      const uint32_t id = shard_ids.at(shard);
      const TensorEntry* entry = store.files_[id]->find(name);
      MOE_CHECK(entry != nullptr, index_path.string(), ": tensor ", quote_name(name),
                " is assigned to shard ", quote_name(shard), ", but ",
                store.files_[id]->path().string(), " does not contain it");
      store.tensors_.emplace(name, Location{.file = id, .entry = entry});
    }
    // Tensors a shard holds but the index does not list are still reachable. A tensor held by two
    // shards is refused: which copy a loader takes differs (transformers: the last shard read).
    for (uint32_t id = 0; id < store.files_.size(); ++id) {
      for (const TensorEntry& entry : store.files_[id]->entries()) {
        const auto [it, added] =
            store.tensors_.emplace(entry.name, Location{.file = id, .entry = &entry});
        MOE_CHECK(added || it->second.file == id, index_path.string(), ": tensor ",
                  quote_name(entry.name), " is in two shards, ",
                  store.files_[it->second.file]->path().filename().string(), " and ",
                  store.files_[id]->path().filename().string(), "; a checkpoint holds each once");
      }
    }
  } else {
    MOE_CHECK(std::filesystem::is_regular_file(single_path, ec), model_dir.string(), ": no ",
              kSingleFile, " or ", kIndexFile, " found");
    store.files_.push_back(std::make_unique<SafetensorsFile>(SafetensorsFile::open(single_path)));
    for (const TensorEntry& entry : store.files_[0]->entries())
      store.tensors_.emplace(entry.name, Location{.file = 0, .entry = &entry});
  }
  return store;
}

const WeightStore::Location& WeightStore::locate(std::string_view name) const {
  const auto it = tensors_.find(name);
  MOE_CHECK(it != tensors_.end(), "missing tensor ", quote_name(name), " in ", dir_.string());
  return it->second;
}

bool WeightStore::has(std::string_view name) const { return tensors_.contains(name); }

const TensorEntry& WeightStore::entry(std::string_view name) const { return *locate(name).entry; }

TensorView WeightStore::require(std::string_view name, const Shape& shape) const {
  static constexpr DType kFloat[] = {DType::kF32, DType::kBF16, DType::kF16};
  return require(name, shape, kFloat);
}

TensorView WeightStore::require(std::string_view name, const Shape& shape,
                                std::span<const DType> allowed) const {
  const Location& loc = locate(name);
  const SafetensorsFile& file = *files_[loc.file];
  const TensorEntry& entry = *loc.entry;
  MOE_CHECK(entry.shape == shape, file.path().string(), ": tensor ", quote_name(name),
            " has shape ", entry.shape.str(), ", expected ", shape.str());
  MOE_CHECK(std::find(allowed.begin(), allowed.end(), entry.dtype) != allowed.end(),
            file.path().string(), ": tensor ", quote_name(name), " has dtype ",
            dtype_name(entry.dtype), ", expected one of ", dtype_list(allowed));
  return file.view(entry);
}

std::vector<std::string> WeightStore::names() const {
  std::vector<std::string> out;
  out.reserve(tensors_.size());
  for (const auto& [name, loc] : tensors_) out.push_back(name);
  return out;
}

std::string WeightStore::file_of(std::string_view name) const {
  return files_[locate(name).file]->path().string();
}

size_t WeightStore::total_bytes() const {
  size_t total = 0;
  for (const auto& file : files_)
    for (const TensorEntry& entry : file->entries()) total += entry.end - entry.begin;
  return total;
}

double WeightStore::prefault() const {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  constexpr size_t kChunk = 64ull << 20;
  size_t total = 0;
  for (const auto& file : files_) total += file->data_bytes();
  ProgressBar bar("loading weights", total, ProgressOptions{.unit = "B"});
  const auto start = std::chrono::steady_clock::now();
  size_t done = 0;
  volatile uint8_t sink = 0;
  for (const auto& file : files_) {
    // Page-aligned range covering the data section; the map itself starts page-aligned.
    const uint8_t* map_begin = file->data() - file->data_offset();
    const size_t first = (file->data_offset() / page) * page;
    const size_t last = file->file_bytes();
    for (size_t offset = first; offset < last; offset += kChunk) {
      const size_t len = std::min(kChunk, last - offset);
      auto* chunk = const_cast<uint8_t*>(map_begin + offset);
      if (offset + len < last) {
        const size_t next = std::min(kChunk, last - offset - len);
        ::madvise(chunk + len, next, MADV_WILLNEED);  // start the next read early
      }
#ifdef MADV_POPULATE_READ
      const bool populated = ::madvise(chunk, len, MADV_POPULATE_READ) == 0;
#else
      const bool populated = false;
#endif
      if (!populated) {
        uint8_t acc = 0;
        for (size_t i = 0; i < len; i += page) acc ^= chunk[i];
        sink = sink ^ acc;
      }
      const size_t data_begin = std::max(offset, static_cast<size_t>(file->data_offset()));
      if (offset + len > data_begin) done += offset + len - data_begin;
      bar.update(done);
    }
  }
  bar.finish();
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return secs > 0 ? static_cast<double>(total) / secs / 1e9 : 0.0;
}

}  // namespace moeinfer

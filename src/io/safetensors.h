// Checkpoint tensors straight from the memory map: one SafetensorsFile per .safetensors file,
// one WeightStore per checkpoint folder (a single model.safetensors, or the shards that
// model.safetensors.index.json names). Every header is validated before a byte of data is used,
// so a truncated download or a header that lies stops with an error naming the file and tensor.
//
// File layout: [u64 little-endian N][N bytes of JSON header][data section]. The header maps
// tensor names to {dtype, shape, data_offsets: [begin, end)}, offsets relative to the data
// section; "__metadata__" holds free-form strings.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/dtype.h"
#include "core/tensor.h"

namespace moeinfer {

struct TensorEntry {
  std::string name;
  DType dtype = DType::kF32;
  Shape shape;
  uint64_t begin = 0;  // offsets into the data section
  uint64_t end = 0;
};

// Largest header we accept (the reference implementation's limit).
inline constexpr uint64_t kMaxSafetensorsHeaderBytes = 100ull << 20;

// Parses and validates a safetensors header held in memory (`bytes` is the start of the file and
// `size` the whole file's size, so the data section is checked to hold every tensor). Entries come
// back in data order. `source` names the file in errors; *data_offset receives 8 + N.
std::vector<TensorEntry> parse_safetensors_header(const uint8_t* bytes, size_t size,
                                                  const std::string& source, uint64_t* data_offset);

// A read-only, private memory map of one validated .safetensors file. Movable, not copyable;
// unmaps on destruction.
class SafetensorsFile {
 public:
  static SafetensorsFile open(const std::filesystem::path& path);
  SafetensorsFile() = default;
  ~SafetensorsFile();
  SafetensorsFile(SafetensorsFile&& other) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&& other) noexcept;
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::filesystem::path& path() const { return path_; }
  const std::vector<TensorEntry>& entries() const { return entries_; }
  // nullptr when absent.
  const TensorEntry* find(std::string_view name) const;
  TensorView view(const TensorEntry& entry) const;
  size_t file_bytes() const { return size_; }
  uint64_t data_offset() const { return data_offset_; }
  uint64_t data_bytes() const { return size_ - data_offset_; }
  const uint8_t* data() const { return base_ + data_offset_; }

 private:
  void reset();

  std::filesystem::path path_;
  const uint8_t* base_ = nullptr;
  size_t size_ = 0;
  uint64_t data_offset_ = 0;
  std::vector<TensorEntry> entries_;
  std::map<std::string, size_t, std::less<>> by_name_;
};

// All tensors of a checkpoint folder.
class WeightStore {
 public:
  // <dir>/model.safetensors.index.json and its shards when the index exists (every shard it names
  // must exist and hold the tensors the index assigns to it), else <dir>/model.safetensors.
  static WeightStore open(const std::filesystem::path& model_dir);
  WeightStore() = default;
  WeightStore(WeightStore&&) noexcept = default;
  WeightStore& operator=(WeightStore&&) noexcept = default;
  WeightStore(const WeightStore&) = delete;
  WeightStore& operator=(const WeightStore&) = delete;

  bool has(std::string_view name) const;
  // The tensor, checked: present, shape equal to `shape`, dtype one of `allowed` (F32, BF16, F16
  // by default). Errors name the file, the tensor, and the expected and found values.
  TensorView require(std::string_view name, const Shape& shape) const;
  TensorView require(std::string_view name, const Shape& shape,
                     std::span<const DType> allowed) const;
  // The entry as stored, without checks; throws "missing tensor" when absent.
  const TensorEntry& entry(std::string_view name) const;
  std::vector<std::string> names() const;  // sorted
  std::string file_of(std::string_view name) const;
  const std::filesystem::path& dir() const { return dir_; }
  size_t num_files() const { return files_.size(); }
  size_t total_bytes() const;  // bytes of tensor data over all files
  // Touches every page once (so the first forward pass does not stall), showing a progress bar on
  // stderr when it takes over a second; returns the achieved GB/s.
  double prefault() const;

 private:
  struct Location {
    uint32_t file = 0;
    const TensorEntry* entry = nullptr;
  };
  const Location& locate(std::string_view name) const;

  std::filesystem::path dir_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;  // stable addresses for Location::entry
  std::map<std::string, Location, std::less<>> tensors_;
};

}  // namespace moeinfer

#include "io/npy.h"

#include <cstring>
#include <fstream>
#include <sstream>
#include <string>

#include "core/error.h"

namespace moeinfer {
namespace {
constexpr char kMagic[] = "\x93NUMPY";
}

void write_npy_f32(const std::filesystem::path& path, std::span<const float> data,
                   std::span<const int64_t> shape) {
  std::string header = "{'descr': '<f4', 'fortran_order': False, 'shape': (";
  int64_t numel = 1;
  for (size_t i = 0; i < shape.size(); ++i) {
    header += std::to_string(shape[i]) + (shape.size() == 1 ? ",)" : i + 1 < shape.size() ? ", " : ")");
    numel *= shape[i];
  }
  if (shape.empty()) header += ")";
  header += ", }";
  MOE_CHECK(numel == static_cast<int64_t>(data.size()), "npy shape holds ", numel,
            " values, data has ", data.size());
  // Magic (6) + version (2) + header length (2) + header, padded with spaces to 64 bytes.
  const size_t unpadded = 10 + header.size() + 1;
  header.append((64 - unpadded % 64) % 64, ' ');
  header += '\n';
  std::ofstream out(path, std::ios::binary);
  MOE_CHECK(out, "cannot open ", path.string(), " for writing");
  out.write(kMagic, 6);
  const char version[2] = {1, 0};
  out.write(version, 2);
  const uint16_t header_len = static_cast<uint16_t>(header.size());
  const char len_bytes[2] = {static_cast<char>(header_len & 0xff), static_cast<char>(header_len >> 8)};
  out.write(len_bytes, 2);
  out.write(header.data(), static_cast<std::streamsize>(header.size()));
  out.write(reinterpret_cast<const char*>(data.data()),
            static_cast<std::streamsize>(data.size() * sizeof(float)));
  MOE_CHECK(out.good(), "failed writing ", path.string());
}

NpyArray read_npy_f32(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  MOE_CHECK(in, "cannot open ", path.string());
  char preamble[10];
  in.read(preamble, 10);
  MOE_CHECK(in && std::memcmp(preamble, kMagic, 6) == 0, path.string(), " is not a .npy file");
  MOE_CHECK(preamble[6] == 1, path.string(), ": only .npy format version 1 is read");
  const uint16_t header_len = static_cast<uint8_t>(preamble[8]) |
                              static_cast<uint16_t>(static_cast<uint8_t>(preamble[9]) << 8);
  std::string header(header_len, '\0');
  in.read(header.data(), header_len);
  MOE_CHECK(in, path.string(), ": truncated header");
  MOE_CHECK(header.find("'<f4'") != std::string::npos, path.string(), ": dtype is not <f4");
  MOE_CHECK(header.find("'fortran_order': False") != std::string::npos, path.string(),
            ": Fortran order is not read");
  const size_t open = header.find('(');
  const size_t close = header.find(')', open);
  MOE_CHECK(open != std::string::npos && close != std::string::npos, path.string(), ": no shape");
  NpyArray array;
  std::stringstream dims(header.substr(open + 1, close - open - 1));
  std::string item;
  int64_t numel = 1;
  while (std::getline(dims, item, ',')) {
    if (item.find_first_not_of(' ') == std::string::npos) continue;
    array.shape.push_back(std::stoll(item));
    numel *= array.shape.back();
  }
  array.data.resize(numel);
  in.read(reinterpret_cast<char*>(array.data.data()), numel * static_cast<int64_t>(sizeof(float)));
  MOE_CHECK(in, path.string(), ": truncated data");
  return array;
}

}  // namespace moeinfer

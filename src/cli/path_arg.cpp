#include "cli/path_arg.h"

#include <unistd.h>

#include <filesystem>
#include <string>
#include <system_error>

namespace moeinfer::cli {

CLI::Validator writable_file() {
  return CLI::Validator(
      [](std::string& path) -> std::string {
        namespace fs = std::filesystem;
        std::error_code ec;
        if (fs::is_directory(path, ec)) return path + " is a folder, not a file";
        const fs::path parent = fs::path(path).parent_path();
        const fs::path folder = parent.empty() ? fs::path(".") : parent;
        if (!fs::is_directory(folder, ec)) return "no folder " + folder.string() + " to write into";
        if (::access(folder.c_str(), W_OK) != 0)
          return "the folder " + folder.string() + " is not writable";
        return "";
      },
      "FILE");
}

}  // namespace moeinfer::cli

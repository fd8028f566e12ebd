// The engine's version, in one place: `moeinfer --version` and the server's /version say it.
#pragma once

namespace moeinfer {

inline constexpr const char* kVersion = "0.1.0";

}  // namespace moeinfer

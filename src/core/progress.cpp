#include "core/progress.h"

#include <unistd.h>

#include <algorithm>

namespace moeinfer {

namespace {

std::string format_units(double value, const char* unit) {
  char buf[64];
  if (std::string_view(unit) == "B") {
    static constexpr const char* kSuffix[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    int i = 0;
    while (value >= 1024.0 && i < 4) {
      value /= 1024.0;
      ++i;
    }
    std::snprintf(buf, sizeof(buf), i == 0 ? "%.0f %s" : "%.1f %s", value, kSuffix[i]);
  } else {
    std::snprintf(buf, sizeof(buf), "%.0f%s%s", value, *unit ? " " : "", unit);
  }
  return buf;
}

}  // namespace

ProgressBar::ProgressBar(std::string label, uint64_t total_units, ProgressOptions options)
    : label_(std::move(label)), total_(total_units), options_(options) {
  stream_ = options_.stream ? options_.stream : stderr;
  enabled_ = options_.force || isatty(fileno(stream_)) == 1;
  start_ = std::chrono::steady_clock::now();
  last_draw_ = start_;
}

ProgressBar::~ProgressBar() { finish(); }

double ProgressBar::elapsed_s() const {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
}

void ProgressBar::update(uint64_t done_units) {
  done_ = std::min(done_units, total_);
  if (!enabled_ || finished_) return;
  const auto now = std::chrono::steady_clock::now();
  if (std::chrono::duration<double>(now - start_).count() < options_.delay_s) return;
  if (drawn_ && std::chrono::duration<double>(now - last_draw_).count() < options_.min_redraw_s &&
      done_ < total_)
    return;
  last_draw_ = now;
  draw(false);
}

void ProgressBar::finish() {
  if (finished_) return;
  finished_ = true;
  if (drawn_) {
    draw(true);
    std::fputc('\n', stream_);
    std::fflush(stream_);
  }
}

void ProgressBar::draw(bool final_draw) {
  constexpr int kWidth = 30;
  const double fraction = total_ ? static_cast<double>(done_) / static_cast<double>(total_) : 1.0;
  const int filled = static_cast<int>(fraction * kWidth);
  std::string bar(kWidth, ' ');
  std::fill(bar.begin(), bar.begin() + filled, '=');
  if (filled < kWidth && !final_draw) bar[filled] = '>';
  const double secs = std::max(elapsed_s(), 1e-9);
  const std::string rate = format_units(static_cast<double>(done_) / secs, options_.unit);
  std::fprintf(stream_, "\r%s [%s] %3d%% %s / %s  %s/s  %.1fs", label_.c_str(), bar.c_str(),
               static_cast<int>(fraction * 100.0),
               format_units(static_cast<double>(done_), options_.unit).c_str(),
               format_units(static_cast<double>(total_), options_.unit).c_str(), rate.c_str(),
               secs);
  std::fflush(stream_);
  drawn_ = true;
}

}  // namespace moeinfer

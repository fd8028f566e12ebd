// A one-line progress bar on stderr for slow host work (loading, prefaulting a checkpoint).
// It stays silent for short jobs: nothing is drawn until `delay_s` has passed, and nothing at all
// unless the stream is a terminal or the caller forces it (logs stay free of carriage returns).
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>

namespace moeinfer {

struct ProgressOptions {
  bool force = false;           // draw even when the stream is not a terminal
  double delay_s = 1.0;         // draw only once the job has run this long
  double min_redraw_s = 0.1;    // at most this often
  std::FILE* stream = nullptr;  // nullptr = stderr
  const char* unit = "";        // "B" formats units as bytes (KiB, MiB, GiB)
};

class ProgressBar {
 public:
  ProgressBar(std::string label, uint64_t total_units, ProgressOptions options = {});
  ~ProgressBar();
  ProgressBar(const ProgressBar&) = delete;
  ProgressBar& operator=(const ProgressBar&) = delete;

  // Sets the number of units done so far (clamped to the total) and redraws when due.
  void update(uint64_t done_units);
  void advance(uint64_t units) { update(done_ + units); }
  // Draws the final state (if anything was drawn before) and ends the line. Idempotent.
  void finish();

  bool drawn() const { return drawn_; }
  uint64_t done() const { return done_; }
  double elapsed_s() const;

 private:
  void draw(bool final_draw);

  std::string label_;
  uint64_t total_ = 0;
  uint64_t done_ = 0;
  ProgressOptions options_;
  std::FILE* stream_ = nullptr;
  bool enabled_ = false;
  bool drawn_ = false;
  bool finished_ = false;
  std::chrono::steady_clock::time_point start_;
  std::chrono::steady_clock::time_point last_draw_;
};

}  // namespace moeinfer

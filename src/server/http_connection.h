// How `moeinfer serve` reads HTTP connections, on top of cpp-httplib.
//
// The packaged cpp-httplib (0.11) serves a connection with a fresh stream per request, so the
// bytes of pipelined requests it had already buffered behind the first are lost; its read timeout
// is per recv(), so a client sending a byte a second holds a pool thread for as long as it likes;
// and it bounds neither the total size of the headers nor a chunked body. HttpServer replaces its
// per-connection loop: one buffered stream per connection (pipelined requests are answered in
// order), a deadline and a byte budget for each read phase (the request line and headers, then
// the body) with a minimum rate after a grace period, a deadline for the client to take what is
// written to it, and a lingering close when a request was answered before its body was read, so
// the client gets the answer rather than a reset.
#pragma once

#include <httplib.h>

#include <chrono>
#include <cstddef>
#include <functional>
#include <string>

namespace moeinfer::server {

struct HttpLimits {
  // The request line and headers, from their first byte.
  std::chrono::milliseconds header_timeout{10'000};
  // The whole body, from the end of the headers.
  std::chrono::milliseconds body_timeout{60'000};
  size_t max_header_bytes = size_t{64} << 10;  // request line and headers together
  size_t max_body_bytes = size_t{16} << 20;    // decoded body (chunk framing not counted)
  // Slow senders, as Apache's mod_reqtimeout MinRate: after `rate_grace` a read phase must have
  // brought min_rate bytes a second on average since, so it may last rate_grace + bytes /
  // min_rate (and never past its timeout). 0: no minimum.
  double min_rate = 500.0;  // bytes per second
  std::chrono::milliseconds rate_grace{5'000};
  // Slow readers: every byte written must be taken by the client (acknowledged by its TCP)
  // within send_timeout of being written, else the write fails and the connection closes, so a
  // stream to a client that reads slowly but steadily cannot run on without bound. 0: none.
  std::chrono::milliseconds send_timeout{30'000};
};

// What the connection is reading, and why its last read or write failed.
enum class ReadPhase { kIdle, kHeaders, kBody };
enum class ReadFailure { kNone, kTimeout, kTooSlow, kTooLarge, kClosed };
enum class WriteFailure { kNone, kSendTimeout, kClosed };

// The connection this pool thread is serving. cpp-httplib gives handlers no handle on their
// connection, and serves each connection from start to end on one pool thread, so handlers find
// it here (null outside HttpServer's connection loop).
class ConnectionState {
 public:
  static ConnectionState* current();
  virtual ~ConnectionState() = default;

  ReadPhase phase() const { return phase_; }
  ReadFailure read_failure() const { return read_failure_; }
  WriteFailure write_failure() const { return write_failure_; }
  // The bytes the current read phase took and the seconds it lasted (for kTooSlow's message).
  size_t phase_bytes() const { return phase_bytes_; }
  double phase_seconds() const { return phase_seconds_; }
  // The request was answered before its body was read to the end (or its framing is in doubt):
  // what follows on the connection is not a request. Adds `Connection: close` to `res`.
  void close_after(httplib::Response& res);
  bool closing() const { return closing_; }
  // The client closed its side (or reset) while its answer is not yet written, as is_writable()
  // finds it for a stream: for a request that writes nothing until its end. A client that
  // pipelined its next request is still there.
  virtual bool client_left() const = 0;

 protected:
  ReadPhase phase_ = ReadPhase::kIdle;
  ReadFailure read_failure_ = ReadFailure::kNone;
  mutable WriteFailure write_failure_ = WriteFailure::kNone;  // set by const is_writable()
  size_t phase_bytes_ = 0;
  double phase_seconds_ = 0.0;
  bool closing_ = false;
};

// Why the phase `connection` is in took too long (kTimeout or kTooSlow), for a 408's message:
// "the request body did not arrive within 60 s", "the request line and headers arrived slower
// than 500 bytes/s after a 5 s grace (12 bytes in 5.2 s)".
std::string read_timeout_message(const ConnectionState& connection, const HttpLimits& limits);

class HttpServer : public httplib::Server {
 public:
  explicit HttpServer(const HttpLimits& limits) : limits_(limits) {}
  const HttpLimits& limits() const { return limits_; }
  // cpp-httplib listens with a backlog of 5, a compile-time constant of the packaged library; a
  // burst of clients (64 connecting at once) overflows it. Linux takes a second listen() on the
  // bound socket as the new backlog.
  bool widen_backlog(int backlog);
  // The body of the answer to a request refused before cpp-httplib got its request line (too
  // slow, or too long): (status, message) -> body, and the place to count it.
  using ErrorBody = std::function<std::string(int status, const std::string& message)>;
  void set_error_body(ErrorBody error_body) { error_body_ = std::move(error_body); }
  // Told of each connection closed for a slow client: the reason ("header_rate" for a request
  // line under the minimum rate, "send_timeout" for a client that took nothing of what was
  // written for send_timeout) and the client's address:port.
  using SlowClient = std::function<void(const char* reason, const std::string& client)>;
  void set_slow_client(SlowClient slow_client) { slow_client_ = std::move(slow_client); }

 private:
  bool process_and_close_socket(socket_t sock) override;

  HttpLimits limits_;
  ErrorBody error_body_;
  SlowClient slow_client_;
};

// A request body read to its end, or why not.
struct BodyRead {
  bool ok = true;
  int status = 200;       // 400, 408, 413 or 415 when !ok
  std::string message;    // for the client when !ok
  bool too_slow = false;  // 408 under the minimum rate
};

// Reads the body of `req` through `reader` into `body`, at most max_body_bytes: a Content-Length
// over the limit is refused before reading, a chunked body as soon as it passes the limit. A
// request with neither Content-Length nor Transfer-Encoding has an empty body (RFC 9112 6.3),
// not one that runs to the end of the connection. When !ok, the connection closes after the
// answer.
BodyRead read_body(const httplib::Request& req, httplib::Response& res,
                   const httplib::ContentReader& reader, const HttpLimits& limits,
                   std::string* body);

}  // namespace moeinfer::server

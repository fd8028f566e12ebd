// How `moeinfer serve` reads HTTP connections, on top of cpp-httplib.
//
// The packaged cpp-httplib (0.11) serves a connection with a fresh stream per request, so the
// bytes of pipelined requests it had already buffered behind the first are lost; its read timeout
// is per recv(), so a client sending a byte a second holds a pool thread for as long as it likes;
// and it bounds neither the total size of the headers nor a chunked body. HttpServer replaces its
// per-connection loop: one buffered stream per connection (pipelined requests are answered in
// order), a deadline and a byte budget for each read phase (the request line and headers, then
// the body), and a lingering close when a request was answered before its body was read, so the
// client gets the answer rather than a reset.
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
};

// What the connection is reading, and why its last read failed.
enum class ReadPhase { kIdle, kHeaders, kBody };
enum class ReadFailure { kNone, kTimeout, kTooLarge, kClosed };

// The connection this pool thread is serving. cpp-httplib gives handlers no handle on their
// connection, and serves each connection from start to end on one pool thread, so handlers find
// it here (null outside HttpServer's connection loop).
class ConnectionState {
 public:
  static ConnectionState* current();

  ReadPhase phase() const { return phase_; }
  ReadFailure read_failure() const { return read_failure_; }
  // The request was answered before its body was read to the end (or its framing is in doubt):
  // what follows on the connection is not a request. Adds `Connection: close` to `res`.
  void close_after(httplib::Response& res);
  bool closing() const { return closing_; }

 protected:
  ReadPhase phase_ = ReadPhase::kIdle;
  ReadFailure read_failure_ = ReadFailure::kNone;
  bool closing_ = false;
};

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

 private:
  bool process_and_close_socket(socket_t sock) override;

  HttpLimits limits_;
  ErrorBody error_body_;
};

// A request body read to its end, or why not.
struct BodyRead {
  bool ok = true;
  int status = 200;     // 400, 408 or 413 when !ok
  std::string message;  // for the client when !ok
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

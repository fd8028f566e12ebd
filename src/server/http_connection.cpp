#if MOE_HAVE_HTTPLIB  // without cpp-httplib the server is left out (see src/CMakeLists.txt)

#include "server/http_connection.h"

#include <netdb.h>
#include <poll.h>
#include <strings.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <vector>

namespace moeinfer::server {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

thread_local ConnectionState* t_current = nullptr;

// A blocking wait looks this often whether the server is stopping, so stop() is not held up.
constexpr milliseconds kPollSlice{100};
// A lingering close reads and discards what the client still sends for at most this long.
constexpr milliseconds kLingerTime{2000};

int poll_one(socket_t sock, short events, milliseconds timeout) {
  pollfd fd{.fd = sock, .events = events, .revents = 0};
  int r = 0;
  do {
    r = ::poll(&fd, 1, static_cast<int>(timeout.count()));
  } while (r < 0 && errno == EINTR);
  return r;
}

milliseconds until(Clock::time_point deadline) {
  return std::chrono::ceil<milliseconds>(deadline - Clock::now());
}

void numeric_address(const sockaddr_storage& addr, socklen_t len, std::string& ip, int& port) {
  char host[NI_MAXHOST];
  char service[NI_MAXSERV];
  if (::getnameinfo(reinterpret_cast<const sockaddr*>(&addr), len, host, sizeof(host), service,
                    sizeof(service), NI_NUMERICHOST | NI_NUMERICSERV) == 0) {
    ip = host;
    port = std::atoi(service);
  }
}

// One connection: a buffered socket stream that lives as long as the connection (bytes of the
// next pipelined request stay in its buffer), with a deadline and a byte budget per read phase.
class Connection final : public httplib::Stream, public ConnectionState {
 public:
  Connection(socket_t sock, const std::atomic<socket_t>& listener, milliseconds write_timeout)
      : sock_(sock), listener_(listener), write_timeout_(write_timeout) {
    t_current = this;
  }
  ~Connection() override { t_current = nullptr; }
  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;

  // Waits for the first byte of the next request; false when the connection stayed idle for
  // `idle`, the client left, or the server is stopping.
  bool wait_for_request(milliseconds idle) {
    if (pos_ < end_) return true;  // a pipelined request is already here
    const auto deadline = Clock::now() + idle;
    while (!stopping()) {
      const milliseconds left = until(deadline);
      if (left.count() <= 0) return false;
      const int r = poll_one(sock_, POLLIN, std::min(left, kPollSlice));
      if (r != 0) return r > 0;
    }
    return false;
  }

  void mark_closing() { closing_ = true; }

  // Reads from now on must be done within `timeout` and take at most `max_bytes`.
  void begin_phase(ReadPhase phase, milliseconds timeout, size_t max_bytes) {
    phase_ = phase;
    if (phase == ReadPhase::kHeaders) answered_ = false;
    deadline_ = Clock::now() + timeout;
    budget_ = max_bytes;
    read_failure_ = ReadFailure::kNone;
  }

  // A request answered before its body was read leaves the body coming: the client is still
  // sending it and a plain close() would answer that with a reset, which on most stacks discards
  // our answer before the client reads it. So stop writing, and drain for a while first.
  void close() {
    if (closing_) linger();
    ::shutdown(sock_, SHUT_RDWR);
    ::close(sock_);
  }

  bool is_readable() const override {
    return pos_ < end_ || poll_one(sock_, POLLIN, milliseconds(0)) > 0;
  }

  bool is_writable() const override {
    if (poll_one(sock_, POLLOUT, write_timeout_) <= 0) return false;
    // A client that has left reads as readable with nothing to peek (or an error).
    if (poll_one(sock_, POLLIN, milliseconds(0)) <= 0) return true;
    char byte = 0;
    return ::recv(sock_, &byte, 1, MSG_PEEK | MSG_DONTWAIT) > 0;
  }

  ssize_t read(char* ptr, size_t size) override {
    if (budget_ == 0) {
      read_failure_ = ReadFailure::kTooLarge;
      return -1;
    }
    if (pos_ == end_) {
      if (!wait_readable()) return -1;
      ssize_t n = 0;
      do {
        n = ::recv(sock_, buffer_.data(), buffer_.size(), 0);
      } while (n < 0 && errno == EINTR);
      if (n <= 0) {
        read_failure_ = ReadFailure::kClosed;
        return n;
      }
      pos_ = 0;
      end_ = static_cast<size_t>(n);
    }
    const size_t n = std::min({size, end_ - pos_, budget_});
    std::memcpy(ptr, buffer_.data() + pos_, n);
    pos_ += n;
    budget_ -= n;
    return static_cast<ssize_t>(n);
  }

  ssize_t write(const char* ptr, size_t size) override {
    if (!is_writable()) return -1;
    ssize_t n = 0;
    do {
      n = ::send(sock_, ptr, size, MSG_NOSIGNAL);
    } while (n < 0 && errno == EINTR);
    if (n > 0) answered_ = true;
    return n;
  }

  // Something of an answer to the current request was written.
  bool answered() const { return answered_; }

  void get_remote_ip_and_port(std::string& ip, int& port) const override {
    sockaddr_storage addr{};
    socklen_t len = sizeof(addr);
    if (::getpeername(sock_, reinterpret_cast<sockaddr*>(&addr), &len) == 0)
      numeric_address(addr, len, ip, port);
  }
  void get_local_ip_and_port(std::string& ip, int& port) const override {
    sockaddr_storage addr{};
    socklen_t len = sizeof(addr);
    if (::getsockname(sock_, reinterpret_cast<sockaddr*>(&addr), &len) == 0)
      numeric_address(addr, len, ip, port);
  }
  socket_t socket() const override { return sock_; }

 private:
  bool stopping() const { return listener_ == INVALID_SOCKET; }

  // Until the phase's deadline, not per recv(): a byte a second does not keep a read alive.
  bool wait_readable() {
    while (true) {
      const milliseconds left = until(deadline_);
      if (left.count() <= 0) {
        read_failure_ = ReadFailure::kTimeout;
        return false;
      }
      if (stopping()) {
        read_failure_ = ReadFailure::kClosed;
        return false;
      }
      const int r = poll_one(sock_, POLLIN, std::min(left, kPollSlice));
      if (r > 0) return true;
      if (r < 0) {
        read_failure_ = ReadFailure::kClosed;
        return false;
      }
    }
  }

  void linger() {
    ::shutdown(sock_, SHUT_WR);
    const auto deadline = Clock::now() + kLingerTime;
    char sink[16384];
    while (!stopping()) {
      const milliseconds left = until(deadline);
      if (left.count() <= 0) return;
      const int r = poll_one(sock_, POLLIN, std::min(left, kPollSlice));
      if (r < 0) return;
      if (r > 0 && ::recv(sock_, sink, sizeof(sink), 0) <= 0) return;
    }
  }

  socket_t sock_;
  const std::atomic<socket_t>& listener_;  // INVALID_SOCKET once the server stops
  milliseconds write_timeout_;
  Clock::time_point deadline_ = Clock::now();
  size_t budget_ = 0;  // bytes the current phase may still read
  bool answered_ = false;
  std::vector<char> buffer_ = std::vector<char>(4096);
  size_t pos_ = 0;  // [pos_, end_): received, not yet read
  size_t end_ = 0;
};

// Parses a Content-Length value: digits only (no sign, no list of values).
bool parse_length(const std::string& text, uint64_t* length) {
  if (text.empty() || text.size() > 19) return false;
  uint64_t value = 0;
  for (char c : text) {
    if (c < '0' || c > '9') return false;
    value = value * 10 + static_cast<uint64_t>(c - '0');
  }
  *length = value;
  return true;
}

std::string mib(size_t bytes) { return std::to_string(bytes >> 20) + " MiB"; }

std::string seconds_text(milliseconds ms) {
  char text[32];
  std::snprintf(text, sizeof(text), "%g s", static_cast<double>(ms.count()) / 1000.0);
  return text;
}

// cpp-httplib closes without a word when the request line does not arrive whole; a slow or
// endless request line gets its 408 / 431 here instead.
void refuse_request_line(Connection& connection, const HttpLimits& limits,
                         const HttpServer::ErrorBody& error_body) {
  const bool slow = connection.read_failure() == ReadFailure::kTimeout;
  const int status = slow ? 408 : 431;
  const std::string message =
      slow ? "the request line did not arrive within " + seconds_text(limits.header_timeout)
           : "the request line is longer than " + std::to_string(limits.max_header_bytes >> 10) +
                 " KiB";
  const std::string body = error_body ? error_body(status, message) : message;
  const std::string answer =
      "HTTP/1.1 " + std::to_string(status) +
      (slow ? " Request Timeout" : " Request Header Fields Too Large") +
      "\r\nContent-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) +
      "\r\nConnection: close\r\n\r\n" + body;
  for (size_t sent = 0; sent < answer.size();) {
    const ssize_t n = connection.write(answer.data() + sent, answer.size() - sent);
    if (n <= 0) return;
    sent += static_cast<size_t>(n);
  }
}

}  // namespace

ConnectionState* ConnectionState::current() { return t_current; }

void ConnectionState::close_after(httplib::Response& res) {
  if (!closing_) res.set_header("Connection", "close");
  closing_ = true;
}

bool HttpServer::widen_backlog(int backlog) { return ::listen(svr_sock_, backlog) == 0; }

bool HttpServer::process_and_close_socket(socket_t sock) {
  const milliseconds write_timeout = std::chrono::duration_cast<milliseconds>(
      std::chrono::seconds(write_timeout_sec_) + std::chrono::microseconds(write_timeout_usec_));
  Connection connection(sock, svr_sock_, write_timeout);
  // Chunk framing comes on top of the body: let through as much again (1-byte chunks, 5 bytes of
  // framing each, are refused early; nobody sends those). read_body counts the body itself.
  const size_t body_budget = 2 * limits_.max_body_bytes;
  bool ok = false;
  for (size_t served = 0; served < keep_alive_max_count_; ++served) {
    // Idle between requests: cpp-httplib's keep-alive timeout, as its Keep-Alive header says.
    if (!connection.wait_for_request(std::chrono::seconds(keep_alive_timeout_sec_))) break;
    connection.begin_phase(ReadPhase::kHeaders, limits_.header_timeout, limits_.max_header_bytes);
    bool client_closes = false;
    ok = process_request(
        connection, served + 1 == keep_alive_max_count_, client_closes, [&](httplib::Request&) {
          connection.begin_phase(ReadPhase::kBody, limits_.body_timeout, body_budget);
        });
    const bool refused = connection.phase() == ReadPhase::kHeaders &&
                         (connection.read_failure() == ReadFailure::kTimeout ||
                          connection.read_failure() == ReadFailure::kTooLarge);
    if (!ok && refused && !connection.answered()) {
      refuse_request_line(connection, limits_, error_body_);
      connection.mark_closing();
    }
    if (!ok || client_closes || connection.closing()) break;
  }
  connection.close();
  return ok;
}

BodyRead read_body(const httplib::Request& req, httplib::Response& res,
                   const httplib::ContentReader& reader, const HttpLimits& limits,
                   std::string* body) {
  ConnectionState* connection = ConnectionState::current();
  const auto refuse = [&](int status, std::string message) {
    if (connection != nullptr) connection->close_after(res);
    return BodyRead{.ok = false, .status = status, .message = std::move(message)};
  };
  const std::string too_large = "the request body is larger than " + mib(limits.max_body_bytes);
  const std::string encoding = req.get_header_value("Transfer-Encoding");
  const bool chunked = strcasecmp(encoding.c_str(), "chunked") == 0;
  const bool has_length = req.has_header("Content-Length");
  if (!encoding.empty() && !chunked)
    return refuse(400, "Transfer-Encoding '" + encoding + "' is not supported (only chunked)");
  // Two framings at once is how requests are smuggled past proxies (RFC 9112 6.3).
  if (chunked && has_length)
    return refuse(400, "a request with both Content-Length and Transfer-Encoding");
  if (!chunked) {
    if (!has_length) return {};
    uint64_t length = 0;
    if (req.get_header_value_count("Content-Length") != 1 ||
        !parse_length(req.get_header_value("Content-Length"), &length)) {
      return refuse(400, "a malformed Content-Length");
    }
    if (length > limits.max_body_bytes) return refuse(413, too_large);
    if (length == 0) return {};
  }
  bool over = false;
  const bool complete = reader([&](const char* data, size_t n) {
    if (n > limits.max_body_bytes - body->size()) {
      over = true;  // stop here: the rest is never read
      return false;
    }
    body->append(data, n);
    return true;
  });
  if (complete) return {};
  const ReadFailure failure = connection ? connection->read_failure() : ReadFailure::kNone;
  if (over || failure == ReadFailure::kTooLarge) return refuse(413, too_large);
  if (failure == ReadFailure::kTimeout) {
    return refuse(408,
                  "the request body did not arrive within " + seconds_text(limits.body_timeout));
  }
  if (res.status == 415) return refuse(415, "the request body's Content-Encoding is not supported");
  return refuse(400, "the request body ended early or its chunked framing is malformed");
}

}  // namespace moeinfer::server

#endif  // MOE_HAVE_HTTPLIB

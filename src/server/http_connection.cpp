#if MOE_HAVE_HTTPLIB  // without cpp-httplib the server is left out (see src/CMakeLists.txt)

#include "server/http_connection.h"

#include <linux/sockios.h>
#include <netdb.h>
#include <poll.h>
#include <strings.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <deque>
#include <string_view>
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
  Connection(socket_t sock, const std::atomic<socket_t>& listener, milliseconds write_timeout,
             const HttpLimits& limits)
      : sock_(sock), listener_(listener), write_timeout_(write_timeout), limits_(limits) {
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
    phase_start_ = Clock::now();
    deadline_ = phase_start_ + timeout;
    budget_ = max_bytes;
    phase_budget_ = max_bytes;
    phase_bytes_ = 0;
    phase_seconds_ = 0.0;
    read_failure_ = ReadFailure::kNone;
  }

  // A request answered before its body was read leaves the body coming: the client is still
  // sending it and a plain close() would answer that with a reset, which on most stacks discards
  // our answer before the client reads it. So stop writing, and drain for a while first.
  void close() {
    if (write_failure_ == WriteFailure::kSendTimeout) {
      // A client too slow to take what was written: drop the rest of the send queue and reset
      // the connection, rather than leave the kernel trickling it out after the close.
      const struct ::linger reset{.l_onoff = 1, .l_linger = 0};
      ::setsockopt(sock_, SOL_SOCKET, SO_LINGER, &reset, sizeof(reset));
      ::close(sock_);
      return;
    }
    if (closing_) linger();
    ::shutdown(sock_, SHUT_RDWR);
    ::close(sock_);
  }

  bool is_readable() const override {
    return pos_ < end_ || poll_one(sock_, POLLIN, milliseconds(0)) > 0;
  }

  bool client_left() const override {
    if (pos_ < end_) return false;  // a pipelined request is waiting: the client is there
    if (poll_one(sock_, POLLIN, milliseconds(0)) <= 0) return false;
    char byte = 0;
    return ::recv(sock_, &byte, 1, MSG_PEEK | MSG_DONTWAIT) <= 0;
  }

  bool is_writable() const override {
    if (!wait_writable()) return false;
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
    phase_bytes_ = phase_budget_ - budget_;
    return static_cast<ssize_t>(n);
  }

  ssize_t write(const char* ptr, size_t size) override {
    while (true) {
      if (!wait_writable()) return -1;
      ssize_t n = 0;
      do {
        n = ::send(sock_, ptr, size, MSG_NOSIGNAL | MSG_DONTWAIT);
      } while (n < 0 && errno == EINTR);
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) continue;  // room went meanwhile
      if (n <= 0) {
        write_failure_ = WriteFailure::kClosed;
        return n;
      }
      answered_ = true;
      note_written(static_cast<size_t>(n));
      return n;
    }
  }

  // Something of an answer to the current request was written.
  bool answered() const { return answered_; }

  std::string client() const {
    std::string ip;
    int port = 0;
    get_remote_ip_and_port(ip, port);
    return ip + ":" + std::to_string(port);
  }

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

  // The phase's bytes must have come at min_rate since the grace period: the moment the next
  // byte is due (mod_reqtimeout's rule: grace + bytes / rate).
  Clock::time_point rate_deadline() const {
    if (limits_.min_rate <= 0) return Clock::time_point::max();
    const auto allowance = std::chrono::duration_cast<Clock::duration>(
        std::chrono::duration<double>(static_cast<double>(phase_bytes_) / limits_.min_rate));
    return phase_start_ + limits_.rate_grace + allowance;
  }

  // Until the phase's deadline, not per recv(): a byte a second does not keep a read alive.
  bool wait_readable() {
    while (true) {
      const Clock::time_point due = rate_deadline();
      const milliseconds left = until(std::min(deadline_, due));
      if (left.count() <= 0) {
        read_failure_ = due < deadline_ ? ReadFailure::kTooSlow : ReadFailure::kTimeout;
        phase_seconds_ = std::chrono::duration<double>(Clock::now() - phase_start_).count();
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

  // Bytes handed to the kernel, with when: the client has taken those the socket's send queue
  // no longer holds (SIOCOUTQ: written and not yet acknowledged).
  void note_written(size_t n) {
    written_ += n;
    const Clock::time_point now = Clock::now();
    // Writes within one poll slice share a mark (the earliest time: a little strict, never lax).
    if (!unacked_.empty() && now - unacked_.back().at < kPollSlice) {
      unacked_.back().end = written_;
    } else {
      unacked_.push_back({.end = written_, .at = now});
    }
  }

  // The oldest byte the client has not taken was written more than send_timeout ago.
  bool taken_too_late() const {
    if (limits_.send_timeout.count() <= 0 || unacked_.empty()) return false;
    int queued = 0;
    if (::ioctl(sock_, SIOCOUTQ, &queued) != 0) return false;
    const uint64_t taken = written_ - static_cast<uint64_t>(std::max(queued, 0));
    while (!unacked_.empty() && unacked_.front().end <= taken) unacked_.pop_front();
    return !unacked_.empty() && Clock::now() - unacked_.front().at > limits_.send_timeout;
  }

  // Room to write within write_timeout_, while the client keeps taking what was written.
  bool wait_writable() const {
    const auto give_up = Clock::now() + write_timeout_;
    while (true) {
      if (taken_too_late()) {
        write_failure_ = WriteFailure::kSendTimeout;
        return false;
      }
      const milliseconds left = until(give_up);
      if (left.count() <= 0 || stopping()) return false;
      const int r = poll_one(sock_, POLLOUT, std::min(left, kPollSlice));
      if (r > 0) return true;
      if (r < 0) return false;
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

  struct Written {
    uint64_t end;  // bytes written up to the end of this mark
    Clock::time_point at;
  };

  socket_t sock_;
  const std::atomic<socket_t>& listener_;  // INVALID_SOCKET once the server stops
  milliseconds write_timeout_;
  const HttpLimits& limits_;
  Clock::time_point phase_start_ = Clock::now();
  Clock::time_point deadline_ = Clock::now();
  size_t budget_ = 0;                    // bytes the current phase may still read
  size_t phase_budget_ = 0;              // ... and could at its start
  uint64_t written_ = 0;                 // bytes handed to send() on this connection
  mutable std::deque<Written> unacked_;  // marks of bytes the client may not have taken yet
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
  const bool slow = connection.read_failure() == ReadFailure::kTimeout ||
                    connection.read_failure() == ReadFailure::kTooSlow;
  const int status = slow ? 408 : 431;
  const std::string message = slow ? read_timeout_message(connection, limits)
                                   : "the request line is longer than " +
                                         std::to_string(limits.max_header_bytes >> 10) + " KiB";
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

// RFC 9112 3.2.2: a server must accept a request target in absolute form, as a client
// configured to use this server as its proxy sends it ("POST http://host/v1/completions"): route
// on its path, and take its authority as the Host (3.2.3: the Host header is then ignored).
void accept_absolute_form(httplib::Request& req) {
  for (const std::string_view scheme : {"http://", "https://"}) {
    if (req.path.size() <= scheme.size() ||
        strncasecmp(req.path.c_str(), scheme.data(), scheme.size()) != 0) {
      continue;
    }
    const size_t slash = req.path.find('/', scheme.size());
    const std::string authority = req.path.substr(scheme.size(), slash - scheme.size());
    req.path = slash == std::string::npos ? "/" : req.path.substr(slash);
    req.headers.erase("Host");
    req.set_header("Host", authority);
    return;
  }
}

}  // namespace

ConnectionState* ConnectionState::current() { return t_current; }

std::string read_timeout_message(const ConnectionState& connection, const HttpLimits& limits) {
  const bool body = connection.phase() == ReadPhase::kBody;
  const std::string what = body ? "the request body" : "the request line and headers";
  if (connection.read_failure() == ReadFailure::kTooSlow) {
    char figures[96];
    std::snprintf(figures, sizeof(figures), " (%zu bytes in %.1f s)", connection.phase_bytes(),
                  connection.phase_seconds());
    char rate[32];
    std::snprintf(rate, sizeof(rate), "%g", limits.min_rate);
    return what + " arrived slower than " + rate + " bytes/s after a " +
           seconds_text(limits.rate_grace) + " grace" + figures;
  }
  return what + " did not arrive within " +
         seconds_text(body ? limits.body_timeout : limits.header_timeout);
}

void ConnectionState::close_after(httplib::Response& res) {
  if (!closing_) res.set_header("Connection", "close");
  closing_ = true;
}

bool HttpServer::widen_backlog(int backlog) { return ::listen(svr_sock_, backlog) == 0; }

bool HttpServer::process_and_close_socket(socket_t sock) {
  const milliseconds write_timeout = std::chrono::duration_cast<milliseconds>(
      std::chrono::seconds(write_timeout_sec_) + std::chrono::microseconds(write_timeout_usec_));
  Connection connection(sock, svr_sock_, write_timeout, limits_);
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
        connection, served + 1 == keep_alive_max_count_, client_closes, [&](httplib::Request& req) {
          accept_absolute_form(req);
          connection.begin_phase(ReadPhase::kBody, limits_.body_timeout, body_budget);
        });
    const bool refused = connection.phase() == ReadPhase::kHeaders &&
                         (connection.read_failure() == ReadFailure::kTimeout ||
                          connection.read_failure() == ReadFailure::kTooSlow ||
                          connection.read_failure() == ReadFailure::kTooLarge);
    if (!ok && refused && !connection.answered()) {
      refuse_request_line(connection, limits_, error_body_);
      connection.mark_closing();
      if (connection.read_failure() == ReadFailure::kTooSlow && slow_client_)
        slow_client_("header_rate", connection.client());
    }
    if (connection.write_failure() == WriteFailure::kSendTimeout) {
      if (slow_client_) slow_client_("send_timeout", connection.client());
      break;
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
  // cpp-httplib hands a multipart body to a multipart reader, which our routes do not give it
  // (it threw bad_function_call, a 500): the API takes JSON.
  if (req.is_multipart_form_data()) {
    return refuse(415,
                  "a multipart/form-data body is not supported: send the request as JSON "
                  "(Content-Type: application/json)");
  }
  // cpp-httplib decodes gzip, deflate and br, spelled so, and takes any other coding for none,
  // which would parse a compressed body as JSON: refuse it instead (RFC 9110 8.4.1).
  const std::string coding = req.get_header_value("Content-Encoding");
  if (req.get_header_value_count("Content-Encoding") > 1 ||
      (!coding.empty() && coding != "gzip" && coding != "deflate" && coding != "br" &&
       coding != "identity")) {
    return refuse(415, "Content-Encoding '" + coding +
                           "' is not supported: send one of gzip, deflate, br or identity, in "
                           "lower case");
  }
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
  if (failure == ReadFailure::kTimeout || failure == ReadFailure::kTooSlow) {
    BodyRead slow = refuse(408, read_timeout_message(*connection, limits));
    slow.too_slow = failure == ReadFailure::kTooSlow;
    return slow;
  }
  if (res.status == 415) return refuse(415, "the request body's Content-Encoding is not supported");
  return refuse(400, "the request body ended early or its chunked framing is malformed");
}

}  // namespace moeinfer::server

#endif  // MOE_HAVE_HTTPLIB

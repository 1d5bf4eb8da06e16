// keel_loadgen: a small HTTP/1.1 load generator for the gateway benchmark
// (scripts/bench-gateway). One thread, epoll, kept-alive connections.
//
// Why not wrk or h2load alone: wrk is closed-loop (a slow answer delays the
// next request, so slowness hides), and h2load's --rate starts connections
// at a rate, not requests. Open loop here means request i is due at
// start + i / rate whatever came back before, and its latency is measured
// from when it was due (a request waiting for a free connection is late,
// and that lateness counts). Connections are bounded (--max-conns); a
// request that finds none free waits in a queue, still on its own clock.
//
//   keel_loadgen --url http://127.0.0.1:8080/v1/chat/completions --body FILE
//                [-H 'Name: value']... (--rate R --duration S | --concurrency C --requests N)
//                [--max-conns N] [--stream] [--leave-after-tokens K] [--drain S]
//                [--timeout S] [--detail]
//
// --stream: the answer is server-sent events; the time to the first content
// token (a "content" field with a non-empty string) is measured beside the
// total. --leave-after-tokens K: close the connection after K content
// tokens, and print when (unix ms): the fault table's "client leaves".
//
// Prints one JSON object: counts by status, errors, latency percentiles in
// ms (total, and ttft with --stream), the rate achieved. --timeout S fails a
// request (and closes its connection) S seconds after it was due: what a
// client with that timeout sees. --detail adds each request's status, time,
// tokens and whether its stream ended with [DONE] (the fault table reads it).
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

namespace {

using clock_type = std::chrono::steady_clock;
using time_point = clock_type::time_point;

[[noreturn]] void die(const std::string& m) {
  std::fprintf(stderr, "keel_loadgen: %s\n", m.c_str());
  std::exit(2);
}

double ms_between(time_point a, time_point b) { return std::chrono::duration<double, std::milli>(b - a).count(); }

std::int64_t unix_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

struct options {
  std::string host = "127.0.0.1", path = "/";
  int port = 80;
  std::string body;
  std::vector<std::string> headers;
  double rate = 0;         // open loop when > 0
  double duration = 0;     // seconds of arrivals (open loop)
  int concurrency = 0;     // closed loop when > 0
  long requests = 0;       // closed loop: total requests
  int max_conns = 512;
  bool stream = false;
  int leave_after = 0;     // close after this many content tokens (0: never)
  double drain = 10;       // seconds to wait for answers after the last arrival
  double timeout = 0;      // a request's own limit, from when it was due (0: none)
  bool detail = false;     // print every request
};

// One request's life.
struct request {
  time_point due{}, first_token{}, done{};
  bool have_first = false;
  int status = 0;
  bool failed = false;
  int retries = 0;
  int tokens = 0;
  bool done_marker = false;  // the stream's "data: [DONE]"
  std::string why;           // how it failed
};

// One connection: writes a request, parses one response, then is idle again.
struct connection {
  int fd = -1;
  bool connected = false;
  bool reused = false;   // has answered a request before (a stale keep-alive may be closed under us)
  request* cur = nullptr;
  std::string out;
  std::size_t out_at = 0;
  std::string in;
  // Response parsing.
  bool head_done = false, chunked = false, until_close = false;
  long long content_left = 0;
  std::string body_seen;  // decoded body bytes not yet scanned for tokens (stream mode)
  int tokens = 0;
  bool close_after = false;
  long long chunk_left = -1;  // chunked: bytes left in this chunk's data (+2 for CRLF); -1: expecting a size line
  void reset_parse() {
    head_done = chunked = until_close = close_after = false;
    content_left = 0;
    chunk_left = -1;
    body_seen.clear();
    tokens = 0;
  }
};

class loadgen {
 public:
  explicit loadgen(options o) : o_(std::move(o)) {
    ep_ = epoll_create1(0);
    if (ep_ < 0) die("epoll_create1 failed");
    std::ostringstream r;
    r << "POST " << o_.path << " HTTP/1.1\r\nHost: " << o_.host << ":" << o_.port
      << "\r\nContent-Type: application/json\r\nContent-Length: " << o_.body.size() << "\r\n";
    for (const std::string& h : o_.headers) r << h << "\r\n";
    r << "\r\n" << o_.body;
    wire_ = r.str();
  }

  int run() {
    const time_point start = clock_type::now();
    const bool open = o_.rate > 0;
    const long total = open ? static_cast<long>(std::llround(o_.rate * o_.duration)) : o_.requests;
    requests_.resize(static_cast<std::size_t>(std::max<long>(total, 0)));
    long next = 0;  // next request to become due
    time_point last_due = start;
    std::vector<epoll_event> events(256);
    for (;;) {
      const time_point now = clock_type::now();
      if (open) {
        while (next < total) {
          const time_point due = start + std::chrono::duration_cast<clock_type::duration>(
                                             std::chrono::duration<double>(static_cast<double>(next) / o_.rate));
          if (due > now) break;
          requests_[static_cast<std::size_t>(next)].due = due;
          last_due = due;
          dispatch(&requests_[static_cast<std::size_t>(next++)]);
        }
      } else {
        while (next < total && finished_ + in_progress() < total && static_cast<int>(in_progress()) < o_.concurrency) {
          requests_[static_cast<std::size_t>(next)].due = now;
          last_due = now;
          dispatch(&requests_[static_cast<std::size_t>(next++)]);
        }
      }
      if (finished_ >= total) break;
      if (next >= total && now > last_due + std::chrono::duration_cast<clock_type::duration>(
                                                   std::chrono::duration<double>(o_.drain)))
        break;  // the rest never came back: counted as timeouts
      int timeout_ms = 100;
      if (open && next < total) {
        const time_point due = start + std::chrono::duration_cast<clock_type::duration>(
                                           std::chrono::duration<double>(static_cast<double>(next) / o_.rate));
        timeout_ms = due <= now ? 0 : static_cast<int>(std::ceil(ms_between(now, due)));
        timeout_ms = std::min(timeout_ms, 100);
      }
      if (o_.timeout > 0) {
        expire(now);
        timeout_ms = std::min(timeout_ms, 10);
      }
      const int n = epoll_wait(ep_, events.data(), static_cast<int>(events.size()), timeout_ms);
      for (int i = 0; i < n; ++i) on_event(static_cast<connection*>(events[static_cast<std::size_t>(i)].data.ptr),
                                           events[static_cast<std::size_t>(i)].events);
    }
    const time_point end = clock_type::now();
    report(start, end, total, next);
    return 0;
  }

 private:
  [[nodiscard]] long in_progress() const { return started_ - finished_; }

  // Requests past their own timeout fail, and their connections close.
  void expire(time_point now) {
    const auto limit = std::chrono::duration_cast<clock_type::duration>(std::chrono::duration<double>(o_.timeout));
    std::vector<connection*> late;
    for (const auto& c : conns_) {
      if (c->cur != nullptr && now - c->cur->due > limit) late.push_back(c.get());
    }
    for (connection* c : late) {
      c->reused = false;  // no second try: it timed out
      fail(c, "timeout");
    }
    while (!waiting_.empty() && now - waiting_.front()->due > limit) {
      request* r = waiting_.front();
      waiting_.pop_front();
      r->failed = true;
      r->why = "timeout";
      r->done = now;
      ++finished_;
      ++errors_["timeout"];
    }
  }

  void dispatch(request* r) {
    ++started_;
    if (!idle_.empty()) {
      connection* c = idle_.back();
      idle_.pop_back();
      send(c, r);
      return;
    }
    if (static_cast<int>(conns_.size()) < o_.max_conns) {
      connection* c = open_connection();
      if (c != nullptr) {
        send(c, r);
        return;
      }
      // A connect that failed at once (refused): the request fails.
      r->failed = true;
      r->done = clock_type::now();
      ++finished_;
      ++errors_["connect"];
      return;
    }
    waiting_.push_back(r);
  }

  connection* open_connection() {
    const int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) die("socket failed");
    const int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<std::uint16_t>(o_.port));
    if (inet_pton(AF_INET, o_.host.c_str(), &a.sin_addr) != 1) die("--url needs an IPv4 host: " + o_.host);
    if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) < 0 && errno != EINPROGRESS) {
      close(fd);
      return nullptr;
    }
    auto c = std::make_unique<connection>();
    c->fd = fd;
    epoll_event ev{};
    ev.events = EPOLLIN | EPOLLOUT | EPOLLRDHUP;
    ev.data.ptr = c.get();
    epoll_ctl(ep_, EPOLL_CTL_ADD, fd, &ev);
    conns_.push_back(std::move(c));
    return conns_.back().get();
  }

  void send(connection* c, request* r) {
    c->cur = r;
    c->out = wire_;
    c->out_at = 0;
    c->in.clear();
    c->reset_parse();
    if (c->connected) flush(c);
  }

  void flush(connection* c) {
    while (c->out_at < c->out.size()) {
      const ssize_t n = ::send(c->fd, c->out.data() + c->out_at, c->out.size() - c->out_at, MSG_NOSIGNAL);
      if (n < 0) {
        if (errno == EAGAIN) return;
        fail(c, "write");
        return;
      }
      c->out_at += static_cast<std::size_t>(n);
    }
  }

  void on_event(connection* c, std::uint32_t ev) {
    if (c->fd < 0) return;
    if (!c->connected && (ev & (EPOLLOUT | EPOLLERR | EPOLLHUP))) {
      int err = 0;
      socklen_t len = sizeof err;
      getsockopt(c->fd, SOL_SOCKET, SO_ERROR, &err, &len);
      if (err != 0) {
        fail(c, "connect");
        return;
      }
      c->connected = true;
      if (c->cur != nullptr) flush(c);
    }
    if ((ev & EPOLLOUT) && c->cur != nullptr && c->out_at < c->out.size()) flush(c);
    if (ev & (EPOLLIN | EPOLLRDHUP | EPOLLHUP | EPOLLERR)) read_from(c);
  }

  void read_from(connection* c) {
    char buf[65536];
    for (;;) {
      const ssize_t n = ::recv(c->fd, buf, sizeof buf, 0);
      if (n > 0) {
        if (c->cur == nullptr) continue;  // bytes nobody asked for: ignored
        c->in.append(buf, static_cast<std::size_t>(n));
        if (!parse(c)) return;  // the connection was closed or recycled
        continue;
      }
      if (n == 0) {
        // Closed by the server: an answer delimited by the close ends here.
        if (c->cur != nullptr && c->head_done && c->until_close) {
          complete(c, true);
          return;
        }
        if (c->cur != nullptr) fail(c, c->head_done ? "closed_mid_body" : "closed");
        else drop(c);
        return;
      }
      if (errno == EAGAIN) return;
      if (c->cur != nullptr) fail(c, errno == ECONNRESET ? "reset" : "read");
      else drop(c);
      return;
    }
  }

  // Parses what c->in holds; false when c is no longer usable here.
  bool parse(connection* c) {
    if (!c->head_done) {
      const std::size_t end = c->in.find("\r\n\r\n");
      if (end == std::string::npos) return true;
      const std::string head = c->in.substr(0, end);
      c->in.erase(0, end + 4);
      c->head_done = true;
      c->cur->status = std::atoi(head.c_str() + std::min<std::size_t>(9, head.size()));
      std::string lower = head;
      std::transform(lower.begin(), lower.end(), lower.begin(), [](unsigned char ch) { return std::tolower(ch); });
      if (lower.find("\r\ntransfer-encoding: chunked") != std::string::npos) {
        c->chunked = true;
      } else if (std::size_t at = lower.find("\r\ncontent-length:"); at != std::string::npos) {
        c->content_left = std::atoll(lower.c_str() + at + 17);
      } else {
        c->until_close = true;
      }
      if (lower.find("\r\nconnection: close") != std::string::npos) c->close_after = true;
    }
    if (c->chunked) {
      for (;;) {
        if (c->chunk_left < 0) {
          const std::size_t eol = c->in.find("\r\n");
          if (eol == std::string::npos) return true;
          const long long size = std::strtoll(c->in.c_str(), nullptr, 16);
          c->in.erase(0, eol + 2);
          if (size == 0) {
            // Last chunk; trailers are not used by anyone here: the final CRLF.
            const std::size_t t = c->in.find("\r\n");
            if (t == std::string::npos) {
              c->chunk_left = -2;  // wait for the closing CRLF
              return true;
            }
            c->in.erase(0, t + 2);
            return complete(c, false);
          }
          c->chunk_left = size + 2;
        }
        if (c->chunk_left == -2) {
          const std::size_t t = c->in.find("\r\n");
          if (t == std::string::npos) return true;
          c->in.erase(0, t + 2);
          return complete(c, false);
        }
        const std::size_t take = std::min<std::size_t>(c->in.size(), static_cast<std::size_t>(c->chunk_left));
        if (take == 0) return true;
        const std::size_t data = std::min<std::size_t>(take, static_cast<std::size_t>(std::max<long long>(c->chunk_left - 2, 0)));
        if (!body(c, std::string_view(c->in).substr(0, data))) return false;
        c->in.erase(0, take);
        c->chunk_left -= static_cast<long long>(take);
        if (c->chunk_left == 0) c->chunk_left = -1;
      }
    }
    if (c->until_close) {
      if (!body(c, c->in)) return false;
      c->in.clear();
      return true;
    }
    const std::size_t take = std::min<std::size_t>(c->in.size(), static_cast<std::size_t>(c->content_left));
    if (!body(c, std::string_view(c->in).substr(0, take))) return false;
    c->in.erase(0, take);
    c->content_left -= static_cast<long long>(take);
    if (c->content_left == 0) return complete(c, false);
    return true;
  }

  // Body bytes as they come; in stream mode, the content tokens are counted.
  bool body(connection* c, std::string_view data) {
    if (!o_.stream || data.empty()) return true;
    c->body_seen.append(data);
    // Whole events only ("\n\n" ends one).
    std::size_t end;
    while ((end = c->body_seen.find("\n\n")) != std::string::npos) {
      const std::string_view ev(c->body_seen.data(), end);
      if (ev.find("data: [DONE]") != std::string_view::npos) c->cur->done_marker = true;
      if (has_content_token(ev)) {
        ++c->tokens;
        c->cur->tokens = c->tokens;
        if (!c->cur->have_first) {
          c->cur->have_first = true;
          c->cur->first_token = clock_type::now();
        }
        if (o_.leave_after > 0 && c->tokens >= o_.leave_after) {
          left_unix_ms_ = unix_ms();
          c->cur->status = -1;  // left on purpose
          complete(c, true);
          return false;
        }
      }
      c->body_seen.erase(0, end + 2);
    }
    return true;
  }

  static bool has_content_token(std::string_view ev) {
    for (std::string_view key : {std::string_view("\"content\":\""), std::string_view("\"content\": \"")}) {
      std::size_t at = ev.find(key);
      while (at != std::string_view::npos) {
        const std::size_t v = at + key.size();
        if (v < ev.size() && ev[v] != '"') return true;
        at = ev.find(key, v);
      }
    }
    return false;
  }

  // The request is answered; the connection goes back to the pool (or is
  // closed). False: the connection is gone.
  bool complete(connection* c, bool close_it) {
    request* r = c->cur;
    r->done = clock_type::now();
    ++finished_;
    ++status_[r->status];
    c->cur = nullptr;
    c->reused = true;
    if (close_it || c->close_after) {
      drop(c);
      return false;
    }
    if (!waiting_.empty()) {
      request* w = waiting_.front();
      waiting_.pop_front();
      send(c, w);
      return false;  // c->in was reset for the next answer
    }
    idle_.push_back(c);
    return false;
  }

  void fail(connection* c, const char* why) {
    request* r = c->cur;
    c->cur = nullptr;
    const bool retry = r != nullptr && c->reused && !c->head_done && r->retries == 0 && c->in.empty();
    drop(c);
    if (r == nullptr) return;
    if (retry) {
      // A kept-alive connection the server had closed: once more on a fresh one.
      ++r->retries;
      --started_;
      dispatch(r);
      return;
    }
    r->failed = true;
    r->why = why;
    r->done = clock_type::now();
    ++finished_;
    ++errors_[why];
  }

  void drop(connection* c) {
    if (c->fd >= 0) {
      epoll_ctl(ep_, EPOLL_CTL_DEL, c->fd, nullptr);
      close(c->fd);
      c->fd = -1;
    }
    idle_.erase(std::remove(idle_.begin(), idle_.end(), c), idle_.end());
    for (auto it = conns_.begin(); it != conns_.end(); ++it) {
      if (it->get() == c) {
        graveyard_.push_back(std::move(*it));  // events already fetched may still name it
        conns_.erase(it);
        break;
      }
    }
    if (!waiting_.empty() && static_cast<int>(conns_.size()) < o_.max_conns) {
      request* w = waiting_.front();
      waiting_.pop_front();
      --started_;
      dispatch(w);
    }
  }

  static std::string percentiles(std::vector<double> v) {
    if (v.empty()) return "null";
    std::sort(v.begin(), v.end());
    auto at = [&](double q) {
      const std::size_t i = std::min(v.size() - 1, static_cast<std::size_t>(std::ceil(q * static_cast<double>(v.size()))) - (q > 0 ? 1 : 0));
      return v[i];
    };
    double sum = 0;
    for (double x : v) sum += x;
    char buf[256];
    std::snprintf(buf, sizeof buf, R"({"n":%zu,"p50":%.3f,"p90":%.3f,"p99":%.3f,"p999":%.3f,"max":%.3f,"mean":%.3f})",
                  v.size(), at(0.5), at(0.9), at(0.99), at(0.999), v.back(), sum / static_cast<double>(v.size()));
    return buf;
  }

  void report(time_point start, time_point end, long total, long issued) {
    std::vector<double> lat, ttft;
    long ok = 0, timeouts = 0;
    for (long i = 0; i < issued; ++i) {
      const request& r = requests_[static_cast<std::size_t>(i)];
      if (r.done == time_point{}) {
        ++timeouts;
        continue;
      }
      if (r.failed) continue;
      if (r.status >= 200 && r.status < 300) ++ok;
      lat.push_back(ms_between(r.due, r.done));
      if (r.have_first) ttft.push_back(ms_between(r.due, r.first_token));
    }
    std::string statuses = "{";
    for (const auto& [s, n] : status_) statuses += (statuses.size() > 1 ? "," : "") + ("\"" + std::to_string(s) + "\":" + std::to_string(n));
    statuses += "}";
    std::string errs = "{";
    for (const auto& [e, n] : errors_) errs += (errs.size() > 1 ? "," : "") + ("\"" + e + "\":" + std::to_string(n));
    errs += "}";
    const double secs = std::chrono::duration<double>(end - start).count();
    std::string each;
    if (o_.detail) {
      each = ",\"each\":[";
      for (long i = 0; i < issued; ++i) {
        const request& r = requests_[static_cast<std::size_t>(i)];
        char buf[256];
        std::snprintf(buf, sizeof buf, R"(%s{"status":%d,"error":"%s","ms":%.3f,"ttft_ms":%.3f,"tokens":%d,"done":%s})",
                      i > 0 ? "," : "", r.status, r.done == time_point{} ? "unfinished" : r.why.c_str(),
                      r.done == time_point{} ? -1.0 : ms_between(r.due, r.done),
                      r.have_first ? ms_between(r.due, r.first_token) : -1.0, r.tokens, r.done_marker ? "true" : "false");
        each += buf;
      }
      each += "]";
    }
    std::printf(
        R"({"requests":%ld,"issued":%ld,"ok":%ld,"timeouts":%ld,"status":%s,"errors":%s,"seconds":%.3f,"rps":%.1f,"connections_opened":%ld,"latency_ms":%s,"ttft_ms":%s,"left_unix_ms":%lld%s})"
        "\n",
        total, issued, ok, timeouts, statuses.c_str(), errs.c_str(), secs, static_cast<double>(finished_) / secs,
        static_cast<long>(conns_.size() + graveyard_.size()), percentiles(lat).c_str(), percentiles(ttft).c_str(),
        static_cast<long long>(left_unix_ms_), each.c_str());
  }

  options o_;
  int ep_ = -1;
  std::string wire_;
  std::vector<request> requests_;
  std::vector<std::unique_ptr<connection>> conns_, graveyard_;
  std::vector<connection*> idle_;
  std::deque<request*> waiting_;
  long started_ = 0, finished_ = 0;
  std::map<int, long> status_;
  std::map<std::string, long> errors_;
  std::int64_t left_unix_ms_ = 0;
};

void parse_url(const std::string& url, options& o) {
  const std::string scheme = "http://";
  if (url.rfind(scheme, 0) != 0) die("--url must start with http://");
  const std::size_t slash = url.find('/', scheme.size());
  const std::string hostport = url.substr(scheme.size(), slash == std::string::npos ? std::string::npos : slash - scheme.size());
  o.path = slash == std::string::npos ? "/" : url.substr(slash);
  const std::size_t colon = hostport.find(':');
  o.host = hostport.substr(0, colon);
  if (colon != std::string::npos) o.port = std::atoi(hostport.c_str() + colon + 1);
}

}  // namespace

int main(int argc, char** argv) {
  options o;
  bool have_url = false;
  for (int i = 1; i < argc; ++i) {
    const std::string f = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) die(f + " needs a value");
      return argv[++i];
    };
    if (f == "--url") {
      parse_url(value(), o);
      have_url = true;
    } else if (f == "--body") {
      std::ifstream in(value(), std::ios::binary);
      if (!in) die("--body: cannot read the file");
      std::ostringstream s;
      s << in.rdbuf();
      o.body = s.str();
    } else if (f == "-H") {
      o.headers.push_back(value());
    } else if (f == "--rate") {
      o.rate = std::atof(value().c_str());
    } else if (f == "--duration") {
      o.duration = std::atof(value().c_str());
    } else if (f == "--concurrency") {
      o.concurrency = std::atoi(value().c_str());
    } else if (f == "--requests") {
      o.requests = std::atol(value().c_str());
    } else if (f == "--max-conns") {
      o.max_conns = std::atoi(value().c_str());
    } else if (f == "--stream") {
      o.stream = true;
    } else if (f == "--leave-after-tokens") {
      o.leave_after = std::atoi(value().c_str());
      o.stream = true;
    } else if (f == "--drain") {
      o.drain = std::atof(value().c_str());
    } else if (f == "--timeout") {
      o.timeout = std::atof(value().c_str());
    } else if (f == "--detail") {
      o.detail = true;
    } else {
      die("unknown flag " + f);
    }
  }
  if (!have_url) die("--url is required");
  if (o.rate > 0 && o.duration <= 0) die("--rate needs --duration");
  if (o.rate <= 0 && (o.concurrency <= 0 || o.requests <= 0)) die("give --rate R --duration S, or --concurrency C --requests N");
  if (o.max_conns < 1) die("--max-conns must be >= 1");
  return loadgen(std::move(o)).run();
}

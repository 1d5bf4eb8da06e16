// keel_stream_mock: an OpenAI-compatible streaming upstream for thousands
// of concurrent streams on one thread (Boost.Asio), for the gateway's
// many-streams benchmark (scripts/bench-gateway-streams).
//
// examples/mock_upstream is the gateway's test upstream (faults, tool
// calls, every endpoint) and serves each request on a thread of its own, so
// a run of 2,000 streams would measure its thread pool. This one does one
// thing: POST /v1/chat/completions answered as a stream of chat.completion.chunk
// events (the format of OpenAI's streaming API: `data: {json}` lines, a
// final chunk with finish_reason, a usage chunk when stream_options asks
// for it, then `data: [DONE]`), the first content token after
// --first-token-ms, then one every --token-gap-ms, --tokens in all.
// Connections are kept alive (chunked bodies). A request with
// "stream":false gets one chat.completion at once.
//
//   keel_stream_mock --port N [--first-token-ms 20] [--token-gap-ms 10] [--tokens 50]
//
// Prints "keel_stream_mock listening on 127.0.0.1:PORT" once it accepts.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <string_view>

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/write.hpp>

namespace {

namespace net = boost::asio;
using tcp = net::ip::tcp;

struct settings {
  int port = 0;
  std::chrono::milliseconds first_token{20};
  std::chrono::milliseconds gap{10};
  int tokens = 50;
};

std::string chunk(std::string_view payload) {
  char size[32];
  std::snprintf(size, sizeof size, "%zx\r\n", payload.size());
  std::string out(size);
  out.append(payload);
  out += "\r\n";
  return out;
}

class session : public std::enable_shared_from_this<session> {
 public:
  session(tcp::socket s, const settings& o) : socket_(std::move(s)), timer_(socket_.get_executor()), o_(o) {}

  void start() {
    socket_.set_option(tcp::no_delay(true));
    read_head();
  }

 private:
  void read_head() {
    const std::size_t end = in_.find("\r\n\r\n");
    if (end == std::string::npos) {
      read_more([this] { read_head(); });
      return;
    }
    std::size_t length = 0;
    const std::string head = in_.substr(0, end);
    for (std::size_t at = head.find("\r\n"); at != std::string::npos; at = head.find("\r\n", at + 2)) {
      const std::string_view line = std::string_view(head).substr(at + 2, head.find("\r\n", at + 2) - at - 2);
      constexpr std::string_view cl = "content-length:";
      if (line.size() > cl.size()) {
        std::string lower(line.substr(0, cl.size()));
        for (char& c : lower) c = static_cast<char>(c >= 'A' && c <= 'Z' ? c + 32 : c);
        if (lower == cl) length = std::strtoul(std::string(line.substr(cl.size())).c_str(), nullptr, 10);
      }
    }
    in_.erase(0, end + 4);
    read_body(length);
  }

  void read_body(std::size_t length) {
    if (in_.size() < length) {
      read_more([this, length] { read_body(length); });
      return;
    }
    const std::string body = in_.substr(0, length);
    in_.erase(0, length);
    usage_ = body.find("include_usage") != std::string::npos;
    if (body.find("\"stream\":true") == std::string::npos && body.find("\"stream\": true") == std::string::npos) {
      const std::string json =
          R"({"id":"chatcmpl-mock","object":"chat.completion","created":1,"model":"bench","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}})";
      send("HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: " + std::to_string(json.size()) +
               "\r\n\r\n" + json,
           [this] { read_head(); });
      return;
    }
    sent_ = 0;
    send("HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\nTransfer-Encoding: "
         "chunked\r\n\r\n" +
             chunk(R"(data: {"id":"chatcmpl-mock","object":"chat.completion.chunk","created":1,"model":"bench","choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]})"
                   "\n\n"),
         [this] { after(o_.first_token); });
  }

  void after(std::chrono::milliseconds d) {
    timer_.expires_after(d);
    timer_.async_wait([self = shared_from_this()](const boost::system::error_code& ec) {
      if (!ec) self->token();
    });
  }

  void token() {
    if (sent_ < o_.tokens) {
      ++sent_;
      send(chunk(R"(data: {"id":"chatcmpl-mock","object":"chat.completion.chunk","created":1,"model":"bench","choices":[{"index":0,"delta":{"content":"tok )" +
                 std::to_string(sent_) + R"("},"finish_reason":null}]})" + "\n\n"),
           [this] { after(o_.gap); });
      return;
    }
    std::string tail = chunk(
        R"(data: {"id":"chatcmpl-mock","object":"chat.completion.chunk","created":1,"model":"bench","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]})"
        "\n\n");
    if (usage_) {
      tail += chunk(R"(data: {"id":"chatcmpl-mock","object":"chat.completion.chunk","created":1,"model":"bench","choices":[],"usage":{"prompt_tokens":1,"completion_tokens":)" +
                    std::to_string(o_.tokens) + R"(,"total_tokens":)" + std::to_string(o_.tokens + 1) + "}}\n\n");
    }
    tail += chunk("data: [DONE]\n\n");
    tail += "0\r\n\r\n";
    send(std::move(tail), [this] { read_head(); });
  }

  template <class Next>
  void read_more(Next next) {
    socket_.async_read_some(net::buffer(buf_), [self = shared_from_this(), next](const boost::system::error_code& ec,
                                                                                  std::size_t n) {
      if (ec) return;
      self->in_.append(self->buf_, n);
      next();
    });
  }

  template <class Next>
  void send(std::string bytes, Next next) {
    auto b = std::make_shared<std::string>(std::move(bytes));
    net::async_write(socket_, net::buffer(*b),
                     [self = shared_from_this(), b, next](const boost::system::error_code& ec, std::size_t) {
                       if (!ec) next();
                     });
  }

  tcp::socket socket_;
  net::steady_timer timer_;
  const settings& o_;
  std::string in_;
  char buf_[8192];
  int sent_ = 0;
  bool usage_ = false;
};

void accept(tcp::acceptor& a, const settings& o) {
  a.async_accept([&a, &o](const boost::system::error_code& ec, tcp::socket s) {
    if (!ec) std::make_shared<session>(std::move(s), o)->start();
    accept(a, o);
  });
}

}  // namespace

int main(int argc, char** argv) {
  settings o;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string_view f = argv[i];
    const int v = std::atoi(argv[i + 1]);
    if (f == "--port") o.port = v;
    else if (f == "--first-token-ms") o.first_token = std::chrono::milliseconds(v);
    else if (f == "--token-gap-ms") o.gap = std::chrono::milliseconds(v);
    else if (f == "--tokens") o.tokens = v;
    else {
      std::fprintf(stderr, "usage: keel_stream_mock --port N [--first-token-ms MS] [--token-gap-ms MS] [--tokens N]\n");
      return 2;
    }
  }
  net::io_context io(1);
  tcp::acceptor acceptor(io);
  const tcp::endpoint at(net::ip::make_address("127.0.0.1"), static_cast<unsigned short>(o.port));
  acceptor.open(at.protocol());
  acceptor.set_option(tcp::acceptor::reuse_address(true));
  acceptor.bind(at);
  acceptor.listen(4096);
  std::printf("keel_stream_mock listening on 127.0.0.1:%d\n", acceptor.local_endpoint().port());
  std::fflush(stdout);
  accept(acceptor, o);
  io.run();
}

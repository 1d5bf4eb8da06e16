// gateway/config.hpp — the gateway's configuration file: upstreams (model
// servers over HTTP), models (the names clients send, each an ordered list
// of deployments with its budgets, hedge, retry budget, breaker and
// bulkhead class), and client keys with their tenants' quotas. One TOML
// file, read at start and again on SIGHUP (gateway_core::reload); a bad
// file is refused with one line naming the file, line, column, field path
// and rule:
//
//   config.toml:14:13: models.chat-default.deployments[1].upstream: names no upstream 'opnai' (known: local, openai)
//
// Why TOML (toml++) and not YAML: toml++ keeps every key's and value's line
// and column, so every error points at the text to fix; TOML has no
// implicit typing traps (YAML 1.1 reads `no` as false and `1:30` as 90);
// it is the format TensorZero's gateway uses; and toml++ is one header
// (Debian's libtomlplusplus-dev also compiles it into libtomlplusplus.so,
// which the build links: CMake `find_package(tomlplusplus)`).
//
// Secrets never go in the file: an upstream names the environment variable
// that holds its key (api_key_env), and a client is known by the SHA-256 of
// its key (key_sha256; `printf %s "$KEY" | sha256sum`). docs/gateway.md
// ("Configuration file") lists every field, its default and its rule.
//
// Example:
//
//   absl::StatusOr<gateway::gateway_config> cfg = gateway::load_config("/etc/keel/gateway.toml");
//   if (!cfg.ok()) { std::fprintf(stderr, "%s\n", std::string(cfg.status().message()).c_str()); return 2; }
//   const gateway::gateway_options& o = cfg->options;           // validated, as the gateway takes it
//   const gateway::model_route* route = cfg->find_model("chat-default");
//   const gateway::upstream_config* up = cfg->find_upstream(route->deployments[0].upstream);
//   absl::StatusOr<std::string> key = gateway::resolve_api_key(*up);   // "" when none is named
//   const gateway::client_key* who = gateway::find_client(*cfg, presented_bearer_token);
//
// Thread-safety: parse_config and load_config are pure functions of their
// input and the environment (base_url's ${VAR}); a gateway_config is a plain
// value, and find_client / find_model / find_upstream only read it, from any
// thread. resolve_api_key and the ${VAR} expansion call getenv: do not call
// them while another thread calls setenv.
#pragma once

#include <algorithm>
#include <array>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <initializer_list>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include <openssl/crypto.h>
#include <toml++/toml.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gateway_options.hpp"
#include "keel/durable/digest.hpp"
#include "keel/policy/admission.hpp"
#include "keel/policy/circuit_breaker.hpp"
#include "keel/policy/retry_budget.hpp"
#include "text.hpp"
#include "upstream.hpp"

namespace gateway {

using namespace std::chrono_literals;

// A model server the gateway calls over HTTP ([upstreams.<name>]).
struct upstream_config {
  std::string name{};
  // "http(s)://host[:port][/prefix]" after ${VAR} expansion: the server's
  // root; the gateway appends the OpenAI path (/v1/chat/completions).
  std::string base_url{};
  std::string scheme{};     // "http" or "https"
  std::string host{};       // as written; an IPv6 address keeps its brackets
  int port = 0;           // the URL's, or 80 / 443
  std::string base_path{};  // "" or "/prefix", no trailing '/'
  // The NAME of the environment variable holding the API key; "" for none.
  std::string api_key_env{};
  std::vector<std::pair<std::string, std::string>> headers{};  // sent on every request
  int max_connections = 64;         // kept-alive connections to this upstream
  keel::duration connect_timeout = 2s;

  [[nodiscard]] bool tls() const noexcept { return scheme == "https"; }
};

// One place a model is served: an upstream and the model name it knows.
struct deployment {
  std::string upstream{};
  std::string model{};
};

// The first-token hedge: a second attempt on the next deployment when the
// first has shown no token after `delay` (percentile == 0), or after the
// learned `percentile` of recent times to first token (`delay` until enough
// are known, never below `min_delay`).
struct hedge_config {
  keel::duration delay = 400ms;
  double percentile = 0.0;
  keel::duration min_delay = 50ms;
};

// The three bulkhead classes the gateway has (gateway_options' slots).
enum class bulkhead_class : std::uint8_t { interactive, batch, streaming };

[[nodiscard]] inline std::string_view to_string(bulkhead_class c) noexcept {
  switch (c) {
    case bulkhead_class::interactive: return "interactive";
    case bulkhead_class::batch: return "batch";
    case bulkhead_class::streaming: return "streaming";
  }
  return "?";
}

// A model clients name in "model" ([models.<name>]): where it is served,
// primary first, and what a call to it may spend.
struct model_route {
  std::string name{};
  std::string digest{};  // stored with each decision; default "<upstream>/<model>" of the primary
  std::vector<deployment> deployments{};
  keel::duration deadline = 20s;     // the whole call, every deployment and attempt
  keel::duration first_token = 1s;   // per stream attempt
  keel::duration stall = 400ms;      // the longest gap between tokens
  std::optional<keel::duration> whole{};  // one stream attempt, end to end; nullopt: the gateway's (chat.whole)
  int attempts = 2;                  // per deployment, the first included
  std::optional<hedge_config> hedge{};  // nullopt: no hedge
  keel::retry_budget_options retry_budget{.ratio = 0.1, .min_per_second = 5};
  // One breaker per (upstream, model): the gateway copies these and names each.
  keel::circuit_breaker_options breaker{.name = "route",
                                        .window_calls = 40,
                                        .minimum_calls = 10,
                                        .failure_rate_threshold = 0.5,
                                        .open_duration = 5s,
                                        .half_open_probes = 3,
                                        .probe_timeout = 5s};
  bulkhead_class bulkhead = bulkhead_class::interactive;
  std::int64_t token_estimate = 600;  // reserved from the tenant's tokens per request

  // These budgets as the gateway's streaming options, `base` supplying the rest.
  [[nodiscard]] chat_config chat(chat_config base) const {
    base.deadline = deadline;
    base.first_token = first_token;
    base.stall = stall;
    if (whole) base.whole = *whole;
    base.attempts = attempts;
    base.hedge_delay = hedge ? hedge->delay : keel::duration::zero();  // 0: no hedge
    base.hedge_percentile = hedge ? hedge->percentile : 0.0;
    base.hedge_min_delay = hedge ? hedge->min_delay : base.hedge_min_delay;
    return base;
  }
};

// A caller, known by the SHA-256 of its API key ([clients.<name>]).
struct client_key {
  std::string name{};
  keel::digest key_sha256{};
  std::string tenant{};  // whose quotas it spends; default: the client's name
  // The tenant's quotas (requests_per_second -> rate, tokens_per_minute ->
  // compute_budget over one minute).
  keel::quota_limits limits{};
  // Quotas for this client's calls to one model, by model name.
  std::vector<std::pair<std::string, keel::quota_limits>> model_limits{};
};

struct gateway_config {
  std::string path{};             // the file it came from
  std::string listen = "127.0.0.1:8080";
  std::string listen_host = "127.0.0.1";
  int listen_port = 8080;
  std::string default_model{};    // whose budgets, breaker and retry budget fill options
  gateway_options options{};    // validated
  std::vector<upstream_config> upstreams{};  // in file order
  std::vector<model_route> models{};         // in file order
  std::vector<client_key> clients{};         // in file order

  [[nodiscard]] const upstream_config* find_upstream(std::string_view name) const noexcept {
    for (const upstream_config& u : upstreams)
      if (u.name == name) return &u;
    return nullptr;
  }
  [[nodiscard]] const model_route* find_model(std::string_view name) const noexcept {
    for (const model_route& m : models)
      if (m.name == name) return &m;
    return nullptr;
  }
};

namespace config_detail {

// Thrown inside the parser only, caught by parse_config: a config is read
// once at start, and one throw point per rule keeps each rule one line.
struct refused : std::exception {
  explicit refused(std::string m) : message(std::move(m)) {}
  [[nodiscard]] const char* what() const noexcept override { return message.c_str(); }
  std::string message;
};

[[nodiscard]] inline bool bare_key(std::string_view k) noexcept {
  return !k.empty() && std::all_of(k.begin(), k.end(), [](char ch) {
    return (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') || ch == '_' || ch == '-';
  });
}

// A key as TOML would print it in a dotted path: bare, or quoted.
[[nodiscard]] inline std::string key_text(std::string_view k) {
  if (bare_key(k)) return std::string(k);
  std::string out = "\"";
  for (char ch : k) {
    if (ch == '"' || ch == '\\') out += '\\';
    out += ch;
  }
  return out + '"';
}

[[nodiscard]] inline std::string_view type_name(const toml::node& n) noexcept {
  switch (n.type()) {
    case toml::node_type::table: return "a table";
    case toml::node_type::array: return "an array";
    case toml::node_type::string: return "a string";
    case toml::node_type::integer: return "an integer";
    case toml::node_type::floating_point: return "a float";
    case toml::node_type::boolean: return "a boolean";
    case toml::node_type::date: return "a date";
    case toml::node_type::time: return "a time";
    case toml::node_type::date_time: return "a date-time";
    default: return "nothing";
  }
}

// Levenshtein distance, for "did you mean" on unknown keys.
[[nodiscard]] inline std::size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<std::size_t> row(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    std::size_t diag = row[0];
    row[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

[[nodiscard]] inline std::string join(const std::vector<std::string>& names) {
  std::string out;
  for (const std::string& n : names) out += (out.empty() ? "" : ", ") + n;
  return out;
}

// Where the file is and how to refuse it.
struct source {
  std::string_view file;

  [[noreturn]] void fail(const toml::source_region& at, std::string_view path, std::string_view rule) const {
    throw refused(cat(file, ":", at.begin.line, ":", at.begin.column, ": ", path, ": ", rule));
  }
};

// The entries of a table in the order the file wrote them (toml++ keeps a
// table sorted by key): upstreams, fallbacks and clients keep that order.
[[nodiscard]] inline std::vector<std::pair<const toml::key*, const toml::node*>> in_file_order(const toml::table& t) {
  std::vector<std::pair<const toml::key*, const toml::node*>> out;
  for (auto&& [k, v] : t) out.emplace_back(&k, &v);
  std::stable_sort(out.begin(), out.end(), [](const auto& a, const auto& b) {
    const toml::source_position &x = a.first->source().begin, &y = b.first->source().begin;
    return x.line != y.line ? x.line < y.line : x.column < y.column;
  });
  return out;
}

// Parses "250ms", "1.5s", "2m", "24h"; nullopt with the reason otherwise.
[[nodiscard]] inline std::optional<keel::duration> parse_duration(std::string_view text, std::string& why) {
  std::size_t unit_at = 0;
  while (unit_at < text.size() && ((text[unit_at] >= '0' && text[unit_at] <= '9') || text[unit_at] == '.')) ++unit_at;
  const std::string_view number = text.substr(0, unit_at), unit = text.substr(unit_at);
  double value = 0;
  const auto [end, ec] = std::from_chars(number.data(), number.data() + number.size(), value);
  if (number.empty() || ec != std::errc() || end != number.data() + number.size() || number.back() == '.') {
    why = "be a number and a unit: ms, s, m or h (e.g. \"250ms\", \"1.5s\")";
    return std::nullopt;
  }
  double ns_per_unit = 0;
  if (unit == "ms") ns_per_unit = 1e6;
  else if (unit == "s") ns_per_unit = 1e9;
  else if (unit == "m") ns_per_unit = 60e9;
  else if (unit == "h") ns_per_unit = 3600e9;
  else {
    why = unit.empty() ? "give a unit: ms, s, m or h (e.g. \"30s\")" : "use a unit of ms, s, m or h";
    return std::nullopt;
  }
  const double ns = value * ns_per_unit;
  if (!(ns <= 1e6 * 3600e9)) {  // a million hours: past that, a typo
    why = "be at most 1000000h";
    return std::nullopt;
  }
  return std::chrono::duration_cast<keel::duration>(std::chrono::nanoseconds(std::llround(ns)));
}

// A table of the file being read: its path for messages, the keys it
// allows (any other is refused at once: a typo must not pass silently),
// and typed getters that refuse a wrong type at the value's position.
class table_reader {
 public:
  table_reader(const source& src, const toml::table& t, std::string path, std::initializer_list<std::string_view> known)
      : src_(src), t_(t), path_(std::move(path)) {
    for (auto&& [k, v] : in_file_order(t)) {
      if (std::find(known.begin(), known.end(), k->str()) != known.end()) continue;
      std::string best;
      std::size_t best_d = 3;  // suggest only a near miss
      std::vector<std::string> names;
      for (std::string_view n : known) {
        names.emplace_back(n);
        if (const std::size_t d = edit_distance(k->str(), n); d < best_d) best_d = d, best = n;
      }
      src_.fail(k->source(), path_of(k->str()),
                cat("unknown key", best.empty() ? "" : cat(" (did you mean '", best, "'?)"), "; known: ", join(names)));
    }
  }

  [[nodiscard]] const std::string& path() const noexcept { return path_; }
  [[nodiscard]] std::string path_of(std::string_view key) const {
    return path_.empty() ? key_text(key) : cat(path_, ".", key_text(key));
  }
  [[nodiscard]] const toml::node* get(std::string_view key) const { return t_.get(key); }
  [[nodiscard]] const toml::table& table() const noexcept { return t_; }
  // The value's position, or the table's when the key is absent.
  [[nodiscard]] toml::source_region at(std::string_view key) const {
    const toml::node* n = get(key);
    return n != nullptr ? n->source() : t_.source();
  }
  [[noreturn]] void fail(std::string_view key, std::string_view rule) const { src_.fail(at(key), path_of(key), rule); }
  [[noreturn]] void wrong_type(std::string_view key, std::string_view want) const {
    fail(key, cat("must be ", want, ", got ", type_name(*get(key))));
  }
  [[noreturn]] void missing(std::string_view key, std::string_view what) const {
    src_.fail(t_.source(), path_of(key), cat("is required: ", what));
  }

  [[nodiscard]] std::optional<std::string> string(std::string_view key) const {
    const toml::node* n = get(key);
    if (n == nullptr) return std::nullopt;
    if (!n->is_string()) wrong_type(key, "a string");
    return n->as_string()->get();
  }
  [[nodiscard]] std::string required_string(std::string_view key, std::string_view what) const {
    std::optional<std::string> s = string(key);
    if (!s) missing(key, what);
    if (s->empty()) fail(key, cat("must not be empty: ", what));
    return *s;
  }
  [[nodiscard]] std::optional<std::int64_t> integer(std::string_view key, std::int64_t lo, std::int64_t hi) const {
    const toml::node* n = get(key);
    if (n == nullptr) return std::nullopt;
    if (!n->is_integer()) wrong_type(key, "an integer");
    const std::int64_t v = n->as_integer()->get();
    if (v < lo || v > hi) fail(key, cat("must be in [", lo, ", ", hi, "] (got ", v, ")"));
    return v;
  }
  // An integer or a float, finite.
  [[nodiscard]] std::optional<double> number(std::string_view key) const {
    const toml::node* n = get(key);
    if (n == nullptr) return std::nullopt;
    if (n->is_integer()) return static_cast<double>(n->as_integer()->get());
    if (!n->is_floating_point()) wrong_type(key, "a number");
    const double v = n->as_floating_point()->get();
    if (!std::isfinite(v)) fail(key, cat("must be a finite number (got ", v, ")"));
    return v;
  }
  [[nodiscard]] std::optional<keel::duration> duration(std::string_view key) const {
    const toml::node* n = get(key);
    if (n == nullptr) return std::nullopt;
    if (!n->is_string()) wrong_type(key, "a duration string such as \"250ms\", \"1.5s\", \"2m\", \"24h\"");
    std::string why;
    const std::string& text = n->as_string()->get();
    std::optional<keel::duration> d = parse_duration(text, why);
    if (!d) fail(key, cat("must ", why, " (got \"", text, "\")"));
    return d;
  }
  [[nodiscard]] const toml::table* subtable(std::string_view key) const {
    const toml::node* n = get(key);
    if (n == nullptr) return nullptr;
    if (!n->is_table()) wrong_type(key, "a table");
    return n->as_table();
  }
  [[nodiscard]] const toml::array* array(std::string_view key) const {
    const toml::node* n = get(key);
    if (n == nullptr) return nullptr;
    if (!n->is_array()) wrong_type(key, "an array");
    return n->as_array();
  }

 private:
  const source& src_;
  const toml::table& t_;
  std::string path_;
};

// A status from an options struct's validate(), "<who>.<field> must <rule>
// (got ...)", said again at the file's field: `fields` maps the struct's
// field names to the file's keys (dotted for a nested table). Unmapped
// fields are reported at the table.
[[noreturn]] inline void refuse_as(const source& src, const table_reader& t, const absl::Status& s,
                                   std::string_view who,
                                   std::initializer_list<std::pair<std::string_view, std::string_view>> fields) {
  const std::string_view m(s.message().data(), s.message().size());
  std::string_view field, rule = m;
  if (m.starts_with(who) && m.size() > who.size() && m[who.size()] == '.') {
    const std::size_t must = m.find(" must ", who.size());
    if (must != std::string_view::npos) {
      field = m.substr(who.size() + 1, must - who.size() - 1);
      rule = m.substr(must + 1);
    }
  }
  for (const auto& [option, key] : fields) {
    if (option != field) continue;
    // A nested key ("hedge.delay"): its node if written, else its table's, else this table's.
    const toml::node* n = &t.table();
    for (std::size_t from = 0; n != nullptr && n->is_table();) {
      const std::size_t dot = key.find('.', from);
      const toml::node* next = n->as_table()->get(key.substr(from, dot == std::string_view::npos ? key.npos : dot - from));
      if (next == nullptr) break;
      n = next;
      if (dot == std::string_view::npos) break;
      from = dot + 1;
    }
    src.fail(n->source(), cat(t.path(), ".", key), rule);
  }
  src.fail(t.table().source(), t.path(), field.empty() ? rule : cat(field, " ", rule));
}

[[nodiscard]] inline bool env_name(std::string_view s) noexcept {
  if (s.empty() || (s[0] >= '0' && s[0] <= '9')) return false;
  return std::all_of(s.begin(), s.end(), [](char ch) {
    return (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') || ch == '_';
  });
}

// Names of upstreams and clients: they appear in metrics labels and breaker names.
[[nodiscard]] inline bool plain_name(std::string_view s) noexcept {
  return !s.empty() && s.size() <= 128 && std::all_of(s.begin(), s.end(), [](char ch) {
    return (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') || ch == '_' ||
           ch == '-' || ch == '.';
  });
}

// Model names as servers spell them: "gpt-4o-mini", "meta-llama/Llama-3.1-8B", "llama3:8b".
[[nodiscard]] inline bool model_name(std::string_view s) noexcept {
  return !s.empty() && s.size() <= 256 && std::all_of(s.begin(), s.end(), [](char ch) {
    return ch > ' ' && ch < 0x7f && ch != '"' && ch != '\\';
  });
}

// An HTTP header name is an RFC 9110 token.
[[nodiscard]] inline bool token(std::string_view s) noexcept {
  static constexpr std::string_view extra = "!#$%&'*+-.^_`|~";
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char ch) {
    return (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') ||
           extra.find(ch) != std::string_view::npos;
  });
}

[[nodiscard]] inline std::string lower(std::string_view s) {
  std::string out(s);
  for (char& ch : out) ch = static_cast<char>(ch >= 'A' && ch <= 'Z' ? ch - 'A' + 'a' : ch);
  return out;
}

// "host:port", port in [0, 65535] (0: any free port); IPv6 as "[::1]:8080".
[[nodiscard]] inline bool split_host_port(std::string_view s, std::string& host, int& port) {
  const std::size_t colon = s.rfind(':');
  if (colon == std::string_view::npos || colon == 0 || colon + 1 == s.size()) return false;
  host = std::string(s.substr(0, colon));
  if (host.front() == '[' ? host.back() != ']' : host.find_first_of(":/ ") != std::string::npos) return false;
  const char* end = s.data() + s.size();
  const auto [at, ec] = std::from_chars(s.data() + colon + 1, end, port);
  return ec == std::errc() && at == end && port >= 0 && port <= 65535;
}

inline void read_gateway(const source& src, const toml::table& root, gateway_config& cfg,
                         keel::duration& default_deadline) {
  const toml::node* n = root.get("gateway");
  if (n == nullptr) src.fail(root.source(), "gateway", "is required: the [gateway] table (listen, data_dir)");
  if (!n->is_table()) src.fail(n->source(), "gateway", cat("must be a table, got ", type_name(*n)));
  table_reader g(src, *n->as_table(), "gateway",
                 {"listen", "data_dir", "idempotency_retention", "redis", "default_deadline", "default_model", "region",
                  "fiber_threads", "http_workers", "http_queue", "streaming_slots", "streaming_queue", "hedge_threads",
                  "batch_workers"});
  if (std::optional<std::string> l = g.string("listen")) {
    cfg.listen = *l;
    if (!split_host_port(*l, cfg.listen_host, cfg.listen_port))
      g.fail("listen", cat("must be host:port with a port in [0, 65535] (got \"", *l, "\")"));
  }
  cfg.options.data_dir = g.required_string("data_dir", "the directory for the idempotency records and queues");
  if (std::optional<keel::duration> d = g.duration("idempotency_retention")) {
    if (*d < cfg.options.idempotency_lease)
      g.fail("idempotency_retention", cat("must be at least the idempotency lease (",
                                          keel::describe_duration(cfg.options.idempotency_lease), ")"));
    cfg.options.idempotency_retention = *d;
  }
  if (std::optional<std::string> r = g.string("redis")) {
    cfg.options.fleet.redis = *r;
    absl::StatusOr<keel::redis_options> ro = cfg.options.fleet.redis_options();
    if (!ro.ok()) refuse_as(src, g, ro.status(), "gateway_options.fleet", {{"redis", "redis"}});
  }
  if (std::optional<keel::duration> d = g.duration("default_deadline")) {
    if (*d <= keel::duration::zero()) g.fail("default_deadline", "must be > 0");
    default_deadline = *d;
  }
  if (std::optional<std::string> m = g.string("default_model")) cfg.default_model = *m;
  if (std::optional<std::string> r = g.string("region")) cfg.options.region = *r;
  // How many requests run at once, and on what: a worker thread each, or
  // fibers over `fiber_threads` threads (docs/gateway.md, "Fibers").
  if (std::optional<std::int64_t> n = g.integer("fiber_threads", 0, 64))
    cfg.options.http_fiber_threads = static_cast<int>(*n);
  if (std::optional<std::int64_t> n = g.integer("http_workers", 4, 1'000'000)) cfg.options.http_threads = static_cast<int>(*n);
  if (std::optional<std::int64_t> n = g.integer("http_queue", 1, 1'000'000)) cfg.options.http_queue = static_cast<int>(*n);
  if (std::optional<std::int64_t> n = g.integer("streaming_slots", 1, 32767)) cfg.options.chat.slots = static_cast<int>(*n);
  if (std::optional<std::int64_t> n = g.integer("streaming_queue", 0, 32767)) cfg.options.chat.queue = static_cast<int>(*n);
  // The threads beside them: the first-token hedges' and the batch queue's workers.
  if (std::optional<std::int64_t> n = g.integer("hedge_threads", 1, 1024)) cfg.options.chat.hedge_threads = static_cast<int>(*n);
  if (std::optional<std::int64_t> n = g.integer("batch_workers", 0, 1024)) cfg.options.batch_workers = static_cast<int>(*n);
}

inline std::string expand_env(const table_reader& u, std::string_view key, std::string_view text) {
  std::string out;
  for (std::size_t i = 0; i < text.size();) {
    if (text.compare(i, 2, "${") != 0) {
      out += text[i++];
      continue;
    }
    const std::size_t close = text.find('}', i);
    const std::string_view name = text.substr(i + 2, close == std::string_view::npos ? 0 : close - i - 2);
    if (close == std::string_view::npos || !env_name(name))
      u.fail(key, "must write an environment variable as ${NAME} (letters, digits, '_')");
    const char* value = std::getenv(std::string(name).c_str());
    if (value == nullptr) u.fail(key, cat("names the environment variable ", name, ", which is not set"));
    out += value;
    i = close + 1;
  }
  return out;
}

inline void read_base_url(const table_reader& u, upstream_config& up) {
  const std::string written = u.required_string("base_url", "the server's root, http(s)://host[:port]");
  up.base_url = expand_env(u, "base_url", written);
  std::string_view s = up.base_url;
  const std::string shown = cat(" (got \"", up.base_url, "\")");
  if (s.starts_with("https://")) up.scheme = "https", s.remove_prefix(8);
  else if (s.starts_with("http://")) up.scheme = "http", s.remove_prefix(7);
  else u.fail("base_url", cat("must start with http:// or https://", shown));
  if (s.find_first_of("?#") != std::string_view::npos)
    u.fail("base_url", cat("must be the server's root, without a query or fragment", shown));
  const std::size_t slash = s.find('/');
  const std::string_view authority = s.substr(0, slash);
  up.base_path = slash == std::string_view::npos ? "" : std::string(s.substr(slash));
  if (authority.find('@') != std::string_view::npos)
    u.fail("base_url", "must not hold credentials (user:password@): keys never go in the file; use api_key_env");
  up.port = up.tls() ? 443 : 80;
  const std::size_t colon = authority.rfind(':');
  const bool has_port = colon != std::string_view::npos && authority.find(']', colon) == std::string_view::npos;
  if (has_port && !split_host_port(authority, up.host, up.port))
    u.fail("base_url", cat("must have a port in [1, 65535] after the host", shown));
  if (!has_port) up.host = std::string(authority);
  const bool host_ok = !up.host.empty() && up.port > 0 &&
                       (up.host.front() == '[' ? up.host.back() == ']'
                                               : std::all_of(up.host.begin(), up.host.end(), [](char ch) {
                                                   return (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') ||
                                                          (ch >= '0' && ch <= '9') || ch == '.' || ch == '-';
                                                 }));
  if (!host_ok) u.fail("base_url", cat("must name a host (letters, digits, '.', '-', or [IPv6]) and a port > 0", shown));
  if (up.base_path == "/") up.base_path.clear();
  if (!up.base_path.empty() && up.base_path.back() == '/')
    u.fail("base_url", cat("must not end in '/': the gateway appends /v1/...", shown));
  if (up.base_path.ends_with("/v1") || up.base_path.find("/chat/completions") != std::string::npos)
    u.fail("base_url", cat("must be the server's root: the gateway appends /v1/chat/completions itself", shown));
}

inline upstream_config read_upstream(const source& src, std::string_view name, const toml::node& n) {
  const std::string path = cat("upstreams.", key_text(name));
  if (!n.is_table()) src.fail(n.source(), path, cat("must be a table, got ", type_name(n)));
  table_reader u(src, *n.as_table(), path,
                 {"base_url", "api_key_env", "headers", "max_connections", "connect_timeout"});
  upstream_config up{.name = std::string(name)};
  if (!plain_name(name)) src.fail(n.source(), path, "must be named with letters, digits, '_', '-' or '.'");
  read_base_url(u, up);
  if (std::optional<std::string> e = u.string("api_key_env")) {
    // Said without echoing the value: it may be a key.
    if (e->starts_with("sk-") || e->starts_with("sk_") || !env_name(*e))
      u.fail("api_key_env",
             "looks like an API key, not an environment variable's name: keys never go in the file; name the "
             "variable that holds it (letters, digits, '_'; e.g. OPENAI_API_KEY)");
    up.api_key_env = *e;
  }
  if (const toml::table* h = u.subtable("headers")) {
    for (auto&& [k, v] : in_file_order(*h)) {  // any name, each checked
      const std::string hp = cat(u.path_of("headers"), ".", key_text(k->str()));
      const std::string lname = lower(k->str());
      if (!token(k->str())) src.fail(k->source(), hp, "must be an HTTP header name (a token: letters, digits, !#$%&'*+-.^_`|~)");
      if (lname == "authorization" || lname == "proxy-authorization" || lname == "x-api-key" || lname == "api-key")
        src.fail(k->source(), hp, "carries a credential: keys never go in the file; use api_key_env");
      if (lname == "host" || lname == "content-length" || lname == "transfer-encoding" || lname == "connection")
        src.fail(k->source(), hp, "is set by the gateway per request");
      if (!v->is_string()) src.fail(v->source(), hp, cat("must be a string, got ", type_name(*v)));
      const std::string& value = v->as_string()->get();
      if (value.find_first_of(std::string_view("\r\n\0", 3)) != std::string::npos)
        src.fail(v->source(), hp, "must not contain CR, LF or NUL (header injection)");
      up.headers.emplace_back(std::string(k->str()), value);
    }
  }
  if (std::optional<std::int64_t> m = u.integer("max_connections", 1, 65536)) up.max_connections = static_cast<int>(*m);
  if (std::optional<keel::duration> d = u.duration("connect_timeout")) {
    if (*d <= keel::duration::zero() || *d > 5min) u.fail("connect_timeout", "must be in (0, 5m]");
    up.connect_timeout = *d;
  }
  return up;
}

inline std::string known_names(const std::vector<upstream_config>& ups) {
  std::vector<std::string> names;
  for (const upstream_config& u : ups) names.push_back(u.name);
  return join(names);
}

// `earlier`: the routes read before this one (a deployment two routes
// share has one breaker, so they must state it the same).
inline model_route read_model(const source& src, std::string_view name, const toml::node& n,
                              const std::vector<upstream_config>& upstreams, keel::duration default_deadline,
                              const chat_config& chat_base, const std::vector<model_route>& earlier) {
  const std::string path = cat("models.", key_text(name));
  if (!n.is_table()) src.fail(n.source(), path, cat("must be a table, got ", type_name(n)));
  table_reader m(src, *n.as_table(), path,
                 {"deployments", "digest", "deadline", "first_token", "stall", "whole", "attempts", "hedge",
                  "retry_budget", "breaker", "bulkhead", "token_estimate"});
  if (!model_name(name)) src.fail(n.source(), path, "must be a model name without spaces, quotes or backslashes");
  model_route r{.name = std::string(name), .deadline = default_deadline};

  const toml::array* deps = m.array("deployments");
  if (deps == nullptr) m.missing("deployments", "where the model is served, primary first: [{ upstream = \"...\", model = \"...\" }]");
  if (deps->empty()) m.fail("deployments", "must name at least one deployment: { upstream = \"...\", model = \"...\" }");
  for (std::size_t i = 0; i < deps->size(); ++i) {
    const toml::node& e = *deps->get(i);
    const std::string ep = cat(m.path_of("deployments"), "[", i, "]");
    if (!e.is_table()) src.fail(e.source(), ep, cat("must be a table { upstream = \"...\", model = \"...\" }, got ", type_name(e)));
    table_reader d(src, *e.as_table(), ep, {"upstream", "model"});
    deployment dep{.upstream = d.required_string("upstream", "the name of an [upstreams.<name>] table"),
                   .model = d.required_string("model", "the model's name on that upstream")};
    bool found = false;
    for (const upstream_config& u : upstreams) found = found || u.name == dep.upstream;
    if (!found) d.fail("upstream", cat("names no upstream '", dep.upstream, "' (known: ", known_names(upstreams), ")"));
    if (!model_name(dep.model)) d.fail("model", "must be a model name without spaces, quotes or backslashes");
    for (const deployment& before : r.deployments)
      if (before.upstream == dep.upstream && before.model == dep.model)
        src.fail(e.source(), ep, cat("repeats ", dep.upstream, "/", dep.model, ": a fallback must be another deployment"));
    r.deployments.push_back(std::move(dep));
  }
  r.digest = m.string("digest").value_or(cat(r.deployments[0].upstream, "/", r.deployments[0].model));
  if (r.digest.empty()) m.fail("digest", "must not be empty");

  if (std::optional<keel::duration> d = m.duration("deadline")) r.deadline = *d;
  if (std::optional<keel::duration> d = m.duration("first_token")) r.first_token = *d;
  if (std::optional<keel::duration> d = m.duration("stall")) r.stall = *d;
  if (std::optional<keel::duration> d = m.duration("whole")) r.whole = *d;
  if (std::optional<std::int64_t> a = m.integer("attempts", 1, 10)) r.attempts = static_cast<int>(*a);
  if (std::optional<std::int64_t> t = m.integer("token_estimate", 1, 10'000'000)) r.token_estimate = *t;
  if (std::optional<std::string> b = m.string("bulkhead")) {
    if (*b == "interactive") r.bulkhead = bulkhead_class::interactive;
    else if (*b == "batch") r.bulkhead = bulkhead_class::batch;
    else if (*b == "streaming") r.bulkhead = bulkhead_class::streaming;
    else m.fail("bulkhead", cat("names no bulkhead class '", *b, "' (known: interactive, batch, streaming)"));
  }

  if (const toml::table* h = m.subtable("hedge")) {
    table_reader hr(src, *h, m.path_of("hedge"), {"delay", "percentile", "min_delay", "initial"});
    hedge_config hc{};
    std::optional<keel::duration> delay = hr.duration("delay"), initial = hr.duration("initial");
    std::optional<double> pct = hr.number("percentile");
    if (delay && (pct || initial))
      hr.fail("delay", "is a fixed delay: give either delay, or percentile (with initial, min_delay)");
    if (!delay && !pct) src.fail(h->source(), hr.path(), "must give delay (fixed) or percentile (learned)");
    if (!pct && hr.get("min_delay") != nullptr) hr.fail("min_delay", "goes with percentile");
    if (delay) hc.delay = *delay;
    if (pct) {
      if (!(*pct > 0.0 && *pct < 1.0)) hr.fail("percentile", cat("must be in (0, 1); for a fixed delay give delay (got ", *pct, ")"));
      hc.percentile = *pct;
      hc.delay = initial.value_or(hc.delay);
      hc.min_delay = hr.duration("min_delay").value_or(hc.min_delay);
    }
    if (hc.delay <= keel::duration::zero()) hr.fail(delay ? "delay" : "initial", "must be > 0 (leave hedge out for none)");
    r.hedge = hc;
  }
  // The stream budgets obey the gateway's own rules (chat_config::validate).
  if (absl::Status s = r.chat(chat_base).validate(); !s.ok())
    refuse_as(src, m, s, "gateway_options.chat",
              {{"deadline", "deadline"}, {"first_token", "first_token"}, {"stall", "stall"}, {"whole", "whole"},
               {"attempts", "attempts"},
               {"hedge_delay", r.hedge && r.hedge->percentile > 0 ? "hedge.initial" : "hedge.delay"},
               {"hedge_percentile", "hedge.percentile"}, {"hedge_min_delay", "hedge.min_delay"}});
  if (r.stall >= r.deadline) m.fail("stall", "must be shorter than the deadline");

  if (const toml::table* b = m.subtable("retry_budget")) {
    table_reader br(src, *b, m.path_of("retry_budget"), {"ratio", "min_per_second", "window"});
    if (std::optional<double> v = br.number("ratio")) r.retry_budget.ratio = *v;
    if (std::optional<double> v = br.number("min_per_second")) r.retry_budget.min_per_second = *v;
    if (std::optional<keel::duration> v = br.duration("window")) r.retry_budget.window = *v;
    if (absl::Status s = r.retry_budget.validate(); !s.ok())
      refuse_as(src, br, s, "retry_budget_options",
                {{"ratio", "ratio"}, {"min_per_second", "min_per_second"}, {"window", "window"}});
  }
  if (const toml::table* b = m.subtable("breaker")) {
    table_reader br(src, *b, m.path_of("breaker"),
                    {"failure_ratio", "window_calls", "minimum_calls", "open_for", "half_open_probes"});
    keel::circuit_breaker_options& o = r.breaker;
    if (std::optional<double> v = br.number("failure_ratio")) o.failure_rate_threshold = *v;
    if (std::optional<std::int64_t> v = br.integer("window_calls", 1, 65536)) {
      o.window_calls = static_cast<int>(*v);
      o.minimum_calls = std::min(o.minimum_calls, o.window_calls);
    }
    if (std::optional<std::int64_t> v = br.integer("minimum_calls", 1, 65536)) o.minimum_calls = static_cast<int>(*v);
    if (std::optional<keel::duration> v = br.duration("open_for")) o.open_duration = o.probe_timeout = *v;
    if (std::optional<std::int64_t> v = br.integer("half_open_probes", 1, 1000)) o.half_open_probes = static_cast<int>(*v);
    if (absl::Status s = o.validate(); !s.ok())
      refuse_as(src, br, s, "circuit_breaker_options",
                {{"failure_rate_threshold", "failure_ratio"}, {"window_calls", "window_calls"},
                 {"minimum_calls", "minimum_calls"}, {"open_duration", "open_for"},
                 {"probe_timeout", "open_for"}, {"half_open_probes", "half_open_probes"}});
  }
  r.breaker.name = cat("route:", r.name);
  for (const model_route& e : earlier) {
    for (const deployment& d : r.deployments) {
      for (const deployment& ed : e.deployments) {
        if (d.upstream == ed.upstream && d.model == ed.model && !same_breaker(e.breaker, r.breaker))
          m.fail(m.subtable("breaker") != nullptr ? "breaker" : "deployments",
                 cat("differs from models.", key_text(e.name), ".breaker, and both route to the deployment ",
                     d.upstream, "/", d.model, ", which has one breaker: state it the same in both"));
      }
    }
  }
  return r;
}

// A quota table's keys, read into keel's quota_limits and checked by its rules.
inline keel::quota_limits read_quota(const source& src, const table_reader& q) {
  keel::quota_limits l{};
  l.rate = q.number("requests_per_second");
  l.burst = q.number("burst");
  if (std::optional<std::int64_t> v = q.integer("max_in_flight", 1, 1'000'000)) l.max_in_flight = static_cast<int>(*v);
  l.compute_budget = q.integer("tokens_per_minute", 1, std::int64_t{1} << 50);
  l.compute_window = 1min;
  if (absl::Status s = l.validate("quota"); !s.ok())
    refuse_as(src, q, s, "quota",
              {{"rate", "requests_per_second"}, {"burst", "burst"}, {"max_in_flight", "max_in_flight"},
               {"compute_budget", "tokens_per_minute"}});
  return l;
}

[[nodiscard]] inline bool same_limits(const keel::quota_limits& a, const keel::quota_limits& b) noexcept {
  return a.rate == b.rate && a.burst == b.burst && a.max_in_flight == b.max_in_flight &&
         a.max_queued == b.max_queued && a.compute_budget == b.compute_budget && a.compute_window == b.compute_window;
}

inline client_key read_client(const source& src, std::string_view name, const toml::node& n,
                              const std::vector<model_route>& models) {
  const std::string path = cat("clients.", key_text(name));
  if (!n.is_table()) src.fail(n.source(), path, cat("must be a table, got ", type_name(n)));
  table_reader c(src, *n.as_table(), path,
                 {"key_sha256", "tenant", "requests_per_second", "burst", "max_in_flight", "tokens_per_minute", "models"});
  if (!plain_name(name)) src.fail(n.source(), path, "must be named with letters, digits, '_', '-' or '.'");
  client_key k{.name = std::string(name)};
  const std::string hex = c.required_string("key_sha256", "the SHA-256 of the client's key, 64 hex digits");
  std::optional<keel::digest> d = keel::digest::from_hex(hex);
  if (!d)
    c.fail("key_sha256", cat("must be 64 hex digits, the SHA-256 of the key (printf %s \"$KEY\" | sha256sum); got ",
                             hex.size(), " characters", hex.size() == 64 ? " with a non-hex digit" : ""));
  k.key_sha256 = *d;
  k.tenant = c.string("tenant").value_or(k.name);
  if (!plain_name(k.tenant)) c.fail("tenant", "must be named with letters, digits, '_', '-' or '.'");
  k.limits = read_quota(src, c);
  if (const toml::table* per = c.subtable("models")) {
    for (auto&& [mk, mv] : in_file_order(*per)) {
      const std::string mp = cat(c.path_of("models"), ".", key_text(mk->str()));
      bool known = false;
      for (const model_route& r : models) known = known || r.name == mk->str();
      if (!known) {
        std::vector<std::string> names;
        for (const model_route& r : models) names.push_back(r.name);
        src.fail(mk->source(), mp, cat("names no model '", mk->str(), "' (known: ", join(names), ")"));
      }
      if (!mv->is_table()) src.fail(mv->source(), mp, cat("must be a table of quotas, got ", type_name(*mv)));
      table_reader q(src, *mv->as_table(), mp, {"requests_per_second", "burst", "max_in_flight", "tokens_per_minute"});
      k.model_limits.emplace_back(std::string(mk->str()), read_quota(src, q));
    }
  }
  return k;
}

inline gateway_config build(const source& src, const toml::table& root) {
  table_reader top(src, root, "", {"gateway", "upstreams", "models", "clients"});
  gateway_config cfg{.path = std::string(src.file)};
  keel::duration default_deadline = cfg.options.chat.deadline;
  read_gateway(src, root, cfg, default_deadline);

  const toml::table* ups = top.subtable("upstreams");
  if (ups == nullptr || ups->empty())
    src.fail(root.source(), "upstreams", "is required: at least one [upstreams.<name>] with a base_url");
  for (auto&& [k, v] : in_file_order(*ups)) cfg.upstreams.push_back(read_upstream(src, k->str(), *v));

  const toml::table* models = top.subtable("models");
  if (models == nullptr || models->empty())
    src.fail(root.source(), "models", "is required: at least one [models.<name>] with deployments");
  for (auto&& [k, v] : in_file_order(*models))
    cfg.models.push_back(read_model(src, k->str(), *v, cfg.upstreams, default_deadline, cfg.options.chat, cfg.models));

  if (const toml::table* clients = top.subtable("clients")) {
    for (auto&& [k, v] : in_file_order(*clients)) {
      client_key c = read_client(src, k->str(), *v, cfg.models);
      for (std::size_t i = 0; i < cfg.clients.size(); ++i) {
        const client_key& before = cfg.clients[i];
        const toml::table& t = *v->as_table();
        if (CRYPTO_memcmp(before.key_sha256.bytes.data(), c.key_sha256.bytes.data(), c.key_sha256.bytes.size()) == 0)
          src.fail(t.get("key_sha256")->source(), cat("clients.", key_text(c.name), ".key_sha256"),
                   cat("is the key of clients.", key_text(before.name), ": each client has its own key"));
        if (before.tenant == c.tenant && !same_limits(before.limits, c.limits))
          src.fail(t.source(), cat("clients.", key_text(c.name)),
                   cat("gives tenant '", c.tenant, "' other quotas than clients.", key_text(before.name),
                       ": clients of one tenant share its quotas; state them the same"));
      }
      cfg.clients.push_back(std::move(c));
    }
  }

  // gateway_options, as the gateway takes it.
  gateway_options& o = cfg.options;
  if (cfg.default_model.empty()) cfg.default_model = cfg.models.front().name;
  const model_route* def = cfg.find_model(cfg.default_model);
  if (def == nullptr) {
    std::vector<std::string> names;
    for (const model_route& r : cfg.models) names.push_back(r.name);
    const table_reader g(src, *top.subtable("gateway"), "gateway",
                         {"listen", "data_dir", "idempotency_retention", "redis", "default_deadline", "default_model", "region",
                  "fiber_threads", "http_workers", "http_queue", "streaming_slots", "streaming_queue", "hedge_threads",
                  "batch_workers"});
    g.fail("default_model", cat("names no model '", cfg.default_model, "' (known: ", join(names), ")"));
  }
  o.chat = def->chat(o.chat);
  o.breaker = def->breaker;
  o.breaker.name = "breaker";
  o.retry_budget = def->retry_budget;
  o.models.clear();
  // The default model's breaker and retry budget are the gateway's own;
  // every other model has its own.
  for (const model_route& r : cfg.models) {
    const bool is_default = &r == def;
    o.models.push_back({.name = r.name,
                        .digest = r.digest,
                        .token_estimate = r.token_estimate,
                        .chat = r.chat(o.chat),
                        .breaker = is_default ? std::nullopt : std::optional(r.breaker),
                        .retry_budget = is_default ? std::nullopt : std::optional(r.retry_budget),
                        .interactive_hedge = r.hedge.has_value()});
  }
  o.tenants.clear();
  for (const client_key& c : cfg.clients) {
    bool seen = false;
    for (const tenant_config& t : o.tenants) seen = seen || t.name == c.tenant;
    if (!seen) o.tenants.push_back({.name = c.tenant, .limits = c.limits});
  }
  if (absl::Status s = o.validate(); !s.ok()) {
    // Most rules were checked at their fields above; what is left is said
    // at [gateway], naming the option.
    const table_reader g(src, *top.subtable("gateway"), "gateway",
                         {"listen", "data_dir", "idempotency_retention", "redis", "default_deadline", "default_model", "region",
                  "fiber_threads", "http_workers", "http_queue", "streaming_slots", "streaming_queue", "hedge_threads",
                  "batch_workers"});
    refuse_as(src, g, s, "gateway_options", {{"data_dir", "data_dir"}, {"fleet.redis", "redis"}});
  }
  return cfg;
}

}  // namespace config_detail

// Reads a configuration from `text`; errors name `path_for_errors`. The
// result's options are validated. InvalidArgumentError with one line,
// "<file>:<line>:<column>: <field path>: <rule>", for a bad file.
[[nodiscard]] inline absl::StatusOr<gateway_config> parse_config(std::string_view text, std::string_view path_for_errors) {
  toml::table root;
  try {
    root = toml::parse(text, path_for_errors);
  } catch (const toml::parse_error& e) {
    return absl::InvalidArgumentError(
        cat(path_for_errors, ":", e.source().begin.line, ":", e.source().begin.column, ": ", e.description()));
  }
  try {
    return config_detail::build(config_detail::source{path_for_errors}, root);
  } catch (const config_detail::refused& e) {
    return absl::InvalidArgumentError(e.message);
  }
}

// Reads and validates the file at `path`. NotFoundError when it cannot be read.
[[nodiscard]] inline absl::StatusOr<gateway_config> load_config(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(cat(path, ": cannot be read: ", std::generic_category().message(errno)));
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) return absl::NotFoundError(cat(path, ": cannot be read"));
  return parse_config(text.str(), path);
}

// The client whose key is `presented` (find_by_key_digest: constant time).
// nullptr: no client has it.
[[nodiscard]] inline const client_key* find_client(const gateway_config& cfg, std::string_view presented) {
  return find_by_key_digest(cfg.clients, &client_key::key_sha256, presented);
}

// The upstream's API key from its environment variable; "" when it names
// none. FailedPreconditionError naming the variable when it is unset or empty.
[[nodiscard]] inline absl::StatusOr<std::string> resolve_api_key(const upstream_config& u) {
  if (u.api_key_env.empty()) return std::string();
  const char* v = std::getenv(u.api_key_env.c_str());
  if (v == nullptr || *v == '\0')
    return absl::FailedPreconditionError(cat("upstreams.", config_detail::key_text(u.name), ".api_key_env: ",
                                             u.api_key_env, v == nullptr ? " is not set" : " is empty",
                                             " in the environment"));
  return std::string(v);
}

// The gateway's options with its model calls going over HTTP: each model
// is served by its own first deployment, and its second (when it has one)
// is where its streams fail over and continue; the default model's pair
// also serves batch reports. Each deployment is one failure domain,
// "<upstream>/<model>": a breaker per (upstream, model). API keys are read
// from the environment here, at start, never from the file.
[[nodiscard]] inline absl::StatusOr<gateway_options> with_upstreams(const gateway_config& cfg) {
  const model_route* route = cfg.find_model(cfg.default_model);
  if (route == nullptr || route->deployments.empty())
    return absl::InvalidArgumentError(cat(cfg.path, ": gateway.default_model: names no model with deployments"));
  auto deployment_options = [&](const deployment& d) -> absl::StatusOr<http_upstream_options> {
    const upstream_config* up = cfg.find_upstream(d.upstream);
    if (up == nullptr) return absl::InvalidArgumentError(cat(cfg.path, ": names no upstream '", d.upstream, "'"));
    absl::StatusOr<std::string> key = resolve_api_key(*up);
    if (!key.ok()) return keel::annotate(key.status(), cat(cfg.path, ": upstreams.", up->name));
    http_upstream_options o{.name = cat(up->name, "/", d.model),
                            .base_url = up->base_url,
                            .model = d.model,
                            .api_key = std::move(*key),
                            .max_connections = static_cast<std::size_t>(up->max_connections),
                            .connect_timeout = up->connect_timeout};
    for (const auto& [name, value] : up->headers) o.headers.push_back(cat(name, ": ", value));
    return o;
  };
  // A route's first deployment serves; its second, when it has one, backs
  // it; the rest are tried in order when both fail before a first token.
  auto serve = [&](const model_route& r, std::optional<http_upstream_options>& first,
                   std::optional<http_upstream_options>& second,
                   std::vector<http_upstream_options>& further) -> absl::Status {
    for (std::size_t i = 0; i < r.deployments.size(); ++i) {
      absl::StatusOr<http_upstream_options> d = deployment_options(r.deployments[i]);
      if (!d.ok()) return d.status();
      if (i < 2) {
        (i == 0 ? first : second) = std::move(*d);
      } else {
        further.push_back(std::move(*d));
      }
    }
    return absl::OkStatus();
  };
  gateway_options o = cfg.options;
  for (const client_key& c : cfg.clients) o.api_keys.push_back({.sha256 = c.key_sha256, .tenant = c.tenant});
  std::vector<http_upstream_options> default_further;
  if (absl::Status s = serve(*route, o.upstream, o.upstream_backup, default_further); !s.ok()) return s;
  // Every other model is served by its own deployments (its breakers are
  // its own); the default model by the pair above.
  for (model_config& m : o.models) {
    const model_route* r = cfg.find_model(m.name);
    if (r == nullptr) continue;
    if (m.name == cfg.default_model) {
      m.upstream_fallbacks = default_further;
      continue;
    }
    if (absl::Status s = serve(*r, m.upstream, m.upstream_backup, m.upstream_fallbacks); !s.ok()) return s;
  }
  if (absl::Status s = o.validate(); !s.ok()) return keel::annotate(s, cfg.path);
  return o;
}

}  // namespace gateway

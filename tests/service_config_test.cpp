// The gateway's configuration file (examples/gateway/config.hpp): a valid
// file fills the structs and gateway_options; each kind of bad file is
// refused with one line naming the file, line, column, field path and rule;
// client keys are found by their hash; API keys come from the environment;
// both example configs load; and `gateway --check-config` says the same.
#include <cstdlib>
#include <fstream>
#include <optional>
#include <string>
#include <string_view>

#include "absl/strings/str_cat.h"
#include "config.hpp"
#include "support/catch.hpp"
#include "support/service.hpp"

using namespace std::chrono_literals;

namespace {

// A small valid file; the error tests add lines after it (from line 13 on,
// inside [models.chat-default]) or replace parts of it.
constexpr std::string_view base = R"([gateway]
data_dir = "/tmp/keel-config-test"

[upstreams.local]
base_url = "http://127.0.0.1:8000"

[upstreams.openai]
base_url = "https://api.openai.com"
api_key_env = "OPENAI_API_KEY"

[models.chat-default]
deployments = [{ upstream = "local", model = "llama" }]
)";

std::string error_of(std::string_view text) {
  absl::StatusOr<gateway::gateway_config> c = gateway::parse_config(text, "config.toml");
  if (c.ok()) return "(accepted)";
  CHECK(c.status().code() == absl::StatusCode::kInvalidArgument);
  return std::string(c.status().message());
}

std::string with(std::string_view extra) { return std::string(base) + std::string(extra); }

std::string hex_of(std::string_view key) { return keel::sha256(key).hex(); }

}  // namespace

TEST_CASE("config: a valid file fills the structs and gateway_options", "[config]") {
  const std::string text = R"([gateway]
listen = "0.0.0.0:9090"
data_dir = "/var/lib/keel-gateway"
idempotency_retention = "12h"
redis = "127.0.0.1:6379"
default_deadline = "30s"

[upstreams.local]
base_url = "http://127.0.0.1:8000"
headers = { "x-team" = "ml", "x-b" = "2" }
max_connections = 16
connect_timeout = "1.5s"

[upstreams.openai]
base_url = "https://api.openai.com"
api_key_env = "OPENAI_API_KEY"

[models."chat-default"]
deployments = [
  { upstream = "openai", model = "gpt-4o-mini" },
  { upstream = "local", model = "llama-3.1-8b" },
]
deadline = "20s"
first_token = "1s"
stall = "400ms"
attempts = 3
hedge = { delay = "300ms" }
retry_budget = { ratio = 0.2, min_per_second = 7 }
breaker = { failure_ratio = 0.4, window_calls = 50, open_for = "5s" }
bulkhead = "streaming"
token_estimate = 700

[models.embed]
deployments = [{ upstream = "openai", model = "text-embedding-3-small" }]
hedge = { percentile = 0.9, min_delay = "20ms", initial = "250ms" }

[clients."team-a"]
key_sha256 = ")" + hex_of("team-a-key") + R"("
tenant = "acme"
requests_per_second = 40
burst = 50
max_in_flight = 24
tokens_per_minute = 100000
models = { "chat-default" = { requests_per_second = 10, tokens_per_minute = 20000 } }

[clients.team-b]
key_sha256 = ")" + hex_of("team-b-key") + R"("
)";
  absl::StatusOr<gateway::gateway_config> c = gateway::parse_config(text, "config.toml");
  REQUIRE(c.ok());
  CHECK(c->path == "config.toml");
  CHECK(c->listen_host == "0.0.0.0");
  CHECK(c->listen_port == 9090);
  CHECK(c->default_model == "chat-default");  // the first model in the file

  // Upstreams in file order (toml++ keeps tables sorted: "local" < "openai" either way).
  REQUIRE(c->upstreams.size() == 2);
  const gateway::upstream_config& local = c->upstreams[0];
  CHECK(local.name == "local");
  CHECK(local.scheme == "http");
  CHECK(local.host == "127.0.0.1");
  CHECK(local.port == 8000);
  CHECK(local.base_path.empty());
  CHECK_FALSE(local.tls());
  CHECK(local.api_key_env.empty());
  CHECK(local.headers == std::vector<std::pair<std::string, std::string>>{{"x-team", "ml"}, {"x-b", "2"}});
  CHECK(local.max_connections == 16);
  CHECK(local.connect_timeout == 1500ms);
  const gateway::upstream_config& openai = c->upstreams[1];
  CHECK(openai.tls());
  CHECK(openai.port == 443);
  CHECK(openai.api_key_env == "OPENAI_API_KEY");
  CHECK(openai.max_connections == 64);
  CHECK(openai.connect_timeout == 2s);

  // Models in file order: "chat-default" before "embed"; deployments primary first.
  REQUIRE(c->models.size() == 2);
  const gateway::model_route& chat = c->models[0];
  CHECK(chat.name == "chat-default");
  REQUIRE(chat.deployments.size() == 2);
  CHECK(chat.deployments[0].upstream == "openai");
  CHECK(chat.deployments[0].model == "gpt-4o-mini");
  CHECK(chat.deployments[1].upstream == "local");
  CHECK(chat.digest == "openai/gpt-4o-mini");
  CHECK(chat.deadline == 20s);
  CHECK(chat.first_token == 1s);
  CHECK(chat.stall == 400ms);
  CHECK(chat.attempts == 3);
  REQUIRE(chat.hedge.has_value());
  CHECK(chat.hedge->delay == 300ms);
  CHECK(chat.hedge->percentile == 0.0);
  CHECK(chat.retry_budget.ratio == 0.2);
  CHECK(chat.retry_budget.min_per_second == 7.0);
  CHECK(chat.breaker.failure_rate_threshold == 0.4);
  CHECK(chat.breaker.window_calls == 50);
  CHECK(chat.breaker.open_duration == 5s);
  CHECK(chat.bulkhead == gateway::bulkhead_class::streaming);
  CHECK(chat.token_estimate == 700);
  const gateway::model_route& embed = c->models[1];
  CHECK(embed.deadline == 30s);  // gateway.default_deadline
  CHECK(embed.bulkhead == gateway::bulkhead_class::interactive);
  REQUIRE(embed.hedge.has_value());
  CHECK(embed.hedge->percentile == 0.9);
  CHECK(embed.hedge->delay == 250ms);
  CHECK(embed.hedge->min_delay == 20ms);
  CHECK(embed.token_estimate == 600);
  CHECK(c->find_model("embed") == &embed);
  CHECK(c->find_model("nope") == nullptr);
  CHECK(c->find_upstream("openai") == &openai);

  REQUIRE(c->clients.size() == 2);
  const gateway::client_key& a = c->clients[0];
  CHECK(a.name == "team-a");
  CHECK(a.tenant == "acme");
  CHECK(a.key_sha256.hex() == hex_of("team-a-key"));
  CHECK(a.limits.rate == 40.0);
  CHECK(a.limits.burst == 50.0);
  CHECK(a.limits.max_in_flight == 24);
  CHECK(a.limits.compute_budget == 100000);
  CHECK(a.limits.compute_window == 1min);
  REQUIRE(a.model_limits.size() == 1);
  CHECK(a.model_limits[0].first == "chat-default");
  CHECK(a.model_limits[0].second.rate == 10.0);
  CHECK(a.model_limits[0].second.compute_budget == 20000);
  CHECK(c->clients[1].tenant == "team-b");  // default: the client's name
  CHECK_FALSE(c->clients[1].limits.any());

  // gateway_options, as the gateway takes it.
  const gateway::gateway_options& o = c->options;
  CHECK(o.validate().ok());
  CHECK(o.data_dir == "/var/lib/keel-gateway");
  CHECK(o.idempotency_retention == 12h);
  CHECK(o.fleet.redis == "127.0.0.1:6379");
  CHECK(o.chat.deadline == 20s);
  CHECK(o.chat.first_token == 1s);
  CHECK(o.chat.stall == 400ms);
  CHECK(o.chat.attempts == 3);
  CHECK(o.chat.hedge_delay == 300ms);
  CHECK(o.chat.hedge_percentile == 0.0);
  CHECK(o.breaker.window_calls == 50);
  CHECK(o.breaker.failure_rate_threshold == 0.4);
  CHECK(o.breaker.open_duration == 5s);
  CHECK(o.retry_budget.ratio == 0.2);
  REQUIRE(o.models.size() == 2);
  CHECK(o.models[0].name == "chat-default");
  CHECK(o.models[0].digest == "openai/gpt-4o-mini");
  CHECK(o.models[0].token_estimate == 700);
  // The default model's breaker and retry budget are the gateway's own
  // (above); every other model carries its own.
  CHECK_FALSE(o.models[0].breaker.has_value());
  CHECK_FALSE(o.models[0].retry_budget.has_value());
  REQUIRE(o.models[1].breaker.has_value());
  CHECK(o.models[1].breaker->window_calls == 40);  // the file's default, not chat-default's 50
  REQUIRE(o.models[1].retry_budget.has_value());
  CHECK(o.models[1].retry_budget->ratio == 0.1);
  REQUIRE(o.tenants.size() == 2);
  CHECK(o.tenants[0].name == "acme");
  CHECK(o.tenants[0].limits.rate == 40.0);
  CHECK(o.tenants[1].name == "team-b");
}

TEST_CASE("config: upstreams, models and clients keep the file's order", "[config]") {
  const std::string text = with(R"(
[upstreams.zeta]
base_url = "http://10.0.0.1:9000/proxy"

[models.b-model]
deployments = [{ upstream = "zeta", model = "m" }, { upstream = "local", model = "m" }]

[models.a-model]
deployments = [{ upstream = "local", model = "m" }]
)");
  absl::StatusOr<gateway::gateway_config> c = gateway::parse_config(text, "config.toml");
  REQUIRE(c.ok());
  REQUIRE(c->upstreams.size() == 3);
  // [upstreams.zeta] comes after the models table in the text, but after openai among upstreams.
  CHECK(c->upstreams[2].name == "zeta");
  CHECK(c->upstreams[2].base_path == "/proxy");
  REQUIRE(c->models.size() == 3);
  CHECK(c->models[0].name == "chat-default");
  CHECK(c->models[1].name == "b-model");
  CHECK(c->models[2].name == "a-model");
}

TEST_CASE("config: a TOML syntax error names the file, line and column", "[config]") {
  CHECK(error_of(with("deadline = = 2\n")) ==
        "config.toml:13:12: Error while parsing value: could not determine value type");
  CHECK(error_of(with("attempts = 1\nattempts = 2\n")) ==
        "config.toml:14:12: Error while parsing key-value pair: cannot redefine existing integer 'attempts'");
}

TEST_CASE("config: an unknown key is refused, with a near miss suggested", "[config]") {
  const std::string e = error_of(with("deadlin = \"2s\"\n"));
  CHECK(e.starts_with("config.toml:13:1: models.chat-default.deadlin: unknown key (did you mean 'deadline'?); known: "
                      "deployments, digest, deadline,"));
  CHECK(error_of(std::string(base) + "[modles.x]\n").starts_with(
      "config.toml:13:2: modles: unknown key (did you mean 'models'?); known: gateway, upstreams, models, clients"));
  // Inside an inline table too.
  CHECK(error_of(with("breaker = { failure_rate = 0.5 }\n"))
            .starts_with("config.toml:13:13: models.chat-default.breaker.failure_rate: unknown key (did you mean "
                         "'failure_ratio'?)"));
}

TEST_CASE("config: a value of the wrong type is refused at the value", "[config]") {
  CHECK(error_of(with("attempts = \"2\"\n")) ==
        "config.toml:13:12: models.chat-default.attempts: must be an integer, got a string");
  CHECK(error_of(with("deadline = 20\n")) ==
        "config.toml:13:12: models.chat-default.deadline: must be a duration string such as \"250ms\", \"1.5s\", "
        "\"2m\", \"24h\", got an integer");
  std::string text(base);
  text.replace(text.find("[{ upstream"), std::string_view("[{ upstream = \"local\", model = \"llama\" }]").size(),
               "\"local\"");
  CHECK(error_of(text) == "config.toml:12:15: models.chat-default.deployments: must be an array, got a string");
}

TEST_CASE("config: a duration needs a number and a unit of ms, s, m or h", "[config]") {
  CHECK(error_of(with("deadline = \"20\"\n")) ==
        "config.toml:13:12: models.chat-default.deadline: must give a unit: ms, s, m or h (e.g. \"30s\") (got \"20\")");
  CHECK(error_of(with("deadline = \"2d\"\n")) ==
        "config.toml:13:12: models.chat-default.deadline: must use a unit of ms, s, m or h (got \"2d\")");
  CHECK(error_of(with("stall = \"-1s\"\n")) ==
        "config.toml:13:9: models.chat-default.stall: must be a number and a unit: ms, s, m or h (e.g. \"250ms\", "
        "\"1.5s\") (got \"-1s\")");
  CHECK(error_of(with("stall = \"1 s\"\n")).starts_with("config.toml:13:9: models.chat-default.stall: must use a unit"));
  // Fractions are fine.
  absl::StatusOr<gateway::gateway_config> c = gateway::parse_config(with("first_token = \"1.5s\"\nstall = \"0.25s\"\n"), "c");
  REQUIRE(c.ok());
  CHECK(c->models[0].first_token == 1500ms);
  CHECK(c->models[0].stall == 250ms);
}

TEST_CASE("config: out-of-range numbers follow the gateway's own rules", "[config]") {
  // chat_config::validate: the first token must come before the deadline.
  CHECK(error_of(with("deadline = \"2s\"\nfirst_token = \"3s\"\n")) ==
        "config.toml:14:15: models.chat-default.first_token: must be shorter than the deadline (got 3s)");
  CHECK(error_of(with("attempts = 0\n")) ==
        "config.toml:13:12: models.chat-default.attempts: must be in [1, 10] (got 0)");
  CHECK(error_of(with("breaker = { failure_ratio = 1.5 }\n")) ==
        "config.toml:13:29: models.chat-default.breaker.failure_ratio: must be in (0, 1] (got 1.5)");
  CHECK(error_of(with("retry_budget = { ratio = 2 }\n")) ==
        "config.toml:13:26: models.chat-default.retry_budget.ratio: must be in [0, 1] (got 2)");
  // A deployment has one breaker: two models routing to it state it the same.
  CHECK(error_of(with("[models.other]\ndeployments = [{ upstream = \"local\", model = \"llama\" }]\n"
                      "breaker = { window_calls = 10 }\n")) ==
        "config.toml:15:11: models.other.breaker: differs from models.chat-default.breaker, and both route to the "
        "deployment local/llama, which has one breaker: state it the same in both");
  CHECK(error_of(with("breaker = { window_calls = 10 }\n[models.other]\n"
                      "deployments = [{ upstream = \"local\", model = \"llama\" }]\n")) ==
        "config.toml:15:15: models.other.deployments: differs from models.chat-default.breaker, and both route to "
        "the deployment local/llama, which has one breaker: state it the same in both");
  CHECK(error_of(with("[models.other]\ndeployments = [{ upstream = \"local\", model = \"llama\" }]\n")) ==
        "(accepted)");
  CHECK(error_of(with("hedge = { percentile = 1.5 }\n")) ==
        "config.toml:13:24: models.chat-default.hedge.percentile: must be in (0, 1); for a fixed delay give delay (got "
        "1.5)");
  CHECK(error_of(std::string(base) + "[clients.c]\nkey_sha256 = \"" + hex_of("k") + "\"\nburst = 0.5\nrequests_per_second = 1\n") ==
        "config.toml:15:9: clients.c.burst: must be in [1, 1e12] (got 0.5)");
}

TEST_CASE("config: a model needs at least one deployment", "[config]") {
  std::string text(base);
  text.replace(text.find("[{ upstream"), std::string_view("[{ upstream = \"local\", model = \"llama\" }]").size(), "[]");
  CHECK(error_of(text) == "config.toml:12:15: models.chat-default.deployments: must name at least one deployment: "
                          "{ upstream = \"...\", model = \"...\" }");
}

TEST_CASE("config: a deployment naming no upstream is refused, listing the known ones", "[config]") {
  std::string text(base);
  text.replace(text.find("deployments"), std::string::npos,
               "deployments = [\n  { upstream = \"local\", model = \"llama-3.1-8b\" },\n"
               "  { upstream = \"opnai\", model = \"gpt-4o-mini\" },\n]\n");
  CHECK(error_of(text) == "config.toml:14:16: models.chat-default.deployments[1].upstream: names no upstream 'opnai' "
                          "(known: local, openai)");
}

TEST_CASE("config: two clients with one key are refused", "[config]") {
  const std::string h = hex_of("shared-key");
  CHECK(error_of(std::string(base) + "[clients.a]\nkey_sha256 = \"" + h + "\"\n[clients.b]\nkey_sha256 = \"" + h +
                 "\"\n") == "config.toml:16:14: clients.b.key_sha256: is the key of clients.a: each client has its own key");
}

TEST_CASE("config: key_sha256 must be 64 hex digits", "[config]") {
  std::string bad = hex_of("k");
  bad[10] = 'g';
  CHECK(error_of(std::string(base) + "[clients.a]\nkey_sha256 = \"" + bad + "\"\n") ==
        "config.toml:14:14: clients.a.key_sha256: must be 64 hex digits, the SHA-256 of the key (printf %s \"$KEY\" | "
        "sha256sum); got 64 characters with a non-hex digit");
  CHECK(error_of(std::string(base) + "[clients.a]\nkey_sha256 = \"abc\"\n") ==
        "config.toml:14:14: clients.a.key_sha256: must be 64 hex digits, the SHA-256 of the key (printf %s \"$KEY\" | "
        "sha256sum); got 3 characters");
  CHECK(error_of(std::string(base) + "[clients.a]\ntenant = \"x\"\n") ==
        "config.toml:13:1: clients.a.key_sha256: is required: the SHA-256 of the client's key, 64 hex digits");
}

TEST_CASE("config: an API key where the variable's name goes is refused, and not echoed", "[config]") {
  for (std::string_view pasted : {"sk-proj-abcdef123456", "sk_live_0123", "abc def", "OPENAI-KEY", "9LIVES"}) {
    std::string text(base);
    text.replace(text.find("\"OPENAI_API_KEY\""), 16, "\"" + std::string(pasted) + "\"");
    const std::string e = error_of(text);
    INFO(e);
    CHECK(e == "config.toml:9:15: upstreams.openai.api_key_env: looks like an API key, not an environment variable's "
               "name: keys never go in the file; name the variable that holds it (letters, digits, '_'; e.g. "
               "OPENAI_API_KEY)");
    CHECK(e.find(pasted) == std::string::npos);
  }
  // Credentials in a header or in the URL are refused for the same reason.
  CHECK(error_of(with("[upstreams.x]\nbase_url = \"http://h:1\"\nheaders = { Authorization = \"Bearer sk-1\" }\n")) ==
        "config.toml:15:13: upstreams.x.headers.Authorization: carries a credential: keys never go in the file; use "
        "api_key_env");
  CHECK(error_of(with("[upstreams.x]\nbase_url = \"http://u:p@h:1\"\n")) ==
        "config.toml:14:12: upstreams.x.base_url: must not hold credentials (user:password@): keys never go in the "
        "file; use api_key_env");
}

TEST_CASE("config: a header with CR or LF, or a name that is no token, is refused", "[config]") {
  CHECK(error_of(with("[upstreams.x]\nbase_url = \"http://h:1\"\nheaders = { \"x-a\" = \"ok\\r\\nx-b: evil\" }\n")) ==
        "config.toml:15:21: upstreams.x.headers.x-a: must not contain CR, LF or NUL (header injection)");
  CHECK(error_of(with("[upstreams.x]\nbase_url = \"http://h:1\"\nheaders = { \"x a\" = \"v\" }\n")) ==
        "config.toml:15:13: upstreams.x.headers.\"x a\": must be an HTTP header name (a token: letters, digits, "
        "!#$%&'*+-.^_`|~)");
}

TEST_CASE("config: base_url must be an http or https root", "[config]") {
  auto bad_url = [](std::string_view url) {
    return error_of(with("[upstreams.x]\nbase_url = \"" + std::string(url) + "\"\n"));
  };
  CHECK(bad_url("ftp://h") ==
        "config.toml:14:12: upstreams.x.base_url: must start with http:// or https:// (got \"ftp://h\")");
  CHECK(bad_url("localhost:8000") ==
        "config.toml:14:12: upstreams.x.base_url: must start with http:// or https:// (got \"localhost:8000\")");
  CHECK(bad_url("http://h:1/?x=1").starts_with(
      "config.toml:14:12: upstreams.x.base_url: must be the server's root, without a query or fragment"));
  CHECK(bad_url("http://h:99999").starts_with(
      "config.toml:14:12: upstreams.x.base_url: must have a port in [1, 65535] after the host"));
  CHECK(bad_url("http://h/") == "(accepted)");  // the root itself
  CHECK(bad_url("https://api.openai.com/v1") ==
        "config.toml:14:12: upstreams.x.base_url: must be the server's root: the gateway appends "
        "/v1/chat/completions itself (got \"https://api.openai.com/v1\")");
  CHECK(bad_url("http://h/proxy/") ==
        "config.toml:14:12: upstreams.x.base_url: must not end in '/': the gateway appends /v1/... (got "
        "\"http://h/proxy/\")");
  CHECK(bad_url("http://") .starts_with("config.toml:14:12: upstreams.x.base_url: must name a host"));
}

TEST_CASE("config: ${VAR} in base_url comes from the environment; unset is an error naming it", "[config]") {
  ::setenv("KEEL_CONFIG_TEST_PORT", "8123", 1);
  absl::StatusOr<gateway::gateway_config> c =
      gateway::parse_config(with("[upstreams.x]\nbase_url = \"http://127.0.0.1:${KEEL_CONFIG_TEST_PORT}\"\n"), "c");
  REQUIRE(c.ok());
  CHECK(c->find_upstream("x")->port == 8123);
  CHECK(c->find_upstream("x")->base_url == "http://127.0.0.1:8123");
  ::unsetenv("KEEL_CONFIG_TEST_PORT");
  CHECK(error_of(with("[upstreams.x]\nbase_url = \"http://127.0.0.1:${KEEL_CONFIG_TEST_PORT}\"\n")) ==
        "config.toml:14:12: upstreams.x.base_url: names the environment variable KEEL_CONFIG_TEST_PORT, which is not "
        "set");
}

TEST_CASE("config: an unknown bulkhead class is refused", "[config]") {
  CHECK(error_of(with("bulkhead = \"interative\"\n")) ==
        "config.toml:13:12: models.chat-default.bulkhead: names no bulkhead class 'interative' (known: interactive, "
        "batch, streaming)");
}

TEST_CASE("config: listen must be host:port", "[config]") {
  std::string text(base);
  text.insert(text.find("data_dir"), "listen = \"8080\"\n");
  CHECK(error_of(text) ==
        "config.toml:2:10: gateway.listen: must be host:port with a port in [0, 65535] (got \"8080\")");
  text = std::string(base);
  text.insert(text.find("data_dir"), "listen = \"localhost:http\"\n");
  CHECK(error_of(text) ==
        "config.toml:2:10: gateway.listen: must be host:port with a port in [0, 65535] (got \"localhost:http\")");
}

TEST_CASE("config: a client's per-model quota must name a model", "[config]") {
  CHECK(error_of(absl::StrCat(std::string(base), "[clients.a]\nkey_sha256 = \"", hex_of("k"),
                              "\"\nmodels = { \"chat-defualt\" = { requests_per_second = 1 } }\n")) ==
        "config.toml:15:12: clients.a.models.chat-defualt: names no model 'chat-defualt' (known: chat-default)");
}

TEST_CASE("config: missing sections and fields say what they need", "[config]") {
  CHECK(error_of("[upstreams.a]\nbase_url = \"http://h:1\"\n") ==
        "config.toml:1:1: gateway: is required: the [gateway] table (listen, data_dir)");
  CHECK(error_of("[gateway]\nlisten = \"127.0.0.1:1\"\n") ==
        "config.toml:1:1: gateway.data_dir: is required: the directory for the idempotency records and queues");
  CHECK(error_of("[gateway]\ndata_dir = \"/tmp\"\n") ==
        "config.toml:1:1: upstreams: is required: at least one [upstreams.<name>] with a base_url");
  CHECK(error_of(std::string(base).substr(0, std::string(base).find("[models"))) ==
        "config.toml:1:1: models: is required: at least one [models.<name>] with deployments");
  CHECK(error_of(with("[models.empty]\n")) ==
        "config.toml:13:1: models.empty.deployments: is required: where the model is served, primary first: "
        "[{ upstream = \"...\", model = \"...\" }]");
  CHECK(error_of(with("hedge = { min_delay = \"10ms\" }\n")) ==
        "config.toml:13:9: models.chat-default.hedge: must give delay (fixed) or percentile (learned)");
}

TEST_CASE("config: clients of one tenant must state the same quotas", "[config]") {
  // absl::StrCat, not a chain of std::string +: g++ 12 at -O2 reports a false
  // -Warray-bounds on the chain (GCC bug 105651).
  const std::string text = absl::StrCat(std::string(base), "[clients.a]\nkey_sha256 = \"", hex_of("a"),
                                        "\"\ntenant = \"acme\"\nrequests_per_second = 5\n[clients.b]\nkey_sha256 = \"",
                                        hex_of("b"), "\"\ntenant = \"acme\"\nrequests_per_second = 6\n");
  CHECK(error_of(text) == "config.toml:17:1: clients.b: gives tenant 'acme' other quotas than clients.a: clients of "
                          "one tenant share its quotas; state them the same");
}

TEST_CASE("config: find_client matches the key's hash and nothing else", "[config]") {
  absl::StatusOr<gateway::gateway_config> c = gateway::parse_config(
      std::string(base) + "[clients.a]\nkey_sha256 = \"" + hex_of("sk-team-a-0123456789") + "\"\n[clients.b]\n" +
          "key_sha256 = \"" + hex_of("sk-team-b-0123456789") + "\"\n",
      "c");
  REQUIRE(c.ok());
  const gateway::client_key* a = gateway::find_client(*c, "sk-team-a-0123456789");
  REQUIRE(a != nullptr);
  CHECK(a->name == "a");
  CHECK(gateway::find_client(*c, "sk-team-b-0123456789") == &c->clients[1]);
  CHECK(gateway::find_client(*c, "sk-team-c-0123456789") == nullptr);  // one byte differs
  CHECK(gateway::find_client(*c, "sk-team-a-012345678") == nullptr);    // a prefix
  CHECK(gateway::find_client(*c, "") == nullptr);
  CHECK(gateway::find_client(*c, hex_of("sk-team-a-0123456789")) == nullptr);  // the hash is not the key
}

TEST_CASE("config: resolve_api_key reads the named variable; unset or empty is an error naming it", "[config]") {
  absl::StatusOr<gateway::gateway_config> c = gateway::parse_config(base, "c");
  REQUIRE(c.ok());
  const gateway::upstream_config& openai = *c->find_upstream("openai");
  ::setenv("OPENAI_API_KEY", "sk-test-123", 1);
  absl::StatusOr<std::string> key = gateway::resolve_api_key(openai);
  REQUIRE(key.ok());
  CHECK(*key == "sk-test-123");
  ::setenv("OPENAI_API_KEY", "", 1);
  CHECK(gateway::resolve_api_key(openai).status().message() ==
        "upstreams.openai.api_key_env: OPENAI_API_KEY is empty in the environment");
  ::unsetenv("OPENAI_API_KEY");
  key = gateway::resolve_api_key(openai);
  CHECK(key.status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK(key.status().message() == "upstreams.openai.api_key_env: OPENAI_API_KEY is not set in the environment");
  // No variable named: no key, not an error.
  key = gateway::resolve_api_key(*c->find_upstream("local"));
  REQUIRE(key.ok());
  CHECK(key->empty());
}

TEST_CASE("config: both example configs load and validate", "[config]") {
  ::setenv("MOCK_A_PORT", "18001", 1);
  ::setenv("MOCK_B_PORT", "18002", 1);
  absl::StatusOr<gateway::gateway_config> demo = gateway::load_config(KEEL_GATEWAY_CONFIG_DIR "/demo.toml");
  INFO(demo.status());
  REQUIRE(demo.ok());
  CHECK(demo->upstreams.size() == 2);
  CHECK(demo->find_upstream("mock-b")->port == 18002);
  const gateway::model_route* chat = demo->find_model("chat-default");
  REQUIRE(chat != nullptr);
  CHECK(chat->deployments[0].upstream == "mock-a");
  CHECK(chat->deployments[1].upstream == "mock-b");
  CHECK(chat->hedge.has_value());
  CHECK(demo->find_model("feedback-model")->deployments[0].upstream == "mock-a");
  CHECK(gateway::find_client(*demo, "demo-key-team-a")->tenant == "acme");
  CHECK(demo->options.validate().ok());

  absl::StatusOr<gateway::gateway_config> vllm = gateway::load_config(KEEL_GATEWAY_CONFIG_DIR "/vllm-openai.toml");
  INFO(vllm.status());
  REQUIRE(vllm.ok());
  CHECK(vllm->find_upstream("openai")->api_key_env == "OPENAI_API_KEY");
  CHECK(vllm->find_upstream("openai")->tls());
  CHECK(vllm->find_model("chat-default")->deployments[0].upstream == "local");
  CHECK(vllm->options.validate().ok());

  CHECK(gateway::load_config("/nonexistent/keel.toml").status().code() == absl::StatusCode::kNotFound);
}

#ifdef KEEL_GATEWAY_CLI
TEST_CASE("config: gateway --check-config says ok with the counts, or the error line with exit 2", "[config][cli]") {
  keel_service::temp_dir dir;
  {
    std::ofstream(dir.file("good.toml")) << base;
    std::ofstream(dir.file("bad.toml")) << with("deadlin = \"2s\"\n");
  }
  pid_t pid = keel_service::spawn_program({KEEL_GATEWAY_CLI, "--check-config", dir.file("good.toml")},
                                          dir.file("out.txt"), dir.file("err.txt"));
  CHECK(keel_service::wait_child(pid) == 0);
  CHECK(keel_service::read_file(dir.file("out.txt")) == dir.file("good.toml") + ": ok (2 upstreams, 1 models, 0 clients)\n");
  pid = keel_service::spawn_program({KEEL_GATEWAY_CLI, "--check-config", dir.file("bad.toml")}, dir.file("out.txt"),
                                    dir.file("err.txt"));
  CHECK(keel_service::wait_child(pid) == 2);
  CHECK(keel_service::read_file(dir.file("err.txt"))
            .starts_with(dir.file("bad.toml") + ":13:1: models.chat-default.deadlin: unknown key (did you mean 'deadline'?)"));
  CHECK(keel_service::read_file(dir.file("out.txt")).empty());
}
#endif

TEST_CASE("config: the serving mode and its bounds: fiber_threads, http_workers, the streaming class, whole", "[config]") {
  std::string text(base);
  text.replace(text.find("data_dir"), 0,
               "fiber_threads = 2\nhttp_workers = 4000\nhttp_queue = 50\nstreaming_slots = 3000\n"
               "streaming_queue = 10\nhedge_threads = 2\nbatch_workers = 0\n");
  text += "whole = \"60s\"\ndeadline = \"90s\"\n";
  const absl::StatusOr<gateway::gateway_config> c = gateway::parse_config(text, "config.toml");
  REQUIRE(c.ok());
  const gateway::gateway_options& o = c->options;
  CHECK(o.http_fiber_threads == 2);
  CHECK(o.http_threads == 4000);
  CHECK(o.http_queue == 50);
  CHECK(o.chat.slots == 3000);
  CHECK(o.chat.queue == 10);
  CHECK(o.chat.hedge_threads == 2);
  CHECK(o.batch_workers == 0);
  REQUIRE(c->find_model("chat-default") != nullptr);
  CHECK(c->find_model("chat-default")->whole == std::optional<keel::duration>(60s));
  CHECK(c->find_model("chat-default")->chat(o.chat).whole == 60s);

  auto gateway_key = [](std::string_view line) {
    std::string t(base);
    t.replace(t.find("data_dir"), 0, std::string(line) + "\n");
    return error_of(t);
  };
  CHECK(gateway_key("fiber_threads = 65") == "config.toml:2:17: gateway.fiber_threads: must be in [0, 64] (got 65)");
  CHECK(gateway_key("http_workers = 3") == "config.toml:2:16: gateway.http_workers: must be in [4, 1000000] (got 3)");
  CHECK(gateway_key("streaming_slots = 0") ==
        "config.toml:2:19: gateway.streaming_slots: must be in [1, 32767] (got 0)");
  CHECK(gateway_key("fibre_threads = 2").starts_with("config.toml:2:1: gateway.fibre_threads: unknown key (did you mean "
                                                     "'fiber_threads'?)"));
  CHECK(error_of(with("whole = \"0s\"\n")).starts_with("config.toml:13:9: models.chat-default.whole: "));
}

// libFuzzer target: keel's Prometheus text writer (keel/observe/prometheus.hpp)
// read back by a strict parser of the text exposition format (0.0.4) written
// here from the format's specification, sharing no code with the writer.
//
// A snapshot is built from the input: families of every type, help texts and
// label values of arbitrary bytes (quotes, backslashes, newlines, invalid
// UTF-8), numbers of arbitrary bits (NaN, infinities, subnormals). When the
// writer accepts the snapshot, its output must parse, and:
//
//   - every line is a HELP, a TYPE or a sample; text is valid UTF-8; label
//     values use only the escapes \\ \" \n, help texts only \\ \n;
//   - each family has one HELP and one TYPE, before its samples, and its
//     samples are contiguous; every sample belongs to the family declared;
//   - no two samples have the same name and label set (Prometheus drops the
//     scrape's duplicates), and no sample repeats a label name;
//   - histograms: every series has its le buckets non-decreasing, ending in
//     le="+Inf" equal to its _count; summaries: quantile labels in [0, 1];
//   - what reads back is what went in: label values and help texts that are
//     valid UTF-8 exactly, numbers exactly (NaN as NaN).
//
// A snapshot the writer refuses must leave the output untouched.
#include <algorithm>
#include <bit>
#include <charconv>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "check.hpp"
#include "keel/observe/prometheus.hpp"

namespace {

// ---- the independent reader --------------------------------------------------

bool valid_utf8(std::string_view s) {
  std::size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    std::size_t n;
    std::uint32_t cp;
    if (c < 0x80) {
      ++i;
      continue;
    } else if ((c & 0xE0) == 0xC0) {
      n = 2, cp = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
      n = 3, cp = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
      n = 4, cp = c & 0x07;
    } else {
      return false;
    }
    if (i + n > s.size()) return false;
    for (std::size_t k = 1; k < n; ++k) {
      const auto d = static_cast<unsigned char>(s[i + k]);
      if ((d & 0xC0) != 0x80) return false;
      cp = cp << 6 | (d & 0x3F);
    }
    const std::uint32_t min = n == 2 ? 0x80 : n == 3 ? 0x800 : 0x10000;
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
    i += n;
  }
  return true;
}

bool metric_name(std::string_view n) {
  if (n.empty()) return false;
  for (std::size_t i = 0; i < n.size(); ++i) {
    const char c = n[i];
    const bool alpha = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || c == ':';
    if (!alpha && !(i > 0 && c >= '0' && c <= '9')) return false;
  }
  return true;
}
bool label_name(std::string_view n) {
  if (n.empty()) return false;
  for (std::size_t i = 0; i < n.size(); ++i) {
    const char c = n[i];
    const bool alpha = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
    if (!alpha && !(i > 0 && c >= '0' && c <= '9')) return false;
  }
  return true;
}

// Go's ParseFloat as the format uses it, restricted to what a writer should
// emit: NaN, +Inf, -Inf, or a decimal with optional sign and exponent.
std::optional<double> number(std::string_view s) {
  if (s == "NaN") return std::nan("");
  if (s == "+Inf" || s == "Inf") return HUGE_VAL;
  if (s == "-Inf") return -HUGE_VAL;
  if (s.empty()) return std::nullopt;
  for (char c : s)
    if (!((c >= '0' && c <= '9') || c == '.' || c == 'e' || c == 'E' || c == '-' || c == '+')) return std::nullopt;
  std::string_view body = s[0] == '+' ? s.substr(1) : s;
  double v = 0;
  const auto r = std::from_chars(body.data(), body.data() + body.size(), v);
  if (r.ec != std::errc() || r.ptr != body.data() + body.size()) return std::nullopt;
  return v;
}

struct sample {
  std::string name{};
  std::vector<std::pair<std::string, std::string>> labels{};  // in written order
  double value = 0;
};
struct family {
  std::string name{}, help{}, type{};
  bool has_help = false, has_type = false;
  std::vector<sample> samples{};
};

// Unescapes a quoted label value or a help text; `quotes`: label value rules.
std::optional<std::string> unescape(std::string_view s, bool quotes) {
  std::string out;
  for (std::size_t i = 0; i < s.size(); ++i) {
    if (s[i] != '\\') {
      out += s[i];
      continue;
    }
    if (++i == s.size()) return std::nullopt;
    if (s[i] == '\\') out += '\\';
    else if (s[i] == 'n') out += '\n';
    else if (s[i] == '"' && quotes) out += '"';
    else return std::nullopt;
  }
  return out;
}

// Parses the whole text; families in order of appearance. Aborts the input
// (a failed check) on anything the format does not allow.
std::vector<family> parse(std::string_view text) {
  std::vector<family> out;
  KEEL_FUZZ_CHECK(valid_utf8(text), "the exposition is valid UTF-8");
  KEEL_FUZZ_CHECK(text.empty() || text.back() == '\n', "the exposition ends with a newline");
  std::set<std::string> seen_families;
  std::set<std::pair<std::string, std::vector<std::pair<std::string, std::string>>>> seen_series;
  auto belongs = [](const family& f, std::string_view name) {
    if (name == f.name) return f.type != "histogram";
    const auto ends = [&](std::string_view suffix) {
      return name.size() == f.name.size() + suffix.size() && name.substr(0, f.name.size()) == f.name &&
             name.substr(f.name.size()) == suffix;
    };
    if (f.type == "histogram") return ends("_bucket") || ends("_sum") || ends("_count");
    if (f.type == "summary") return ends("_sum") || ends("_count");
    return false;
  };
  while (!text.empty()) {
    const std::size_t eol = text.find('\n');
    const std::string_view line = text.substr(0, eol);
    text.remove_prefix(eol + 1);
    KEEL_FUZZ_CHECK(!line.empty(), "no empty lines");
    if (line.substr(0, 2) == "# ") {
      const bool help = line.substr(2, 5) == "HELP ", type = line.substr(2, 5) == "TYPE ";
      KEEL_FUZZ_CHECK(help || type, "a comment line is HELP or TYPE");
      std::string_view rest = line.substr(7);
      const std::size_t sp = rest.find(' ');
      KEEL_FUZZ_CHECK(sp != std::string_view::npos, "HELP/TYPE: name, space, text");
      const std::string name(rest.substr(0, sp));
      const std::string_view arg = rest.substr(sp + 1);
      KEEL_FUZZ_CHECK(metric_name(name), "HELP/TYPE names a valid metric name");
      if (out.empty() || out.back().name != name) {
        KEEL_FUZZ_CHECK(seen_families.insert(name).second, "a family appears once, its lines together");
        out.push_back({.name = name});
      }
      family& f = out.back();
      KEEL_FUZZ_CHECK(f.samples.empty(), "HELP and TYPE come before the family's samples");
      if (help) {
        KEEL_FUZZ_CHECK(!f.has_help, "one HELP per family");
        const std::optional<std::string> h = unescape(arg, false);
        KEEL_FUZZ_CHECK(h.has_value(), "help text escapes only \\\\ and \\n");
        f.help = *h, f.has_help = true;
      } else {
        KEEL_FUZZ_CHECK(!f.has_type, "one TYPE per family");
        KEEL_FUZZ_CHECK(arg == "counter" || arg == "gauge" || arg == "histogram" || arg == "summary" ||
                            arg == "untyped",
                        "TYPE is a known type");
        f.type = std::string(arg), f.has_type = true;
      }
      continue;
    }
    KEEL_FUZZ_CHECK(line[0] != '#', "no other comments");
    // name [{labels}] value
    sample s;
    std::size_t i = 0;
    while (i < line.size() && line[i] != '{' && line[i] != ' ') ++i;
    s.name = std::string(line.substr(0, i));
    KEEL_FUZZ_CHECK(metric_name(s.name), "a sample's name is a valid metric name");
    if (i < line.size() && line[i] == '{') {
      ++i;
      std::set<std::string> names;
      while (true) {
        KEEL_FUZZ_CHECK(i < line.size(), "labels are closed");
        if (line[i] == '}') {
          ++i;
          break;
        }
        if (!s.labels.empty()) {
          KEEL_FUZZ_CHECK(line[i] == ',', "labels are comma-separated");
          ++i;
        }
        std::size_t j = i;
        while (j < line.size() && line[j] != '=') ++j;
        KEEL_FUZZ_CHECK(j + 1 < line.size() && line[j + 1] == '"', "label=\"value\"");
        std::string lname(line.substr(i, j - i));
        KEEL_FUZZ_CHECK(label_name(lname), "a valid label name");
        KEEL_FUZZ_CHECK(names.insert(lname).second, "no label name twice in a sample");
        std::size_t k = j + 2;
        while (k < line.size() && line[k] != '"') k += line[k] == '\\' ? 2 : 1;
        KEEL_FUZZ_CHECK(k < line.size(), "a label value is closed by an unescaped quote");
        const std::optional<std::string> v = unescape(line.substr(j + 2, k - j - 2), true);
        KEEL_FUZZ_CHECK(v.has_value(), "label values escape only \\\\ \\\" \\n");
        s.labels.emplace_back(std::move(lname), *v);
        i = k + 1;
      }
    }
    KEEL_FUZZ_CHECK(i < line.size() && line[i] == ' ', "a space before the value");
    const std::string_view value = line.substr(i + 1);
    KEEL_FUZZ_CHECK(value.find(' ') == std::string_view::npos, "no timestamp is written");
    const std::optional<double> v = number(value);
    KEEL_FUZZ_CHECK(v.has_value(), "the value is a number");
    s.value = *v;
    KEEL_FUZZ_CHECK(!out.empty() && out.back().has_type && out.back().has_help, "samples follow HELP and TYPE");
    KEEL_FUZZ_CHECK(belongs(out.back(), s.name), "a sample belongs to the family declared before it");
    auto sorted = s.labels;
    std::sort(sorted.begin(), sorted.end());
    KEEL_FUZZ_CHECK(seen_series.emplace(s.name, sorted).second,
                    "no two samples with the same name and labels (Prometheus refuses duplicates)");
    out.back().samples.push_back(std::move(s));
  }
  return out;
}

// ---- building a snapshot from the input ----------------------------------------

double any_double(keel::fuzz::reader& in) {
  const std::uint8_t how = in.u8();
  if (how < 128) return static_cast<double>(how) / 4;  // small values, often integers
  return std::bit_cast<double>(in.u64());
}

std::string bytes(keel::fuzz::reader& in) {
  const std::uint8_t how = in.u8();
  std::string s(in.take(how % 24));
  if (how & 0x80) {  // mostly the bytes that need care
    static constexpr std::string_view tricky = "\\\"\n{}=, a\xff\xc3\xa9\xed\xa0\x80\xef\xbf\xbd";
    for (char& c : s) c = tricky[static_cast<unsigned char>(c) % tricky.size()];
  }
  return s;
}

keel::metrics_snapshot build(keel::fuzz::reader& in) {
  static const char* const names[] = {"a", "b", "a_sum", "a_count", "a_bucket", "b_total", "x:y", "9bad", ""};
  static const char* const labels[] = {"l", "m", "le", "quantile", "__x", "n1", "bad-name"};
  keel::metrics_snapshot snap;
  const int families = 1 + in.u8() % 3;
  for (int fi = 0; fi < families; ++fi) {
    keel::metric_family_snapshot f;
    const std::uint8_t sel = in.u8();
    f.name = names[sel % std::size(names)];
    f.type = static_cast<keel::metric_type>((sel >> 4) % 4);
    f.help = (sel & 0x40) ? "" : bytes(in);
    if (f.help.empty() && (sel & 0x80)) f.help = "h";
    const int nl = in.u8() % 3;
    for (int i = 0; i < nl; ++i) f.label_names.push_back(labels[in.u8() % std::size(labels)]);
    if (f.type == keel::metric_type::histogram) {
      const int nb = in.u8() % 4;
      double b = -1;
      for (int i = 0; i < nb; ++i) f.bounds.push_back(b += any_double(in) + 0.5);
    }
    const int ns = in.u8() % 4;
    for (int si = 0; si < ns; ++si) {
      keel::metric_series s;
      for (std::size_t i = 0; i < f.label_names.size(); ++i) s.labels.push_back(bytes(in));
      s.value = any_double(in);
      if (f.type == keel::metric_type::histogram) {
        for (std::size_t i = 0; i <= f.bounds.size(); ++i) s.buckets.push_back(in.u8());
      }
      if (f.type == keel::metric_type::summary) {
        const int nq = in.u8() % 3;
        for (int i = 0; i < nq; ++i) s.quantiles.push_back({.quantile = in.u8() / 200.0, .value = any_double(in)});
        s.count = in.u8();
      }
      s.sum = any_double(in);
      f.series.push_back(std::move(s));
    }
    snap.families.push_back(std::move(f));
  }
  return snap;
}

bool same_number(double a, double b) { return (std::isnan(a) && std::isnan(b)) || a == b; }

std::string label_of(const sample& s, std::string_view name) {
  for (const auto& [n, v] : s.labels)
    if (n == name) return v;
  return "<absent>";
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  keel::fuzz::reader in(data, size);
  const keel::metrics_snapshot snap = build(in);
  std::string out = "kept";
  const absl::Status s = keel::append_prometheus_text(snap, out);
  if (!s.ok()) {
    if (std::getenv("KEEL_FUZZ_DUMP") != nullptr) std::fprintf(stderr, "refused: %s\n", std::string(s.message()).c_str());
    KEEL_FUZZ_CHECK(out == "kept", "a refused snapshot writes nothing");
    KEEL_FUZZ_CHECK(s.code() == absl::StatusCode::kInvalidArgument, "refusals are InvalidArgument");
    return 0;
  }
  if (std::getenv("KEEL_FUZZ_DUMP") != nullptr) std::fwrite(out.data() + 4, 1, out.size() - 4, stderr);
  const std::vector<family> fams = parse(std::string_view(out).substr(4));

  // What went in comes back.
  std::size_t nonempty = 0;
  for (const auto& f : snap.families) {
    const family* got = nullptr;
    for (const family& g : fams)
      if (g.name == f.name) got = &g;
    KEEL_FUZZ_CHECK(got != nullptr, "every family is written");
    ++nonempty;
    KEEL_FUZZ_CHECK(got->type == keel::to_string(f.type), "the family's type");
    if (valid_utf8(f.help)) KEEL_FUZZ_CHECK(got->help == f.help, "a valid UTF-8 help text reads back exactly");
    for (const keel::metric_series& series : f.series) {
      // The samples of this series: those whose family labels match it.
      std::vector<const sample*> mine;
      bool comparable = true;
      for (const std::string& v : series.labels) comparable = comparable && valid_utf8(v);
      if (!comparable) continue;  // replaced bytes: uniqueness and syntax checked above
      for (const sample& smp : got->samples) {
        bool match = true;
        for (std::size_t i = 0; i < f.label_names.size(); ++i)
          match = match && label_of(smp, f.label_names[i]) == series.labels[i];
        if (match) mine.push_back(&smp);
      }
      switch (f.type) {
        case keel::metric_type::counter:
        case keel::metric_type::gauge:
          KEEL_FUZZ_CHECK(mine.size() == 1 && same_number(mine[0]->value, series.value), "the value reads back");
          break;
        case keel::metric_type::histogram: {
          KEEL_FUZZ_CHECK(mine.size() == f.bounds.size() + 3, "bounds + 1 buckets, _sum, _count");
          double last = 0, count = -1, sum = 0;
          std::size_t bucket = 0;
          for (const sample* p : mine) {
            if (p->name == f.name + "_bucket") {
              const std::optional<double> le = number(label_of(*p, "le"));
              KEEL_FUZZ_CHECK(le.has_value(), "a bucket has a numeric le");
              const double want = bucket < f.bounds.size() ? f.bounds[bucket] : HUGE_VAL;
              KEEL_FUZZ_CHECK(*le == want, "le reads back as the bound");
              KEEL_FUZZ_CHECK(p->value >= last, "buckets are cumulative");
              last = p->value;
              ++bucket;
            } else if (p->name == f.name + "_count") {
              count = p->value;
            } else {
              sum = p->value;
            }
          }
          KEEL_FUZZ_CHECK(count == last, "_count equals the +Inf bucket");
          KEEL_FUZZ_CHECK(same_number(sum, series.sum), "_sum reads back");
          break;
        }
        case keel::metric_type::summary:
          KEEL_FUZZ_CHECK(mine.size() == series.quantiles.size() + 2, "quantiles, _sum, _count");
          for (const sample* p : mine) {
            if (p->name != f.name) continue;
            const std::optional<double> q = number(label_of(*p, "quantile"));
            KEEL_FUZZ_CHECK(q.has_value() && *q >= 0 && *q <= 1, "a quantile label in [0, 1]");
          }
          break;
      }
    }
  }
  KEEL_FUZZ_CHECK(fams.size() == nonempty, "no family is written that was not given");
  return 0;
}

// gateway/text.hpp — absl::StrCat that also takes std::string_view.
//
// Debian's abseil has its own absl::string_view (keel/core/status.hpp explains);
// gateway::cat converts std::string_view arguments on the way in.
//
// Example:
//
//   std::string_view tenant = "acme";
//   std::string s = gateway::cat("tenant ", tenant, " has ", 3, " jobs");
//
// Thread-safety: a pure function.
#pragma once

#include <string>
#include <string_view>
#include <type_traits>

#include "absl/strings/str_cat.h"

namespace gateway {

namespace detail {
template <class T>
decltype(auto) absl_arg(const T& v) {
  if constexpr (std::is_same_v<T, std::string_view>) {
    return absl::string_view(v.data(), v.size());
  } else {
    return (v);
  }
}
}  // namespace detail

template <class... Args>
[[nodiscard]] std::string cat(const Args&... args) {
  return absl::StrCat(detail::absl_arg(args)...);
}

}  // namespace gateway

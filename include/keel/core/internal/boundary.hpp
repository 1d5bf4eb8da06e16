// keel/core/internal/boundary.hpp — where user code is called: a provider, a
// fallback, a fan-out worker, a hedged attempt, a once decision. keel does
// not throw, and a provider that throws must not unwind through keel's
// bookkeeping (permits, leases, attempt counts), so every such call goes
// through call_user(), which turns an exception into absl::UnknownError:
// classified ambiguous (it may have had its effect), so retried only when
// the operation is repeatable.
//
//   R r = keel::detail::call_user<R>("provider", provider, attempt);
//   R s = keel::detail::call_provider<R>("fallback", provider, attempt);  // with or without the attempt
//   // "keel: provider threw: <what()>" when it threw
//
// Thread-safety: as safe as the callable.
#pragma once

#include <exception>
#include <functional>
#include <string_view>
#include <type_traits>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "keel/core/call.hpp"
#include "keel/core/status.hpp"

namespace keel::detail {

template <class R, class F, class... Args>
R call_user(std::string_view who, F&& f, Args&&... args) noexcept {
  try {
    return R(std::invoke(std::forward<F>(f), std::forward<Args>(args)...));
  } catch (const std::exception& e) {
    return R(absl::UnknownError(absl::StrCat("keel: ", to_absl(who), " threw: ", e.what())));
  } catch (...) {
    return R(absl::UnknownError(absl::StrCat("keel: ", to_absl(who), " threw a non-standard exception")));
  }
}

// A provider takes its attempt, or nothing.
template <class R, class Provider>
R call_provider(std::string_view who, Provider& provider, const attempt& a) noexcept {
  if constexpr (std::is_invocable_v<Provider&, const attempt&>) {
    return call_user<R>(who, provider, a);
  } else {
    return call_user<R>(who, provider);
  }
}

}  // namespace keel::detail

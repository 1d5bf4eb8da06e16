// Precompiled into each test area (tests/CMakeLists.txt): the third-party
// and standard headers nearly every test translation unit parses. Parsing
// them once per area instead of once per file is the cheapest cut to CI's
// compile time, which is most of its run. Test files still include what
// they use; this only makes that cheaper.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "support/catch.hpp"

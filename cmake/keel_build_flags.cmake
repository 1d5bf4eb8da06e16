# Flags for keel's own tests, examples and benchmarks (never for consumers).
add_library(keel_build_flags INTERFACE)
target_compile_options(keel_build_flags INTERFACE -Wall -Wextra -Wpedantic
  $<$<BOOL:${KEEL_WERROR}>:-Werror>)
if(KEEL_SANITIZE)
  # Line tables are all a sanitizer report needs, at a fraction of -g's cost.
  target_compile_options(keel_build_flags INTERFACE -fsanitize=${KEEL_SANITIZE} -fno-omit-frame-pointer
    $<IF:$<CXX_COMPILER_ID:Clang>,-gline-tables-only,-g1>)
  target_link_options(keel_build_flags INTERFACE -fsanitize=${KEEL_SANITIZE})
  if(KEEL_SANITIZE MATCHES "undefined")
    target_compile_options(keel_build_flags INTERFACE -fno-sanitize-recover=undefined)
    # clang 14's check of indirect calls' function types cannot compile C++20
    # coroutines (keel::asio's tests co_await a run): "Cannot represent a
    # difference across sections".
    target_compile_options(keel_build_flags INTERFACE $<$<CXX_COMPILER_ID:Clang>:-fno-sanitize=function>)
  endif()
endif()

# Flags for keel's own tests, examples and benchmarks (never for consumers).
add_library(keel_build_flags INTERFACE)
target_compile_options(keel_build_flags INTERFACE -Wall -Wextra -Wpedantic
  $<$<BOOL:${KEEL_WERROR}>:-Werror>)
if(KEEL_SANITIZE)
  target_compile_options(keel_build_flags INTERFACE -fsanitize=${KEEL_SANITIZE} -fno-omit-frame-pointer -g)
  target_link_options(keel_build_flags INTERFACE -fsanitize=${KEEL_SANITIZE})
  if(KEEL_SANITIZE MATCHES "undefined")
    target_compile_options(keel_build_flags INTERFACE -fno-sanitize-recover=undefined)
  endif()
endif()

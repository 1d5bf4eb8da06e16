# keel_fuzz_targets(<out-var>): the names listed in tests/fuzz/targets.txt
# (comments and blank lines dropped). Used by the libFuzzer build
# (tests/fuzz/CMakeLists.txt) and the corpus replay test (tests/CMakeLists.txt).
function(keel_fuzz_targets out)
  set(list_file ${CMAKE_CURRENT_FUNCTION_LIST_DIR}/targets.txt)
  set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS ${list_file})
  file(STRINGS ${list_file} lines)
  set(names)
  foreach(line IN LISTS lines)
    string(REGEX REPLACE "#.*" "" line "${line}")
    string(STRIP "${line}" line)
    if(line STREQUAL "")
      continue()
    endif()
    if(NOT line MATCHES "^[a-z0-9_]+$")
      message(FATAL_ERROR "tests/fuzz/targets.txt: '${line}' is not a target name ([a-z0-9_]+)")
    endif()
    list(APPEND names ${line})
  endforeach()
  set(${out} ${names} PARENT_SCOPE)
endfunction()

# The libraries every target links: keel and each backend client found (the
# store targets need theirs; linking all keeps targets.txt one name a line).
function(keel_fuzz_link target)
  target_link_libraries(${target} PRIVATE keel::keel keel_build_flags)
  # gateway_request reads the example gateway's front door (header-only, on Boost.Beast).
  target_include_directories(${target} PRIVATE ${PROJECT_SOURCE_DIR}/examples/gateway)
  find_package(Boost 1.74 REQUIRED)
  target_link_libraries(${target} PRIVATE Boost::headers)
  foreach(backend sqlite postgres redis)
    if(TARGET keel::${backend})
      target_link_libraries(${target} PRIVATE keel::${backend})
    endif()
  endforeach()
endfunction()

# Small helpers so that every directory's CMakeLists.txt reads as a list of declarations.
#
#   kvpool_cc_library(NAME foo SRCS foo.cc HDRS foo.h DEPS absl::status)
#   kvpool_cc_binary(NAME kvpoold SRCS main.cc DEPS kvpool_server)
#   kvpool_cc_test(NAME foo_test SRCS foo_test.cc DEPS foo [LABELS slow] [ARGS ...])
#   kvpool_cuda_library(NAME kernels_cuda SRCS quantize.cu DEPS ...)   # only when nvcc exists

include(CMakeParseArguments)

# Include directories are private per target. A library's HDRS are staged (as symbolic links,
# under their repository paths) in build/include/<target>/, and that folder is the only include
# directory the library exports: a target sees the headers of the libraries it depends on and
# nothing else, so an include of a part it does not link fails to compile. The target's own
# sources see the source tree. (tests/layering_test.py checks the layer map itself.)
function(kvpool_stage_headers target out_dir)
  set(stage ${PROJECT_BINARY_DIR}/include/${target})
  foreach(header ${ARGN})
    get_filename_component(abs ${header} ABSOLUTE BASE_DIR ${CMAKE_CURRENT_SOURCE_DIR})
    file(RELATIVE_PATH rel ${PROJECT_SOURCE_DIR} ${abs})
    get_filename_component(dir ${stage}/${rel} DIRECTORY)
    file(MAKE_DIRECTORY ${dir})
    file(CREATE_LINK ${abs} ${stage}/${rel} SYMBOLIC)
  endforeach()
  file(MAKE_DIRECTORY ${stage})
  set(${out_dir} ${stage} PARENT_SCOPE)
endfunction()

function(kvpool_cc_library)
  cmake_parse_arguments(KV "" "NAME" "SRCS;HDRS;DEPS;PRIVATE_DEPS" ${ARGN})
  kvpool_stage_headers(${KV_NAME} stage ${KV_HDRS})
  if(KV_SRCS)
    add_library(${KV_NAME} STATIC ${KV_SRCS} ${KV_HDRS})
    target_include_directories(${KV_NAME} PUBLIC ${stage} PRIVATE ${PROJECT_SOURCE_DIR})
    target_link_libraries(${KV_NAME} PUBLIC ${KV_DEPS} PRIVATE ${KV_PRIVATE_DEPS})
    target_compile_options(${KV_NAME} PRIVATE ${KVPOOL_CXX_WARNINGS})
  else()
    add_library(${KV_NAME} INTERFACE)
    target_include_directories(${KV_NAME} INTERFACE ${stage})
    target_link_libraries(${KV_NAME} INTERFACE ${KV_DEPS})
  endif()
endfunction()

function(kvpool_cc_binary)
  cmake_parse_arguments(KV "" "NAME;OUTPUT_NAME" "SRCS;DEPS" ${ARGN})
  add_executable(${KV_NAME} ${KV_SRCS})
  target_include_directories(${KV_NAME} PRIVATE ${PROJECT_SOURCE_DIR})
  target_link_libraries(${KV_NAME} PRIVATE ${KV_DEPS})
  target_compile_options(${KV_NAME} PRIVATE ${KVPOOL_CXX_WARNINGS})
  if(KV_OUTPUT_NAME)
    set_target_properties(${KV_NAME} PROPERTIES OUTPUT_NAME ${KV_OUTPUT_NAME})
  endif()
  set_target_properties(${KV_NAME} PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${PROJECT_BINARY_DIR}/bin)
endfunction()

function(kvpool_cc_test)
  cmake_parse_arguments(KV "" "NAME;TIMEOUT" "SRCS;DEPS;LABELS;ARGS;ENV" ${ARGN})
  add_executable(${KV_NAME} ${KV_SRCS})
  target_include_directories(${KV_NAME} PRIVATE ${PROJECT_SOURCE_DIR})
  target_link_libraries(${KV_NAME} PRIVATE ${KV_DEPS} GTest::gtest GTest::gmock GTest::gtest_main)
  target_compile_options(${KV_NAME} PRIVATE ${KVPOOL_CXX_WARNINGS})
  target_compile_definitions(${KV_NAME} PRIVATE
    KVPOOL_SOURCE_DIR="${PROJECT_SOURCE_DIR}"
    KVPOOL_BINARY_DIR="${PROJECT_BINARY_DIR}"
    KVPOOL_FIXTURES_DIR="${KVPOOL_FIXTURES_DIR}")
  set_target_properties(${KV_NAME} PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${PROJECT_BINARY_DIR}/tests)
  add_test(NAME ${KV_NAME} COMMAND ${KV_NAME} ${KV_ARGS})
  if(NOT KV_TIMEOUT)
    set(KV_TIMEOUT 600)
  endif()
  set_tests_properties(${KV_NAME} PROPERTIES TIMEOUT ${KV_TIMEOUT})
  if(KV_LABELS)
    set_tests_properties(${KV_NAME} PROPERTIES LABELS "${KV_LABELS}")
  endif()
  if(KV_ENV)
    set_tests_properties(${KV_NAME} PROPERTIES ENVIRONMENT "${KV_ENV}")
  endif()
endfunction()

function(kvpool_cuda_library)
  cmake_parse_arguments(KV "" "NAME" "SRCS;HDRS;DEPS" ${ARGN})
  kvpool_stage_headers(${KV_NAME} stage ${KV_HDRS})
  add_library(${KV_NAME} STATIC ${KV_SRCS} ${KV_HDRS})
  target_include_directories(${KV_NAME} PUBLIC ${stage} PRIVATE ${PROJECT_SOURCE_DIR})
  target_link_libraries(${KV_NAME} PUBLIC ${KV_DEPS} CUDA::cudart_static)
  set_target_properties(${KV_NAME} PROPERTIES CUDA_SEPARABLE_COMPILATION OFF
                                              POSITION_INDEPENDENT_CODE ON)
  target_compile_options(${KV_NAME} PRIVATE
    $<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr -Xcompiler=-Wall,-Wextra --fmad=false>
    $<$<COMPILE_LANGUAGE:CXX>:${KVPOOL_CXX_WARNINGS}>)
endfunction()

#   kvpool_fuzz_target(NAME safetensors_fuzz SRCS safetensors_fuzz.cc DEPS kvpool_formats)
# A fuzz target (tests/fuzz/README.md) defining LLVMFuzzerTestOneInput, built into bin/fuzz/.
# With KVPOOL_FUZZ (clang) it links libFuzzer; otherwise it links the replay driver and CTest
# replays its corpus, tests/fuzz/corpus/NAME (label fuzz-replay).
function(kvpool_fuzz_target)
  cmake_parse_arguments(KV "" "NAME" "SRCS;DEPS" ${ARGN})
  add_executable(${KV_NAME} ${KV_SRCS})
  target_include_directories(${KV_NAME} PRIVATE ${PROJECT_SOURCE_DIR})
  target_link_libraries(${KV_NAME} PRIVATE ${KV_DEPS})
  target_compile_options(${KV_NAME} PRIVATE ${KVPOOL_CXX_WARNINGS})
  set_target_properties(${KV_NAME} PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${PROJECT_BINARY_DIR}/bin/fuzz)
  if(KVPOOL_FUZZ)
    target_link_options(${KV_NAME} PRIVATE -fsanitize=fuzzer)
  else()
    target_sources(${KV_NAME} PRIVATE ${PROJECT_SOURCE_DIR}/tests/fuzz/replay_main.cc)
    add_test(NAME ${KV_NAME}_replay
      COMMAND ${KV_NAME} ${PROJECT_SOURCE_DIR}/tests/fuzz/corpus/${KV_NAME})
    set_tests_properties(${KV_NAME}_replay PROPERTIES LABELS fuzz-replay TIMEOUT 600)
  endif()
endfunction()

// Catch2's runner, plus options of ours in front of Catch's own:
//   kvevict_tests --cuda-or-skip [catch args]   exits 77 without running anything where no CUDA
//     device is usable (ctest's SKIP_RETURN_CODE: the `cuda` ctest then reports Skipped, not Passed);
//   kvevict_tests --long-or-skip [catch args]   exits 77 unless KVEVICT_LONG_TESTS=1 (the ctests
//     labelled `long`: every allocation-failure point instead of a fixed-seed sample, see
//     tests/CMakeLists.txt).
// One intra-op thread: no test here measures threading, and on a machine busy with other work
// (ctest -j, other builds) more threads per test process only wait on each other.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include <ATen/Context.h>
#include <ATen/Parallel.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

int main(int argc, char** argv) {
  at::set_num_threads(1);
  if (argc > 1 && std::strcmp(argv[1], "--cuda-or-skip") == 0) {
    if (!at::hasCUDA()) {
      std::printf("no CUDA device: the [cuda] tests are skipped\n");
      return 77;
    }
    argv[1] = argv[0];
    return Catch::Session().run(argc - 1, argv + 1);
  }
  if (argc > 1 && std::strcmp(argv[1], "--long-or-skip") == 0) {
    const char* on = std::getenv("KVEVICT_LONG_TESTS");
    if (!on || std::strcmp(on, "1") != 0) {
      std::printf("KVEVICT_LONG_TESTS is not 1: the long run is skipped\n");
      return 77;
    }
    argv[1] = argv[0];
    return Catch::Session().run(argc - 1, argv + 1);
  }
  return Catch::Session().run(argc, argv);
}

// Catch2's runner, plus one option of ours in front of Catch's own:
//   kvevict_tests --cuda-or-skip [catch args]   exits 77 without running anything where no CUDA
// device is usable (ctest's SKIP_RETURN_CODE: the `cuda` ctest then reports Skipped, not Passed).
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include <ATen/Context.h>

#include <cstdio>
#include <cstring>

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "--cuda-or-skip") == 0) {
    if (!at::hasCUDA()) {
      std::printf("no CUDA device: the [cuda] tests are skipped\n");
      return 77;
    }
    argv[1] = argv[0];
    return Catch::Session().run(argc - 1, argv + 1);
  }
  return Catch::Session().run(argc, argv);
}

// The GPU programs of tests/gpu in a build without --config=cuda.
#include <cstdio>

int main() {
  std::printf("SKIP: built without CUDA (bazel build --config=cuda //tests/gpu/...)\n");
  return 0;
}

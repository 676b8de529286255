// transpose_bench — ckpt::CopyRegion with a permuted source layout (what an
// AOA transpose, `a^T -> b` or `permute=`, costs per copy) against memcpy of
// the same destination bytes, measured alternately in the same run, one
// thread. Buffers are page-aligned and faulted in before timing; medians.
//
// GB/s = 10^9 destination bytes per second.
//
// Usage: transpose_bench [--reps=N]
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "core/base/box.h"
#include "core/exec/copy.h"
#include "core/base/dtype.h"

namespace ckpt {
namespace {

uint8_t* AllocTouched(size_t n) {
  void* p = ::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    std::perror("transpose_bench: mmap");
    std::exit(1);
  }
  std::memset(p, 0x5a, n);
  return static_cast<uint8_t*>(p);
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Case {
  std::string name, what;
  StoredLayout src, dst;
  Box region;
};

// A source tensor of `src_shape` seen through `perm` (box in the permuted
// coordinates); the destination is `dst_box` of the permuted tensor.
Case Make(std::string name, std::string what, DType sdt, Shape src_shape, std::vector<int> perm,
          Box dst_box, DType ddt) {
  Case c;
  c.name = std::move(name);
  c.what = std::move(what);
  Shape pshape;
  for (int a : perm) pshape.push_back(src_shape[a]);
  c.src = StoredLayout::Whole(Box{Shape(pshape.size(), 0), pshape}, sdt);
  // Storage axis k (source axis k) is permuted axis j with perm[j] == k.
  c.src.perm.resize(perm.size());
  for (size_t j = 0; j < perm.size(); ++j) c.src.perm[perm[j]] = static_cast<int>(j);
  c.dst = StoredLayout::Whole(dst_box, ddt);
  c.region = dst_box;
  return c;
}

int Main(int argc, char** argv) {
  int reps = 9;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a.rfind("--reps=", 0) == 0) {
      reps = std::max(1, std::atoi(a.c_str() + 7));
    } else {
      std::fprintf(stderr, "usage: transpose_bench [--reps=N]\n");
      return 2;
    }
  }
  std::vector<Case> cases;
  cases.push_back(Make("transpose-f32-64MiB", "F32 [4096,4096]^T, whole", DType::kF32, {4096, 4096},
                       {1, 0}, Box{{0, 0}, {4096, 4096}}, DType::kF32));
  cases.push_back(Make("transpose-f32-tp-cols", "F32 [4096,4096]^T, column half (= source rows)",
                       DType::kF32, {4096, 4096}, {1, 0}, Box{{0, 2048}, {4096, 2048}},
                       DType::kF32));
  cases.push_back(Make("transpose-f32-tp-rows", "F32 [4096,4096]^T, row half (= source columns)",
                       DType::kF32, {4096, 4096}, {1, 0}, Box{{2048, 0}, {2048, 4096}},
                       DType::kF32));
  cases.push_back(Make("transpose-bf16-f32", "BF16 [4096,4096]^T -> F32 (cast)", DType::kBF16,
                       {4096, 4096}, {1, 0}, Box{{0, 0}, {4096, 4096}}, DType::kF32));
  cases.push_back(Make("permute-3d-f32", "F32 [64,256,256] permute [2,0,1]", DType::kF32,
                       {64, 256, 256}, {2, 0, 1}, Box{{0, 0, 0}, {256, 64, 256}}, DType::kF32));
  const size_t kBytes = size_t{128} << 20;
  uint8_t* src = AllocTouched(kBytes);
  uint8_t* dst = AllocTouched(kBytes);
  std::printf("%-24s %10s %12s %12s %7s\n", "case", "dst", "GB/s", "memcpy GB/s", "ratio");
  for (const Case& c : cases) {
    const uint64_t n = static_cast<uint64_t>(c.dst.num_bytes());
    std::vector<double> t_copy, t_mem;
    for (int r = 0; r < reps; ++r) {
      auto t0 = std::chrono::steady_clock::now();
      CopyRegion(c.src, src, c.dst, dst, c.region);
      auto t1 = std::chrono::steady_clock::now();
      std::memcpy(dst, src, n);
      auto t2 = std::chrono::steady_clock::now();
      t_copy.push_back(std::chrono::duration<double>(t1 - t0).count());
      t_mem.push_back(std::chrono::duration<double>(t2 - t1).count());
    }
    const double g = n / Median(t_copy) / 1e9, m = n / Median(t_mem) / 1e9;
    std::printf("%-24s %7.0f MiB %12.2f %12.2f %7.2f   %s\n", c.name.c_str(), n / 1048576.0, g, m,
                g / m, c.what.c_str());
  }
  return 0;
}

}  // namespace
}  // namespace ckpt

int main(int argc, char** argv) { return ckpt::Main(argc, argv); }

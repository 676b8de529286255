// What a request is charged (server/policy/policy.h CheckRequestLimits) and
// how an asynchronous save's copy is packed (server/delivery/mapped_segment.h
// PackedOffsets): the bytes the daemon maps or copies, not those declared.
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/delivery/mapped_segment.h"
#include "server/policy/policy.h"

namespace ckptd {
namespace {

using ::testing::HasSubstr;

v1::Target F32(const std::string& name, int64_t n, uint64_t dest_offset, bool host = false) {
  v1::Target t;
  t.set_name(name);
  t.set_dtype("F32");
  t.add_global_shape(n);
  t.add_offset(0);
  t.add_shape(n);
  t.set_dest_offset(dest_offset);
  t.set_dest_host(host);
  return t;
}

absl::StatusOr<uint64_t> Charge(const std::vector<v1::Target>& targets, Policy::Mapped mapped,
                                uint64_t max_request_bytes = 256ull << 30) {
  DaemonConfig config;
  config.limits.max_request_bytes = max_request_bytes;
  Policy policy(config);
  google::protobuf::RepeatedPtrField<v1::Target> field(targets.begin(), targets.end());
  return policy.CheckRequestLimits("rank 0", field, 1, 0, 0, mapped);
}

TEST(Charge, MappedTargetsCostTheirPagesEachOnce) {
  // Two 4-byte targets in page 0, one straddling pages 1 and 2, one far away.
  const std::vector<v1::Target> t = {F32("a", 1, 0), F32("b", 1, 100), F32("c", 4, 8190),
                                     F32("d", 1, 1 << 20)};
  EXPECT_EQ(*Charge(t, Policy::Mapped::kAll), 4 * 4096u);
  // Not mapped (stream, process memory): their bytes.
  EXPECT_EQ(*Charge(t, Policy::Mapped::kNone), 4u + 4 + 16 + 4);
  // cuda_ipc: only dest_host targets are mapped.
  EXPECT_EQ(*Charge({F32("h", 1, 0, true), F32("dev", 1000, 0)}, Policy::Mapped::kHostOnly),
            4096u + 4000);
}

TEST(Charge, ASpanFarLargerThanItsPagesIsRefusedNamingBoth) {
  const uint64_t six_gib = 6ull << 30;
  auto r = Charge({F32("w", 1, six_gib - 4)}, Policy::Mapped::kAll);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("rank 0: the targets span 6442450944 bytes"));
  EXPECT_THAT(r.status().message(), HasSubstr("fill only 4096"));
  // Up to 8x the pages plus 1 GiB is accepted (gaps between tensors).
  EXPECT_TRUE(Charge({F32("w", 1, (1ull << 30) - 4)}, Policy::Mapped::kAll).ok());
  EXPECT_TRUE(Charge({F32("w", 1 << 28, 0), F32("x", 1, 9ull << 30)}, Policy::Mapped::kAll).ok());
  EXPECT_FALSE(Charge({F32("w", 1 << 28, 0), F32("x", 1, 10ull << 30)}, Policy::Mapped::kAll).ok());
  // Streams map nothing: no span to check.
  EXPECT_TRUE(Charge({F32("w", 1, six_gib - 4)}, Policy::Mapped::kNone).ok());
}

TEST(Charge, PagesCountAgainstMaxRequestBytes) {
  // 100 one-float targets a page apart: 400 bytes declared, 100 pages mapped.
  std::vector<v1::Target> t;
  for (int i = 0; i < 100; ++i) t.push_back(F32("t" + std::to_string(i), 1, 4096ull * i));
  auto r = Charge(t, Policy::Mapped::kAll, 100 * 4096 - 1);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(r.status().message(), HasSubstr("409600 destination bytes"));
  EXPECT_THAT(r.status().message(), HasSubstr("limits.max_request_bytes 409599"));
  EXPECT_EQ(*Charge(t, Policy::Mapped::kAll, 100 * 4096), 409600u);
}

TEST(PackedOffsets, NoGapsAndEachPieceAlignedAsItsSizeAllows) {
  const std::vector<uint64_t> sizes = {3, 8, 6, 4, 16, 1, 12, 0, 2};
  uint64_t total = 0;
  const std::vector<uint64_t> at = PackedOffsets(sizes, &total);
  ASSERT_EQ(at.size(), sizes.size());
  uint64_t sum = 0;
  for (uint64_t n : sizes) sum += n;
  EXPECT_EQ(total, sum);
  std::vector<bool> used(total, false);
  for (size_t i = 0; i < sizes.size(); ++i) {
    const uint64_t n = sizes[i];
    const uint64_t align = n % 8 == 0 ? 8 : n % 4 == 0 ? 4 : n % 2 == 0 ? 2 : 1;
    EXPECT_EQ(at[i] % align, 0u) << "piece " << i << " of " << n << " bytes at " << at[i];
    for (uint64_t b = at[i]; b < at[i] + n; ++b) {
      ASSERT_LT(b, total);
      EXPECT_FALSE(used[b]) << "byte " << b << " packed twice";
      used[b] = true;
    }
  }
}

}  // namespace
}  // namespace ckptd

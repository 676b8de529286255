// Address helpers of the configuration (config/config.h): what counts as
// loopback decides whether a plaintext peer service is allowed without
// peer_insecure (issue 33: parsed addresses, not name prefixes).
#include <gtest/gtest.h>

#include "config/config.h"

namespace ckptd {
namespace {

TEST(IsLoopbackAddress, LoopbackAddressesAndUnixSockets) {
  for (const char* a : {"127.0.0.1:5000", "127.0.0.2:0", "127.255.255.254:1", "localhost:7000",
                        "[::1]:5000", "::1", "[::ffff:127.0.0.1]:5000", "unix:/run/ckptd/peer.sock",
                        "127.0.0.1"}) {
    EXPECT_TRUE(IsLoopbackAddress(a)) << a;
  }
}

TEST(IsLoopbackAddress, NamesThatOnlyLookLikeLoopbackAreNot) {
  for (const char* a : {"127.evil.example:5000", "127.0.0.1.nip.io:5000", "127.:5000",
                        "127:5000", "localhost.example.com:7000", "[::2]:5000",
                        "[::ffff:10.0.0.1]:5000", "10.0.0.1:5000", "0.0.0.0:5000", "[::]:5000",
                        "", "node-1:5000", "128.0.0.1:5000"}) {
    EXPECT_FALSE(IsLoopbackAddress(a)) << a;
  }
}

TEST(HostOf, SplitsHostAndPort) {
  EXPECT_EQ(HostOf("127.0.0.1:5000"), "127.0.0.1");
  EXPECT_EQ(HostOf("[::1]:5000"), "::1");
  EXPECT_EQ(HostOf("::1"), "::1");
  EXPECT_EQ(HostOf("node-1"), "node-1");
}

}  // namespace
}  // namespace ckptd

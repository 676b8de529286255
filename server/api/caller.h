// Who is calling the daemon: the identity every access decision uses.
//
// Unix-socket callers are identified by the kernel (SO_PEERCRED and
// SO_PEERGROUPS, taken when their connection is accepted; see
// uds_listener.h), never by anything they send. TCP callers act as the
// configured tcp_uid. The daemon's own work (prefetch at start, tests)
// acts as kSelf.
#ifndef CKPTD_SERVER_API_CALLER_H_
#define CKPTD_SERVER_API_CALLER_H_

#include <sys/types.h>

#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"

namespace ckptd {

struct Caller {
  enum class Via { kUnix, kTcp, kSelf };
  Via via = Via::kSelf;
  uid_t uid = 0;
  gid_t gid = 0;
  pid_t pid = 0;
  std::vector<gid_t> groups;  // supplementary groups (the primary gid is `gid`)

  bool InGroup(gid_t g) const {
    return gid == g || std::find(groups.begin(), groups.end(), g) != groups.end();
  }
  std::string Describe() const {
    switch (via) {
      case Via::kUnix:
        return absl::StrCat("uid ", uid, " (pid ", pid, ")");
      case Via::kTcp:
        return absl::StrCat("TCP client (as uid ", uid, ")");
      case Via::kSelf:
        break;
    }
    return "the daemon itself";
  }
};

// Who is calling the peer service (another daemon, or anyone who reached
// the peer port). With mutual TLS, `names` are the DNS and IP names (SANs)
// of the certificate the TLS handshake verified against peer_tls_ca; in
// plaintext (a loopback peer_listen, or peer_insecure), the caller's source
// IP, and what it says about itself cannot be checked.
struct PeerCaller {
  std::vector<std::string> names;
  bool verified = false;  // names come from a verified certificate
  std::string Describe() const {
    std::string n;
    for (const auto& s : names) absl::StrAppend(&n, n.empty() ? "" : ",", s);
    return verified ? absl::StrCat("peer certificate [", n, "]")
                    : absl::StrCat("plaintext peer ", n.empty() ? "(unknown)" : n);
  }
};

}  // namespace ckptd

#endif  // CKPTD_SERVER_API_CALLER_H_

// The peer plane: the set of daemons this one works with, who may call its
// peer service and speak for which node address, the TLS credentials of both
// ends (reloaded on SIGHUP), channels to the other daemons, and their cached
// health for Status. Owned by the Daemon; the multi-node coordinator and
// participant use it (server/multinode/dist_jobs.h),
// the peer server and service authenticate through it.
//
// Thread-safe: the peer set, the channels (with the TLS files) and the
// health each have their own mutex; none is held while calling out.
#ifndef CKPTD_SERVER_PEER_PEER_PLANE_H_
#define CKPTD_SERVER_PEER_PEER_PLANE_H_

#include <atomic>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <grpcpp/security/server_credentials.h>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "config/config.h"
#include "proto/ckpt.pb.h"
#include "proto/peer.grpc.pb.h"
#include "server/api/caller.h"

namespace ckptd {

class PeerPlane {
 public:
  // The peer TLS files (PEM), as read from peer_tls_*.
  struct TlsFiles {
    std::string cert, key, ca;
  };
  // The peer set as configured, peer_dns resolved.
  struct PeerSet {
    std::vector<std::string> others;      // every other daemon's address
    std::set<std::string> members;        // every peer address, this one's included
    std::set<std::string> names;          // what a peer certificate may be named
    std::string dns_name;                 // host of peer_dns
    std::set<std::string> dns_addresses;  // the addresses found through it
    absl::Time resolved;
  };

  // Takes peers, peer_dns, peer_listen and peer_tls_* from `config`.
  explicit PeerPlane(const DaemonConfig& config);

  // This node's peer address once the peer server bound it (a "host:0"
  // peer_listen becomes "host:N"). Until then Authorize refuses every call
  // (UNAVAILABLE).
  void SetListen(const std::string& bound);

  // A caller of the peer service passes when one of its certificate's names
  // belongs to the peer set (hosts of `peers` and `peer_listen`, the
  // `peer_dns` name and the addresses behind it); in plaintext, always
  // (loopback or peer_insecure).
  absl::StatusOr<PeerCaller> Authorize(PeerCaller caller) const;
  // OK when `caller` may speak for the peer address `node`: `node` is in the
  // peer set (re-resolved once when it is not) or, with `job_member`, a node
  // of a job it joined (a pod that left the DNS answer mid-job stays one),
  // and (TLS) the certificate names node's host, or the peer_dns name when
  // node is found through it (or is a job member). Else PERMISSION_DENIED.
  absl::Status SpeaksFor(const PeerCaller& caller, const std::string& node,
                         bool job_member = false) const;
  // Other daemons' peer addresses (static list and DNS), without this one.
  std::vector<std::string> Others() const;
  // Every daemon's peer address, this one's included, sorted.
  std::vector<std::string> Members() const;

  // The peer TLS files, read now; nullopt when peer TLS is off. A file that
  // cannot be read is the error.
  absl::StatusOr<std::optional<TlsFiles>> ReadTls() const;
  // Channels made from now on present `files` (Start; SIGHUP, once the peer
  // server accepted them).
  void UseTls(std::optional<TlsFiles> files);
  std::optional<TlsFiles> tls() const;
  // Credentials for the peer service (mutual TLS: client certificates
  // required and verified against the CA; plaintext for nullopt).
  static std::shared_ptr<grpc::ServerCredentials> ServerCredentials(
      const std::optional<TlsFiles>& files);

  // A channel to `address` with this node's credentials (TLS: the server's
  // certificate must name the address's host, or the peer_dns name for an
  // address found through it). Shared: UseTls replaces the cached stubs
  // while calls on the old ones finish.
  std::shared_ptr<peer::v1::Peer::Stub> Stub(const std::string& address);

  // `nodes` pinged at once, each call bounded by `deadline`: per node (same
  // order) how the call ended, the answer and the round trip.
  struct Pinged {
    grpc::Status status;
    peer::v1::PingResponse response;
    absl::Duration rtt;
  };
  std::vector<Pinged> PingAll(const std::vector<std::string>& nodes, absl::Duration deadline);

  // The other daemons pinged in parallel (short deadline), the answer kept
  // a few seconds so Status and metrics scrapes do not ping again: all of
  // them when there are at most kMaxHealthPings, else the kMaxHealthPings
  // this daemon called most recently (a scrape of every daemon of a large
  // peer set must not cost N^2 pings). *known: how many other daemons
  // there are.
  static constexpr size_t kMaxHealthPings = 64;
  std::vector<v1::PeerHealth> Health(size_t* known = nullptr);

 private:
  // The configured peer set, with peer_dns resolved at most every few
  // seconds (`refresh`: now).
  std::shared_ptr<const PeerSet> Current(bool refresh = false) const;
  std::string listen() const;

  const std::vector<std::string> peers_;
  const std::string peer_dns_;
  const std::string tls_cert_, tls_key_, tls_ca_;
  std::atomic<bool> bound_{false};

  mutable absl::Mutex set_mu_;
  std::string listen_ ABSL_GUARDED_BY(set_mu_);
  mutable std::shared_ptr<const PeerSet> set_ ABSL_GUARDED_BY(set_mu_);
  mutable absl::Mutex stubs_mu_;
  std::optional<TlsFiles> tls_ ABSL_GUARDED_BY(stubs_mu_);
  std::map<std::string, std::shared_ptr<peer::v1::Peer::Stub>> stubs_ ABSL_GUARDED_BY(stubs_mu_);
  // When each address was last called (Stub); kept across UseTls.
  std::map<std::string, absl::Time> last_called_ ABSL_GUARDED_BY(stubs_mu_);
  absl::Mutex health_refresh_mu_;  // one refresh at a time
  absl::Mutex health_mu_;
  std::vector<v1::PeerHealth> health_ ABSL_GUARDED_BY(health_mu_);
  absl::Time health_at_ ABSL_GUARDED_BY(health_mu_) = absl::InfinitePast();
};

}  // namespace ckptd

#endif  // CKPTD_SERVER_PEER_PEER_PLANE_H_

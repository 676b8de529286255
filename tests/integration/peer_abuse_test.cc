// The peer plane under attack: real daemons with mutual TLS (certificates
// made at test time with openssl), and this test process as a stranger
// (no certificate, one from another CA, a valid one whose name is not a
// peer) or as a misbehaving member of a job (joining with no ranks,
// speaking for another node, fetching a read three times, completing for
// a job it is not in). Also: a peer that flips a byte of what it serves,
// and certificates rotated by SIGHUP in the middle of a job.
#include <signal.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <random>

#include <grpcpp/grpcpp.h>

#include "core/write/writer.h"
#include "client/ckptd_client.h"
#include "core/tools/offline.h"
#include "core/format/safetensors.h"
#include "core/base/xxh3.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/peer.grpc.pb.h"
#include "server/multinode/job_mac.h"
#include "server/multinode/plan_codec.h"
#include "tests/integration/certs.h"
#include "tests/integration/daemon_process.h"
#include "tests/integration/fixtures.h"
#include "tests/integration/ports.h"
#include "tests/testing/temp_dir.h"

namespace ckpt {
namespace {

using ::testing::HasSubstr;
using testing::CertFiles;
using testing::DaemonProcess;
using testing::Runfile;
using testing::Spawn;
using testing::WaitExit;
namespace fs = std::filesystem;
namespace pv1 = ckptd::peer::v1;

std::string Addr(int port) { return "127.0.0.1:" + std::to_string(port); }

// The key the job's rank processes share (CKPTD_JOB_KEY); this test, as a
// node of the peer set, does not hold it unless a case says so.
constexpr char kJobKey[] = "peer-abuse-test-job-key-0123456789";

class PeerAbuse : public ::testing::Test {
 protected:
  void SetUp() override {
    ::setenv("CKPTD_JOB_KEY", kJobKey, 1);  // the rank processes' (C++ client)
    certs_ = tmp_.Sub("certs");
    ASSERT_TRUE(MakeDirs(certs_).ok());
    ASSERT_TRUE(testing::MakeCa(certs_, "ca")) << Slurp(certs_ + "/openssl.log");
    ASSERT_TRUE(testing::MakeCa(certs_, "otherca"));
    node_ = testing::MakeLeaf(certs_, "ca", "node", "IP:127.0.0.1");
    intruder_ = testing::MakeLeaf(certs_, "ca", "intruder", "DNS:intruder.example");
    elsewhere_ = testing::MakeLeaf(certs_, "ca", "elsewhere", "IP:127.0.0.2");
    foreign_ = testing::MakeLeaf(certs_, "otherca", "foreign", "IP:127.0.0.1");
    for (const auto* c : {&node_, &intruder_, &elsewhere_, &foreign_}) {
      ASSERT_FALSE(c->cert.empty()) << Slurp(certs_ + "/openssl.log");
    }
    // The model, saved over 4 ranks (rows); node n's "local disk" holds the
    // files of ranks 2n and 2n+1.
    ASSERT_TRUE(WriteModel(tmp_.Sub("src"), 5).ok());
    ASSERT_TRUE(ShardCheckpoint(tmp_.Sub("src"), MakeLayout(4, 0, false), tmp_.Sub("full"), {}).ok());
    for (int n = 0; n < 2; ++n) {
      const std::string dir = tmp_.Sub("node" + std::to_string(n) + "/ckpt");
      ASSERT_TRUE(MakeDirs(dir).ok());
      fs::copy_file(tmp_.Sub("full/0.metadata"), dir + "/0.metadata");
      for (int r = 2 * n; r < 2 * n + 2; ++r) {
        const std::string f = std::to_string(r) + "_0.safetensors";
        fs::copy_file(tmp_.Sub("full/" + f), dir + "/" + f);
      }
    }
    for (int& p : ports_) p = testing::FreePort();
  }

  // The peer set every daemon is configured with: daemons A and B, the
  // address this test speaks for as a member (X), and 127.0.0.2:Y (so a
  // certificate for 127.0.0.2 is a peer, but not node X).
  std::string Peers() const {
    return Addr(ports_[0]) + "," + Addr(ports_[1]) + "," + Addr(ports_[2]) + ",127.0.0.2:" +
           std::to_string(ports_[3]);
  }
  std::string X() const { return Addr(ports_[2]); }

  // Node X (this test) reads nothing: daemon A gets every data file.
  void GiveAllFilesToA() {
    for (int r = 2; r < 4; ++r) {
      const std::string f = std::to_string(r) + "_0.safetensors";
      fs::copy_file(tmp_.Sub("full/" + f), tmp_.Sub("node0/ckpt/" + f));
    }
  }

  // Waits until daemon A has registered job `job` (its local ranks arrived).
  void WaitForJob(const std::string& job) {
    ckptd::Client::Options o;
    o.socket = nodes_[0]->socket();
    auto c = ckptd::Client::Connect(o);
    ASSERT_TRUE(c.ok()) << c.status();
    for (int i = 0; i < 1000; ++i) {
      auto st = (*c)->Status();
      ASSERT_TRUE(st.ok()) << st.status();
      for (const auto& j : st->jobs()) {
        if (j.job_id() == job) return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    FAIL() << "job " << job << " never appeared on daemon A";
  }

  // Daemon i (0: A, 1: B) on node i's disk, with mutual TLS from `certs`.
  // A listens on peer port 0 (the kernel picks it, A reports it: no race)
  // and names the others of Peers(); B, started after A, listens on the
  // free port A's peer set names and names A's real port. If B cannot
  // listen there (taken since it was chosen), A and B start again on a new
  // one.
  void Start(int i, std::vector<std::string> extra = {}, const CertFiles* certs = nullptr) {
    const CertFiles& c = certs ? *certs : node_;
    if (i == 0) {
      a_extra_ = extra;
      a_certs_ = certs;
    }
    for (int attempt = 0;; ++attempt) {
      const std::string others =
          Addr(ports_[1]) + "," + X() + ",127.0.0.2:" + std::to_string(ports_[3]);
      std::vector<std::string> args = {"--peer-listen", i == 0 ? "127.0.0.1:0" : Addr(ports_[i]),
                                       "--peers", i == 0 ? others : Peers(),
                                       "--peer-timeout", "4s", "--io-request-size", "64KiB",
                                       "--peer-tls-cert", c.cert, "--peer-tls-key", c.key,
                                       "--peer-tls-ca", c.ca};
      args.insert(args.end(), extra.begin(), extra.end());
      nodes_[i] = std::make_unique<DaemonProcess>(tmp_.Sub("node" + std::to_string(i)), args);
      if (i == 1 && attempt < 3 && nodes_[0] && !nodes_[1]->Ready() &&
          Slurp(nodes_[1]->log()).find("cannot listen for peers on") != std::string::npos) {
        nodes_[1]->Stop();  // exited already
        ports_[1] = testing::FreePort();
        nodes_[0].reset();
        Start(0, a_extra_, a_certs_);
        continue;
      }
      ASSERT_TRUE(nodes_[i]->Ready()) << Slurp(nodes_[i]->log());
      if (i == 0) {
        ports_[0] = nodes_[0]->ReportedPort("peer");
        ASSERT_GT(ports_[0], 0) << "daemon A reported no peer port; its log:\n"
                                << Slurp(nodes_[0]->log());
      }
      return;
    }
  }

  // Daemons A and B, each on its own copy of the node certificate (`live`),
  // which a test replaces in place before a SIGHUP.
  void StartWithOwnCertFiles(CertFiles live[2], const std::vector<std::string>& extra) {
    for (int i = 0; i < 2; ++i) {
      live[i] = {tmp_.Sub("live" + std::to_string(i) + ".crt"),
                 tmp_.Sub("live" + std::to_string(i) + ".key"), node_.ca};
      fs::copy_file(node_.cert, live[i].cert);
      fs::copy_file(node_.key, live[i].key);
      Start(i, extra, &live[i]);
    }
  }

  std::unique_ptr<pv1::Peer::Stub> Stub(int port, const CertFiles* as) {
    std::shared_ptr<grpc::ChannelCredentials> creds;
    if (as == nullptr) {
      creds = grpc::InsecureChannelCredentials();
    } else {
      grpc::SslCredentialsOptions o;
      o.pem_root_certs = Slurp(node_.ca);  // trusts the daemons: only the server may refuse
      o.pem_cert_chain = Slurp(as->cert);
      o.pem_private_key = Slurp(as->key);
      creds = grpc::SslCredentials(o);
    }
    return pv1::Peer::NewStub(grpc::CreateChannel(Addr(port), creds));
  }
  static void Deadline(grpc::ClientContext* ctx, int seconds) {
    ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(seconds));
  }

  // The rank outputs of job `job` (StartRank's out-<job>/) are byte for byte
  // those of the same load of full/ done offline.
  void ExpectOutputsOfOfflineLoad(const Layout& load, const std::string& job) {
    OfflineLoadOptions lo;
    auto res = LoadOffline(tmp_.Sub("full"), load, lo);
    ASSERT_TRUE(res.ok()) << res.status();
    ASSERT_TRUE(WriteRankOutputs(*res, tmp_.Sub("expected-" + job)).ok());
    for (int r = 0; r < load.world_size; ++r) {
      const std::string f = "/rank" + std::to_string(r) + ".safetensors";
      EXPECT_EQ(Slurp(tmp_.Sub("out-" + job) + f), Slurp(tmp_.Sub("expected-" + job) + f)) << r;
    }
  }

  std::string WriteLayout(const Layout& l, const std::string& name) {
    std::string f = tmp_.Sub(name);
    std::ofstream(f) << LayoutToJson(l);
    return f;
  }
  // Rank `r` of the load in `layout`. Ranks are spread over the daemons
  // A and B in blocks; without B, the second block is node X (this test),
  // which has no socket: rank r then goes to daemon A only if r is in A's block.
  // The rank's output goes to `job`.log, or to `log` (a file of its own: ranks
  // writing one file at once can interleave their lines).
  pid_t StartRank(int r, const std::string& layout, const std::string& job,
                  const std::string& log = "") {
    const std::string daemons =
        nodes_[0]->socket() + "," + (nodes_[1] ? nodes_[1]->socket() : tmp_.Sub("node-x.sock"));
    return Spawn({Runfile("client/ckptctl"), "load", "ckpt", "--layout", layout, "--out",
                  tmp_.Sub("out-" + job), "--daemon", daemons, "--ranks", std::to_string(r),
                  "--job-id", job},
                 tmp_.Sub(log.empty() ? job + ".log" : log));
  }
  // Joins daemon A's job `job` as node X (or `node`) with `ranks` of `load`,
  // retrying until A knows the job.
  // Joins `job` as `node` for `ranks`, with the MAC of `key` (the job's own
  // kJobKey when this node holds it; "" none).
  grpc::Status JoinAs(const std::string& job, const std::string& node, const Layout& load,
                      std::vector<int> ranks, const CertFiles* as, pv1::PlanPart* part,
                      const std::string& key = kJobKey) {
    pv1::JoinRequest req;
    req.set_job_id(job);
    req.set_node(node);
    req.set_job_mac(ckptd::JoinMac(key, job, node));
    req.set_path("ckpt");
    req.set_world_size(load.world_size);
    req.set_coordinator_rank(0);
    for (int r : ranks) {
      pv1::RankTargetsMsg* rm = req.add_ranks();
      rm->set_rank(r);
      for (const auto& t : load.ranks[r].tensors) ckptd::ToMsg(t, rm->add_targets());
    }
    auto stub = Stub(ports_[0], as);
    grpc::Status s;
    for (int i = 0; i < 200; ++i) {
      grpc::ClientContext ctx;
      Deadline(&ctx, 10);
      s = stub->Join(&ctx, req, part);
      if (s.error_code() != grpc::StatusCode::UNAVAILABLE) return s;
      std::this_thread::sleep_for(std::chrono::milliseconds(25));
    }
    return s;
  }
  // `spans`: (begin, end) within the read (FetchReadRequest.spans); each
  // chunk's xxh3 (or none) into `chunk_xxh3` when given; `span_runs`: the
  // packed form's quadruples.
  grpc::Status Fetch(const std::string& job, uint32_t read, const std::string& node,
                     const CertFiles* as, std::string* bytes, std::optional<uint64_t>* xxh3,
                     const std::vector<std::pair<int64_t, int64_t>>& spans = {},
                     std::vector<std::optional<uint64_t>>* chunk_xxh3 = nullptr,
                     std::vector<std::string>* chunks = nullptr,
                     const std::vector<uint64_t>& span_runs = {}) {
    auto stub = Stub(ports_[0], as);
    grpc::ClientContext ctx;
    Deadline(&ctx, 10);
    pv1::FetchReadRequest req;
    req.set_job_id(job);
    req.set_read(read);
    req.set_node(node);
    for (const auto& [b, e] : spans) {
      pv1::Range* r = req.add_spans();
      r->set_begin(b);
      r->set_end(e);
    }
    for (uint64_t v : span_runs) req.add_span_runs(v);
    auto stream = stub->FetchRead(&ctx, req);
    pv1::Chunk c;
    while (stream->Read(&c)) {
      if (c.has_xxh3() && xxh3 != nullptr) *xxh3 = c.xxh3();
      if (chunk_xxh3 != nullptr) {
        chunk_xxh3->push_back(c.has_xxh3() ? std::optional<uint64_t>(c.xxh3()) : std::nullopt);
      }
      if (chunks != nullptr) chunks->push_back(c.data());
      if (bytes != nullptr) bytes->append(c.data());
    }
    return stream->Finish();
  }

  // Job `job` on A (every file A's, 2 ranks loading split on dim 1, rank 0
  // started on A) joined by member X for rank 1: rank 0's pid, X's part in
  // *part (a failure recorded if the join failed).
  pid_t JoinedAsX(const std::string& job, pv1::PlanPart* part) {
    GiveAllFilesToA();
    Start(0);
    const Layout load = MakeLayout(2, 1, false);
    const pid_t rank0 = StartRank(0, WriteLayout(load, "load2.json"), job);
    grpc::Status joined = JoinAs(job, X(), load, {1}, &node_, part);
    EXPECT_TRUE(joined.ok()) << joined.error_message() << Slurp(nodes_[0]->log());
    return rank0;
  }
  // The bytes of part.reads(i) as A's file holds them ("" if it does not).
  std::string ReadOfA(const pv1::PlanPart& part, int i) {
    const auto& r = part.reads(i);
    const std::string file = Slurp(tmp_.Sub("node0/ckpt/" + part.files(r.file())));
    EXPECT_GE(file.size(), r.offset() + r.length());
    return file.size() < r.offset() + r.length() ? "" : file.substr(r.offset(), r.length());
  }
  // A fetch of spans: every chunk with the xxh3 of its own bytes.
  static void ExpectEachChunkHashed(const std::vector<std::optional<uint64_t>>& hashes,
                                    const std::vector<std::string>& chunks) {
    ASSERT_EQ(hashes.size(), chunks.size());
    for (size_t i = 0; i < chunks.size(); ++i) {
      ASSERT_TRUE(hashes[i].has_value()) << "chunk " << i << " has no xxh3";
      EXPECT_EQ(*hashes[i], XXH3_64bits(chunks[i].data(), chunks[i].size())) << "chunk " << i;
    }
  }
  // Positions in `part` of the reads A makes that X needs, of at least
  // `min_length` bytes.
  std::vector<int> ReadsOfAForX(const pv1::PlanPart& part, uint64_t min_length) {
    std::vector<int> out;
    for (int i = 0; i < part.reads_size(); ++i) {
      const auto& r = part.reads(i);
      if (r.reader() == Addr(ports_[0]) && r.length() >= min_length &&
          std::find(r.needed_by().begin(), r.needed_by().end(), X()) != r.needed_by().end()) {
        out.push_back(i);
      }
    }
    return out;
  }
  // FetchReads of `reads` (id, spans) as `node`; every chunk into `chunks`.
  grpc::Status FetchMany(const std::string& job, const std::string& node,
                         const std::vector<std::pair<uint32_t, std::vector<std::pair<int64_t, int64_t>>>>& reads,
                         std::vector<pv1::Chunk>* chunks) {
    auto stub = Stub(ports_[0], &node_);
    grpc::ClientContext ctx;
    Deadline(&ctx, 10);
    pv1::FetchReadsRequest req;
    req.set_job_id(job);
    req.set_node(node);
    for (const auto& [id, spans] : reads) {
      pv1::FetchReadRequest* r = req.add_reads();
      r->set_read(id);
      for (const auto& [b, e] : spans) {
        pv1::Range* range = r->add_spans();
        range->set_begin(b);
        range->set_end(e);
      }
    }
    auto stream = stub->FetchReads(&ctx, req);
    pv1::Chunk c;
    while (stream->Read(&c)) chunks->push_back(c);
    return stream->Finish();
  }

  testing::TempDir tmp_;
  std::string certs_;
  CertFiles node_, intruder_, elsewhere_, foreign_;
  int ports_[4] = {};
  std::vector<std::string> a_extra_;  // A's start, again if B's port was taken
  const CertFiles* a_certs_ = nullptr;
  std::unique_ptr<DaemonProcess> nodes_[2];
};

// No certificate, a certificate from another CA: the TLS handshake fails.
// A valid certificate whose name is not a peer: PERMISSION_DENIED naming it.
// On every RPC, and the daemon keeps serving.
TEST_F(PeerAbuse, StrangersAreTurnedAwayOnEveryRpc) {
  Start(0);
  const Layout load = MakeLayout(2, 1, false);
  struct Stranger {
    const char* what;
    const CertFiles* as;
    std::set<grpc::StatusCode> codes;
  };
  const std::vector<Stranger> strangers = {
      {"no certificate", nullptr, {grpc::StatusCode::UNAVAILABLE, grpc::StatusCode::UNAUTHENTICATED}},
      {"another CA", &foreign_, {grpc::StatusCode::UNAVAILABLE, grpc::StatusCode::UNAUTHENTICATED}},
      {"not a peer", &intruder_, {grpc::StatusCode::PERMISSION_DENIED}},
  };
  for (const Stranger& s : strangers) {
    SCOPED_TRACE(s.what);
    auto stub = Stub(ports_[0], s.as);
    std::vector<std::pair<std::string, grpc::Status>> got;
    {
      grpc::ClientContext ctx;
      Deadline(&ctx, 5);
      pv1::JoinRequest req;
      req.set_job_id("j");
      req.set_node(X());
      req.set_world_size(2);
      pv1::PlanPart part;
      got.push_back({"Join", stub->Join(&ctx, req, &part)});
    }
    {
      std::string bytes;
      got.push_back({"FetchRead", Fetch("j", 0, X(), s.as, &bytes, nullptr)});
    }
    {
      grpc::ClientContext ctx;
      Deadline(&ctx, 5);
      pv1::CompleteRequest req;
      req.set_job_id("j");
      req.set_node(X());
      req.set_ok(true);
      pv1::CompleteResponse resp;
      got.push_back({"Complete", stub->Complete(&ctx, req, &resp)});
    }
    {
      grpc::ClientContext ctx;
      Deadline(&ctx, 5);
      pv1::PingRequest req;
      pv1::PingResponse resp;
      got.push_back({"Ping", stub->Ping(&ctx, req, &resp)});
    }
    for (const auto& [rpc, st] : got) {
      EXPECT_TRUE(s.codes.count(st.error_code()))
          << rpc << ": " << st.error_code() << " " << st.error_message();
      if (s.as == &intruder_) {
        EXPECT_THAT(st.error_message(), HasSubstr("intruder.example")) << rpc;
      }
    }
  }
  // Still serving its peers.
  grpc::ClientContext ctx;
  Deadline(&ctx, 5);
  pv1::PingRequest req;
  req.set_node(X());
  pv1::PingResponse resp;
  grpc::Status ok = Stub(ports_[0], &node_)->Ping(&ctx, req, &resp);
  EXPECT_TRUE(ok.ok()) << ok.error_message();
  EXPECT_EQ(resp.node(), Addr(ports_[0]));
}

// A member of the peer set that knows the job's id but not its key (issue
// 33: before, it joined first for rank 1 and was served the job's bytes):
// its join is refused with no key and with a wrong one, and so is a fetch.
// Then a member of the job (its join proves the key): sees its job in Ping
// (a non-member does not), gets its read once with the serving node's xxh3,
// is refused a second fetch (the job fails, naming it), never crashes the
// server with a third; a peer that is not a node of the job cannot complete
// it.
// A member may fetch only the bytes its ranks copy (FetchReadRequest.spans,
// issue 34): it gets exactly those, one after another, each chunk with the
// xxh3 of its own bytes. Spans out of order, overlapping, empty or past the
// read are a violation: PERMISSION_DENIED naming the span, the job fails,
// the daemon serves on.
TEST_F(PeerAbuse, MemberFetchingSpansGetsThoseBytesOnlyAndMalformedSpansFailTheJob) {
  pv1::PlanPart part;
  const pid_t rank0 = JoinedAsX("spans", &part);
  ASSERT_FALSE(HasFailure());
  const std::vector<int> mine = ReadsOfAForX(part, 64);
  ASSERT_GE(mine.size(), 2u) << "X needs fewer than two reads of A";
  const std::string read = ReadOfA(part, mine[0]);
  ASSERT_FALSE(read.empty());
  std::string bytes;
  std::vector<std::optional<uint64_t>> hashes;
  std::vector<std::string> chunks;
  const int64_t n = static_cast<int64_t>(read.size());
  grpc::Status got = Fetch("spans", mine[0], X(), &node_, &bytes, nullptr,
                           {{0, 8}, {16, 40}, {n - 4, n}}, &hashes, &chunks);
  ASSERT_TRUE(got.ok()) << got.error_message();
  EXPECT_EQ(bytes, read.substr(0, 8) + read.substr(16, 24) + read.substr(n - 4, 4));
  ExpectEachChunkHashed(hashes, chunks);
  grpc::Status bad = Fetch("spans", mine[1], X(), &node_, &bytes, nullptr, {{16, 24}, {8, 12}});
  EXPECT_EQ(bad.error_code(), grpc::StatusCode::PERMISSION_DENIED) << bad.error_message();
  EXPECT_THAT(bad.error_message(), HasSubstr("spans[1] [8, 12)"));
  EXPECT_NE(WaitExit(rank0, std::chrono::seconds(20)), 0);
  EXPECT_THAT(Slurp(tmp_.Sub("spans.log")), HasSubstr("spans[1] [8, 12)"));
  EXPECT_TRUE(nodes_[0]->Alive()) << Slurp(nodes_[0]->log());
}

// The packed form (FetchReadRequest.span_runs: begin, length, stride,
// count), what a node of this release sends: the member gets exactly those
// spans' bytes, each chunk with its own xxh3. Runs whose spans overlap are a
// violation: PERMISSION_DENIED naming the run, the job fails, the daemon
// serves on.
TEST_F(PeerAbuse, MemberFetchingSpanRunsGetsThoseBytesOnlyAndOverlappingRunsFailTheJob) {
  pv1::PlanPart part;
  const pid_t rank0 = JoinedAsX("runs", &part);
  ASSERT_FALSE(HasFailure());
  const std::vector<int> mine = ReadsOfAForX(part, 64);
  ASSERT_GE(mine.size(), 2u) << "X needs fewer than two reads of A";
  const std::string read = ReadOfA(part, mine[0]);
  ASSERT_FALSE(read.empty());
  const uint64_t n = read.size();
  std::string bytes;
  std::vector<std::optional<uint64_t>> hashes;
  std::vector<std::string> chunks;
  // [0, 4), [16, 20), [32, 36), then the last 8 bytes.
  grpc::Status got = Fetch("runs", mine[0], X(), &node_, &bytes, nullptr, {}, &hashes, &chunks,
                           {0, 4, 16, 3, n - 8, 8, 0, 1});
  ASSERT_TRUE(got.ok()) << got.error_message();
  EXPECT_EQ(bytes, read.substr(0, 4) + read.substr(16, 4) + read.substr(32, 4) +
                       read.substr(n - 8, 8));
  ExpectEachChunkHashed(hashes, chunks);
  // 8-byte spans 4 bytes apart overlap.
  grpc::Status bad =
      Fetch("runs", mine[1], X(), &node_, &bytes, nullptr, {}, nullptr, nullptr, {0, 8, 4, 2});
  EXPECT_EQ(bad.error_code(), grpc::StatusCode::PERMISSION_DENIED) << bad.error_message();
  EXPECT_THAT(bad.error_message(), HasSubstr("span_runs[0] (begin 0, length 8, stride 4"));
  EXPECT_NE(WaitExit(rank0, std::chrono::seconds(20)), 0);
  EXPECT_THAT(Slurp(tmp_.Sub("runs.log")), HasSubstr("span_runs[0]"));
  EXPECT_TRUE(nodes_[0]->Alive()) << Slurp(nodes_[0]->log());
}

// FetchReads (issue 34): the reads a member needs from a node in one stream,
// in the order asked, every chunk naming its read (a whole read's first chunk
// with the read's xxh3; a fetch of spans, each chunk with its own). A call
// asking for no read is a violation: PERMISSION_DENIED, the job fails, the
// daemon serves on.
TEST_F(PeerAbuse, MemberFetchingReadsInOneStreamGetsThemInTheOrderAsked) {
  pv1::PlanPart part;
  const pid_t rank0 = JoinedAsX("many", &part);
  ASSERT_FALSE(HasFailure());
  const std::vector<int> mine = ReadsOfAForX(part, 64);
  ASSERT_GE(mine.size(), 2u) << "X needs fewer than two reads of A";
  auto id = [&](int i) { return part.reads(i).has_id() ? part.reads(i).id() : static_cast<uint32_t>(i); };
  auto bytes_of = [&](int i) {
    const auto& r = part.reads(i);
    return Slurp(tmp_.Sub("node0/ckpt/" + part.files(r.file()))).substr(r.offset(), r.length());
  };
  const std::string whole = bytes_of(mine[1]), cut = bytes_of(mine[0]);
  const int64_t n = static_cast<int64_t>(cut.size());
  std::vector<pv1::Chunk> chunks;
  // The later read first, whole; then the earlier one's first 8 and last 4 bytes.
  grpc::Status got = FetchMany("many", X(), {{id(mine[1]), {}}, {id(mine[0]), {{0, 8}, {n - 4, n}}}},
                               &chunks);
  ASSERT_TRUE(got.ok()) << got.error_message();
  std::string first, second;
  for (size_t i = 0; i < chunks.size(); ++i) {
    const pv1::Chunk& c = chunks[i];
    if (c.read() == id(mine[1])) {
      EXPECT_TRUE(second.empty()) << "chunk " << i << " of the first read after the second's";
      EXPECT_EQ(c.offset(), first.size());
      EXPECT_EQ(c.has_xxh3(), first.empty()) << "chunk " << i;
      if (first.empty()) {
        EXPECT_EQ(c.xxh3(), XXH3_64bits(whole.data(), whole.size()));
      }
      first += c.data();
    } else {
      ASSERT_EQ(c.read(), id(mine[0])) << "chunk " << i;
      EXPECT_EQ(c.offset(), second.size());
      ASSERT_TRUE(c.has_xxh3()) << "chunk " << i;
      EXPECT_EQ(c.xxh3(), XXH3_64bits(c.data().data(), c.data().size()));
      second += c.data();
    }
  }
  EXPECT_EQ(first, whole);
  EXPECT_EQ(second, cut.substr(0, 8) + cut.substr(n - 4, 4));
  chunks.clear();
  grpc::Status none = FetchMany("many", X(), {}, &chunks);
  EXPECT_EQ(none.error_code(), grpc::StatusCode::PERMISSION_DENIED) << none.error_message();
  EXPECT_THAT(none.error_message(), HasSubstr("fetched 0 reads"));
  EXPECT_TRUE(chunks.empty());
  EXPECT_NE(WaitExit(rank0, std::chrono::seconds(20)), 0);
  EXPECT_THAT(Slurp(tmp_.Sub("many.log")), HasSubstr("fetched 0 reads"));
  EXPECT_TRUE(nodes_[0]->Alive()) << Slurp(nodes_[0]->log());
}

TEST_F(PeerAbuse, MemberFetchingAReadThreeTimesNeverCrashesTheServer) {
  GiveAllFilesToA();
  Start(0);
  const Layout load = MakeLayout(2, 1, false);
  const std::string lf = WriteLayout(load, "load2.json");
  pid_t rank0 = StartRank(0, lf, "fetch3");
  pv1::PlanPart part;
  for (const std::string key : {"", "not-the-job-key-but-long-enough"}) {
    grpc::Status s = JoinAs("fetch3", X(), load, {1}, &node_, &part, key);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr("refused by the coordinator"));
    EXPECT_THAT(s.error_message(), HasSubstr(key.empty() ? "its ranks sent no job_key"
                                                         : "is not the coordinator's ranks' key"));
  }
  {
    std::string bytes;
    grpc::Status s = Fetch("fetch3", 0, X(), &node_, &bytes, nullptr);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
    EXPECT_TRUE(bytes.empty()) << "a node without the key was served " << bytes.size() << " bytes";
  }
  grpc::Status joined = JoinAs("fetch3", X(), load, {1}, &node_, &part);
  ASSERT_TRUE(joined.ok()) << joined.error_message() << Slurp(nodes_[0]->log());
  EXPECT_EQ(part.coordinator_mac(), ckptd::PlanMac(kJobKey, "fetch3", Addr(ports_[0]), X()))
      << "the part proves the coordinator holds the key";
  EXPECT_THAT(part.nodes(), ::testing::UnorderedElementsAre(Addr(ports_[0]), X()));
  int g = -1;
  for (int i = 0; i < part.reads_size() && g < 0; ++i) {
    const auto& r = part.reads(i);
    if (r.reader() == Addr(ports_[0]) &&
        std::find(r.needed_by().begin(), r.needed_by().end(), X()) != r.needed_by().end()) {
      g = i;
    }
  }
  ASSERT_GE(g, 0) << "no read of A is needed by X";
  // Ping: job ids for a member only.
  for (const std::string& who : {X(), Addr(ports_[1])}) {
    grpc::ClientContext ctx;
    Deadline(&ctx, 5);
    pv1::PingRequest req;
    req.set_node(who);
    pv1::PingResponse resp;
    ASSERT_TRUE(Stub(ports_[0], &node_)->Ping(&ctx, req, &resp).ok());
    if (who == X()) {
      EXPECT_THAT(resp.jobs(), ::testing::Contains("fetch3"));
    } else {
      EXPECT_THAT(resp.jobs(), ::testing::IsEmpty()) << "a non-member learns no job ids";
    }
  }
  std::string bytes;
  std::optional<uint64_t> xxh3;
  grpc::Status first = Fetch("fetch3", g, X(), &node_, &bytes, &xxh3);
  ASSERT_TRUE(first.ok()) << first.error_message();
  ASSERT_EQ(bytes.size(), part.reads(g).length());
  ASSERT_TRUE(xxh3.has_value()) << "the first chunk carries the read's xxh3";
  EXPECT_EQ(*xxh3, XXH3_64bits(bytes.data(), bytes.size()));
  grpc::Status second = Fetch("fetch3", g, X(), &node_, nullptr, nullptr);
  EXPECT_EQ(second.error_code(), grpc::StatusCode::PERMISSION_DENIED) << second.error_message();
  EXPECT_THAT(second.error_message(), HasSubstr("a second time"));
  EXPECT_THAT(second.error_message(), HasSubstr("peer certificate [127.0.0.1]"));
  grpc::Status third = Fetch("fetch3", g, X(), &node_, nullptr, nullptr);
  EXPECT_FALSE(third.ok());
  // Not a node of the job: no completion.
  {
    grpc::ClientContext ctx;
    Deadline(&ctx, 5);
    pv1::CompleteRequest req;
    req.set_job_id("fetch3");
    req.set_node(Addr(ports_[1]));
    req.set_ok(true);
    pv1::CompleteResponse resp;
    grpc::Status s = Stub(ports_[0], &node_)->Complete(&ctx, req, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr("not a node of the job"));
  }
  // The job failed for its local rank, naming the member that misbehaved.
  EXPECT_NE(WaitExit(rank0, std::chrono::seconds(20)), 0);
  const std::string log = Slurp(tmp_.Sub("fetch3.log"));
  EXPECT_THAT(log, HasSubstr("PERMISSION_DENIED"));
  EXPECT_THAT(log, HasSubstr("peer certificate [127.0.0.1]"));
  EXPECT_TRUE(nodes_[0]->Alive()) << Slurp(nodes_[0]->log());
}

// Join with no ranks (by a holder of the job key): PERMISSION_DENIED, and
// the job fails for its ranks with that name. Join for an address the
// certificate does not name: PERMISSION_DENIED, and the job goes on (such a
// caller proves nothing) until its deadline, whose error names the refused
// join.
TEST_F(PeerAbuse, JoinWithoutRanksOrForAnotherNodeFailsTheJob) {
  GiveAllFilesToA();
  Start(0);
  const Layout load = MakeLayout(2, 1, false);
  const std::string lf = WriteLayout(load, "load2.json");
  struct Case {
    const char* job;
    const CertFiles* as;
    std::vector<int> ranks;
    const char* says;
  };
  for (const Case& c : {Case{"noranks", &node_, {}, "with no ranks"},
                        Case{"impostor", &elsewhere_, {1}, "its certificate does not name"}}) {
    SCOPED_TRACE(c.job);
    pid_t rank0 = StartRank(0, lf, c.job);
    WaitForJob(c.job);  // a violation fails a job this daemon knows
    pv1::PlanPart part;
    grpc::Status s = JoinAs(c.job, X(), load, c.ranks, c.as, &part);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr(c.says));
    const auto t0 = std::chrono::steady_clock::now();
    EXPECT_NE(WaitExit(rank0, std::chrono::seconds(20)), 0);
    EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(10));  // not the barrier
    const std::string log = Slurp(tmp_.Sub(std::string(c.job) + ".log"));
    if (std::string(c.job) == "noranks") {
      EXPECT_THAT(log, HasSubstr("PERMISSION_DENIED"));
    } else {  // the join's deadline (--peer-timeout 4s), naming the refused join
      EXPECT_THAT(log, HasSubstr("ranks 1 never joined"));
      EXPECT_THAT(log, HasSubstr("joins refused"));
    }
    EXPECT_THAT(log, HasSubstr(c.says));
  }
  EXPECT_TRUE(nodes_[0]->Alive());
}

// A member of the peer set without the job key neither joins the job nor
// fails it: its joins (no key, a wrong key) and a fetch are refused, and
// when the node that serves rank 1 joins, the job completes byte-exact.
TEST_F(PeerAbuse, ANodeWithoutTheJobKeyNeitherJoinsNorFailsTheJob) {
  Start(0);
  Start(1);
  const Layout load = MakeLayout(2, 1, false);
  const std::string lf = WriteLayout(load, "load2.json");
  pid_t rank0 = StartRank(0, lf, "keyed");
  WaitForJob("keyed");
  pv1::PlanPart part;
  for (const std::string key : {"", "not-the-job-key-but-long-enough"}) {
    grpc::Status s = JoinAs("keyed", X(), load, {1}, &node_, &part, key);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
  }
  grpc::Status f = Fetch("keyed", 0, X(), &node_, nullptr, nullptr);
  EXPECT_EQ(f.error_code(), grpc::StatusCode::PERMISSION_DENIED) << f.error_message();
  EXPECT_THAT(f.error_message(), HasSubstr("not a node of the job"));
  pid_t rank1 = StartRank(1, lf, "keyed");
  EXPECT_EQ(WaitExit(rank0, std::chrono::seconds(30)), 0) << Slurp(tmp_.Sub("keyed.log"));
  EXPECT_EQ(WaitExit(rank1, std::chrono::seconds(30)), 0) << Slurp(tmp_.Sub("keyed.log"));
  ExpectOutputsOfOfflineLoad(load, "keyed");
  EXPECT_THAT(Slurp(nodes_[0]->log()), HasSubstr("refused; the job goes on"));
}

// A member joining for a rank another node serves (the coordinator's own
// rank 0) fails the job naming both nodes, whichever of the two joins came
// first (issue 33: before, a join that came first was merged with the
// coordinator's). The daemon keeps serving.
TEST_F(PeerAbuse, ARankJoinedFromTwoNodesFailsTheJobNamingBoth) {
  GiveAllFilesToA();
  Start(0);
  const Layout load = MakeLayout(2, 1, false);
  const std::string lf = WriteLayout(load, "load2.json");
  pid_t rank0 = StartRank(0, lf, "twice");
  WaitForJob("twice");
  pv1::PlanPart part;
  grpc::Status s = JoinAs("twice", X(), load, {0, 1}, &node_, &part);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("rank 0 joined from both"));
  EXPECT_THAT(s.error_message(), HasSubstr(X()));
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_NE(WaitExit(rank0, std::chrono::seconds(20)), 0);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(10));  // not the barrier
  EXPECT_THAT(Slurp(tmp_.Sub("twice.log")), HasSubstr("rank 0 joined from both"));
  EXPECT_TRUE(nodes_[0]->Alive());
}

// Node B flips one byte of every read it serves: every rank of the job
// fails with DATA_LOSS naming B, and nothing is written as a result.
TEST_F(PeerAbuse, FlippedByteFailsEveryRankWithDataLoss) {
  Start(0);
  Start(1, {"--testing-corrupt-served"});
  const Layout load = MakeLayout(4, 1, false);
  const std::string lf = WriteLayout(load, "load4.json");
  std::vector<pid_t> pids;
  for (int r = 0; r < 4; ++r) {
    pids.push_back(StartRank(r, lf, "flip", "flip." + std::to_string(r) + ".log"));
  }
  for (pid_t p : pids) EXPECT_NE(WaitExit(p, std::chrono::seconds(30)), 0);
  for (int r = 0; r < 4; ++r) {  // one log per rank: their lines cannot interleave
    const std::string log = Slurp(tmp_.Sub("flip." + std::to_string(r) + ".log"));
    EXPECT_THAT(log, HasSubstr("[DATA_LOSS]")) << "rank " << r << ": " << log;
    EXPECT_THAT(log, HasSubstr("from peer " + Addr(ports_[1]))) << "rank " << r << ": " << log;
  }
  EXPECT_FALSE(fs::exists(tmp_.Sub("out-flip/rank0.safetensors")));
  // Without the fault, the same job loads.
  nodes_[1].reset();
  Start(1);
  pids.clear();
  for (int r = 0; r < 4; ++r) pids.push_back(StartRank(r, lf, "clean"));
  for (pid_t p : pids) EXPECT_EQ(WaitExit(p, std::chrono::seconds(30)), 0) << Slurp(tmp_.Sub("clean.log"));
}

// New certificates by SIGHUP while a job is between its plan and its
// transfers: the job completes, and new connections meet the new certificate.
TEST_F(PeerAbuse, SighupRotatesCertificatesWithoutDroppingRunningJobs) {
  // Each daemon reads its own copy, replaced in place below.
  CertFiles live[2];
  StartWithOwnCertFiles(live, {"--testing-delay-part-ms", "1500"});
  EXPECT_EQ(testing::ServerCertName(certs_, Addr(ports_[0]), node_), "node");
  const CertFiles v2 = testing::MakeLeaf(certs_, "ca", "node-v2", "IP:127.0.0.1");
  ASSERT_FALSE(v2.cert.empty());
  const Layout load = MakeLayout(4, 1, false);
  const std::string lf = WriteLayout(load, "load4.json");
  std::vector<pid_t> pids;
  for (int r = 0; r < 4; ++r) pids.push_back(StartRank(r, lf, "rotate"));
  for (int i = 0; i < 500 && Slurp(nodes_[0]->log()).find("coordinator job=rotate") == std::string::npos; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_THAT(Slurp(nodes_[0]->log()), HasSubstr("coordinator job=rotate"));
  for (int i = 0; i < 2; ++i) {
    fs::copy_file(v2.cert, live[i].cert, fs::copy_options::overwrite_existing);
    fs::copy_file(v2.key, live[i].key, fs::copy_options::overwrite_existing);
    ::kill(nodes_[i]->pid(), SIGHUP);
  }
  for (pid_t p : pids) EXPECT_EQ(WaitExit(p, std::chrono::seconds(30)), 0) << Slurp(tmp_.Sub("rotate.log"));
  ExpectOutputsOfOfflineLoad(load, "rotate");
  for (int i = 0; i < 2; ++i) {
    EXPECT_THAT(Slurp(nodes_[i]->log()), HasSubstr("SIGHUP: peer TLS files reloaded"));
    EXPECT_EQ(testing::ServerCertName(certs_, Addr(ports_[i]), node_), "node-v2") << i;
  }
  // And the next job runs on the new certificates.
  pids.clear();
  for (int r = 0; r < 4; ++r) pids.push_back(StartRank(r, lf, "after"));
  for (pid_t p : pids) EXPECT_EQ(WaitExit(p, std::chrono::seconds(30)), 0) << Slurp(tmp_.Sub("after.log"));
}

// The daemon's address space (VmSize), in KiB.
uint64_t VmSizeKb(pid_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("VmSize:", 0) == 0) return std::stoull(line.substr(7));
  }
  return 0;
}

// Each rotation shuts the replaced server down on a thread of its own: a
// thread never joined kept its stack (8 MiB of address space) for the life
// of the daemon. 30 SIGHUPs now leave at most the last ones' behind.
TEST_F(PeerAbuse, ManySighupsLeaveNoRetiredServerThreadsBehind) {
  CertFiles live[2];
  StartWithOwnCertFiles(live, {});
  const pid_t pid = nodes_[0]->pid();
  auto reloads = [&] {
    const std::string log = Slurp(nodes_[0]->log());
    size_t n = 0;
    for (size_t at = log.find("SIGHUP: peer TLS files reloaded"); at != std::string::npos;
         at = log.find("SIGHUP: peer TLS files reloaded", at + 1)) {
      ++n;
    }
    return n;
  };
  auto rotate = [&](size_t i) {
    ::kill(pid, SIGHUP);
    for (int t = 0; t < 500 && reloads() < i; ++t) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    ASSERT_EQ(reloads(), i) << Slurp(nodes_[0]->log());
  };
  for (size_t i = 1; i <= 3; ++i) rotate(i);  // warm: gRPC's own pools grown
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  const uint64_t before = VmSizeKb(pid);
  for (size_t i = 4; i <= 33; ++i) {
    rotate(i);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));  // the old server's shutdown
  }
  const uint64_t after = VmSizeKb(pid);
  EXPECT_LT(after, before + 64 * 1024) << "VmSize grew from " << before << " kB to " << after
                                       << " kB over 30 SIGHUPs";
  EXPECT_EQ(testing::ServerCertName(certs_, Addr(ports_[0]), node_), "node");
}

// A SIGHUP with files the server cannot use (a key that does not match its
// certificate) changes nothing: the old certificate keeps serving, this
// node's own channels keep theirs, and jobs still run.
TEST_F(PeerAbuse, SighupWithAMismatchedKeyChangesNothing) {
  CertFiles live[2];
  StartWithOwnCertFiles(live, {});
  const CertFiles v2 = testing::MakeLeaf(certs_, "ca", "node-v2", "IP:127.0.0.1");
  ASSERT_FALSE(v2.cert.empty());
  fs::copy_file(v2.cert, live[0].cert, fs::copy_options::overwrite_existing);  // key stays v1
  ::kill(nodes_[0]->pid(), SIGHUP);
  for (int i = 0; i < 500 && Slurp(nodes_[0]->log()).find("not reloaded") == std::string::npos; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_THAT(Slurp(nodes_[0]->log()), HasSubstr("SIGHUP: peer TLS not reloaded, the old certificate stays"));
  EXPECT_EQ(testing::ServerCertName(certs_, Addr(ports_[0]), node_), "node");
  const Layout load = MakeLayout(4, 1, false);
  const std::string lf = WriteLayout(load, "load4.json");
  std::vector<pid_t> pids;
  for (int r = 0; r < 4; ++r) pids.push_back(StartRank(r, lf, "still"));
  for (pid_t p : pids) EXPECT_EQ(WaitExit(p, std::chrono::seconds(30)), 0) << Slurp(tmp_.Sub("still.log"));
}

}  // namespace
}  // namespace ckpt

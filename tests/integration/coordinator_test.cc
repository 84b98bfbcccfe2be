// Coordinator (domain logic, no network) and its gRPC service (over
// 127.0.0.1 with an OS-assigned port): joins and the layout check,
// rendezvous, heartbeats and failure detection with a fake clock,
// hyper-parameters, abort, bearer tokens, health, layout and memory queries;
// learning-rate validation and reporting, and which services need the token;
// metrics in heartbeats, step-time windows, slow ranks and abort causes; the
// coordinator rank 0 serves under srun (lost sessions, a taken port, a
// client that starts first).
#include "server/coordinator.h"

#include <grpcpp/generic/generic_stub.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <thread>

#include "absl/strings/str_cat.h"
#include "client/coordinator_client.h"
#include "client/join_request.h"
#include "common/hyper_params.h"
#include "common/membership.h"
#include "common/planner.h"
#include "gtest/gtest.h"
#include "server/coordinator_service.h"
#include "server/hosted_coordinator.h"
#include "server/shard_owner_service.h"
#include "server/rpc_server.h"
#include "tests/testing/poll.h"

namespace shardopt {
namespace {

ParamSpec P(const std::string& name, std::vector<int64_t> shape) {
  ParamSpec p;
  p.name = name;
  p.shape = std::move(shape);
  return p;
}

JoinInfo Info(int rank, int world, std::vector<ParamSpec> params) {
  JoinInfo j;
  j.job_id = "job";
  j.rank = rank;
  j.world_size = world;
  j.host = "127.0.0.1";
  j.shard_owner_port = 1000 + rank;
  j.params = std::move(params);
  auto plan = Plan(j.params, std::max(world, 1), j.plan);
  j.layout_hash = plan.ok() ? plan->hash() : 0;
  return j;
}

struct FakeClock {
  absl::Time t = absl::FromUnixSeconds(1000);
};

CoordinatorOptions Options(int world, FakeClock* clock) {
  CoordinatorOptions o;
  o.world_size = world;
  o.heartbeat_timeout = absl::Seconds(10);
  o.now = [clock] { return clock->t; };
  return o;
}

TEST(CoordinatorTest, JoinPlansAndReturnsPeers) {
  FakeClock clock;
  Coordinator c(Options(2, &clock));
  std::vector<ParamSpec> model = {P("w", {10, 10}), P("b", {10})};
  absl::StatusOr<JoinResult> r0, r1;
  std::thread t0([&] { r0 = c.Join(Info(0, 2, model), absl::Seconds(10)); });
  std::thread t1([&] { r1 = c.Join(Info(1, 2, model), absl::Seconds(10)); });
  t0.join();
  t1.join();
  ASSERT_TRUE(r0.ok()) << r0.status();
  ASSERT_TRUE(r1.ok()) << r1.status();
  EXPECT_EQ(r0->peers, (std::vector<std::string>{"127.0.0.1:1000", "127.0.0.1:1001"}));
  EXPECT_EQ(r0->layout_hash, Plan(model, 2)->hash());
  EXPECT_EQ(c.GetJob().state, JobState::kRunning);
  EXPECT_EQ(c.Join(Info(1, 2, model), absl::Seconds(1)).status().code(),
            absl::StatusCode::kAlreadyExists);
}

TEST(CoordinatorTest, ADifferentModelIsRefusedNamingTheParameter) {
  FakeClock clock;
  Coordinator c(Options(2, &clock));
  absl::StatusOr<JoinResult> r0, r1;
  std::thread t0([&] {
    r0 = c.Join(Info(0, 2, {P("w", {10, 10}), P("b", {10})}), absl::Seconds(2));
  });
  r1 = c.Join(Info(1, 2, {P("w", {10, 10}), P("b", {11})}), absl::Seconds(10));
  t0.join();
  EXPECT_EQ(r1.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(r1.status().message().find("'b' [10]"), absl::string_view::npos) << r1.status();
  EXPECT_NE(r1.status().message().find("'b' [11]"), absl::string_view::npos) << r1.status();
  // Rank 0 waits for the missing rank only until its deadline.
  EXPECT_EQ(r0.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(r0.status().message().find("ranks 1 did not join"), absl::string_view::npos);
}

TEST(CoordinatorTest, BadJoinsAreRefused) {
  FakeClock clock;
  Coordinator c(Options(2, &clock));
  std::vector<ParamSpec> model = {P("w", {4})};
  JoinInfo bad = Info(2, 2, model);
  EXPECT_EQ(c.Join(bad, absl::Seconds(1)).status().code(), absl::StatusCode::kInvalidArgument);
  bad = Info(0, 3, model);
  EXPECT_NE(c.Join(bad, absl::Seconds(1)).status().message().find("world size"),
            absl::string_view::npos);
  bad = Info(0, 2, model);
  bad.job_id = "other";
  EXPECT_EQ(c.Join(bad, absl::Seconds(1)).status().code(), absl::StatusCode::kInvalidArgument);
  bad = Info(0, 2, model);
  bad.shard_owner_port = 70000;
  EXPECT_EQ(c.Join(bad, absl::Seconds(1)).status().code(), absl::StatusCode::kInvalidArgument);
  bad = Info(0, 2, {P("w", {0})});
  bad.layout_hash = 0;
  EXPECT_EQ(c.Join(bad, absl::Seconds(1)).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c.KvSet("", "x").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c.KvSet(std::string(600, 'k'), "x").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c.KvSet("k", std::string(kMaxValueBytes + 1, 'v')).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c.Heartbeat({5, 0, 0, 0}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c.Heartbeat({0, 0, 0, 0}).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(c.SetLearningRate(-1).status().code(), absl::StatusCode::kInvalidArgument);
}

// A rank that joined early waited for the others before it could heartbeat:
// the heartbeat clocks start when the whole job has joined.
TEST(CoordinatorTest, HeartbeatClocksStartWhenTheJobDoes) {
  FakeClock clock;
  Coordinator c(Options(2, &clock));
  std::vector<ParamSpec> model = {P("w", {8})};
  std::thread t0([&] { ASSERT_TRUE(c.Join(Info(0, 2, model), absl::Seconds(30)).ok()); });
  // Rank 1 joins 15 s (fake) after rank 0, longer than the 10 s timeout.
  auto rank0_joined = [&] {
    const JobStatus j = c.GetJob();
    return !j.ranks.empty() && j.ranks[0].joined;
  };
  ASSERT_TRUE(PollUntil(rank0_joined, absl::Seconds(10), absl::Milliseconds(10)));
  clock.t += absl::Seconds(15);
  ASSERT_TRUE(c.Join(Info(1, 2, model), absl::Seconds(30)).ok());
  t0.join();
  EXPECT_FALSE(c.CheckHeartbeats()) << c.GetJob().failure;
  EXPECT_EQ(c.GetJob().state, JobState::kRunning);
  clock.t += absl::Seconds(11);
  EXPECT_TRUE(c.CheckHeartbeats());  // now both are silent for 11 s
}

TEST(CoordinatorTest, SilentRankFailsTheJobAndEveryoneLearnsAtTheNextHeartbeat) {
  FakeClock clock;
  Coordinator c(Options(2, &clock));
  std::vector<ParamSpec> model = {P("w", {8})};
  std::thread t0([&] { ASSERT_TRUE(c.Join(Info(0, 2, model), absl::Seconds(10)).ok()); });
  ASSERT_TRUE(c.Join(Info(1, 2, model), absl::Seconds(10)).ok());
  t0.join();
  clock.t += absl::Seconds(5);
  ASSERT_TRUE(c.Heartbeat({0, 3, 0.5, 100}).ok());
  ASSERT_TRUE(c.Heartbeat({1, 3, 0.5, 100}).ok());
  EXPECT_FALSE(c.CheckHeartbeats());
  clock.t += absl::Seconds(6);
  ASSERT_TRUE(c.Heartbeat({0, 4, 0.4, 100}).ok());
  EXPECT_FALSE(c.CheckHeartbeats());  // rank 1 silent for 6 s < 10 s
  clock.t += absl::Seconds(5);
  EXPECT_TRUE(c.CheckHeartbeats());  // rank 1 silent for 11 s
  JobStatus j = c.GetJob();
  EXPECT_EQ(j.state, JobState::kFailed);
  EXPECT_NE(j.failure.find("rank 1 sent no heartbeat"), std::string::npos) << j.failure;
  EXPECT_NE(j.failure.find("last step 3"), std::string::npos) << j.failure;
  auto hb = c.Heartbeat({0, 5, 0.4, 100});
  ASSERT_TRUE(hb.ok());
  EXPECT_TRUE(hb->abort);
  EXPECT_EQ(hb->abort_reason, j.failure);
}

// The rank-hosted coordinator (srun, Indexed Jobs) has no launcher watching
// the ranks' processes: a session that ends without a Finish fails the job
// after a short grace, unless the rank's heartbeats go on (a broken
// connection it recovered from), and never for a rank that finished.
TEST(CoordinatorTest, LostSessionFailsTheJobAfterItsGrace) {
  FakeClock clock;
  CoordinatorOptions o = Options(3, &clock);
  o.session_loss_grace = absl::Seconds(2);
  Coordinator c(o);
  std::vector<ParamSpec> model = {P("w", {8})};
  std::thread t0([&] { ASSERT_TRUE(c.Join(Info(0, 3, model), absl::Seconds(10)).ok()); });
  std::thread t1([&] { ASSERT_TRUE(c.Join(Info(1, 3, model), absl::Seconds(10)).ok()); });
  ASSERT_TRUE(c.Join(Info(2, 3, model), absl::Seconds(10)).ok());
  t0.join();
  t1.join();
  ASSERT_TRUE(c.Heartbeat({1, 4, 0.5, 100}).ok());
  c.SessionLost(1);
  clock.t += absl::Seconds(1);
  EXPECT_FALSE(c.CheckHeartbeats());
  ASSERT_TRUE(c.Heartbeat({1, 5, 0.5, 100}).ok());  // it reconnected: not lost
  clock.t += absl::Seconds(3);
  EXPECT_FALSE(c.CheckHeartbeats()) << c.GetJob().failure;
  ASSERT_TRUE(c.Finish(0).ok());
  c.SessionLost(0);  // a finished rank's session ends normally
  clock.t += absl::Seconds(3);
  ASSERT_TRUE(c.Heartbeat({1, 6, 0.5, 100}).ok());
  ASSERT_TRUE(c.Heartbeat({2, 6, 0.5, 100}).ok());
  EXPECT_FALSE(c.CheckHeartbeats()) << c.GetJob().failure;
  c.SessionLost(2);
  clock.t += absl::Seconds(1);
  EXPECT_FALSE(c.CheckHeartbeats());  // within the grace
  clock.t += absl::Seconds(2);
  EXPECT_TRUE(c.CheckHeartbeats());
  const JobStatus j = c.GetJob();
  EXPECT_EQ(j.state, JobState::kFailed);
  EXPECT_NE(j.failure.find("rank 2 lost its connection to the coordinator at step 6 without "
                           "finishing (on host 127.0.0.1)"),
            std::string::npos)
      << j.failure;
}

TEST(CoordinatorTest, LostSessionsAreIgnoredWithoutAGrace) {
  FakeClock clock;
  Coordinator c(Options(2, &clock));  // shardrun's: its supervisor sees exits itself
  std::vector<ParamSpec> model = {P("w", {8})};
  std::thread t0([&] { ASSERT_TRUE(c.Join(Info(0, 2, model), absl::Seconds(10)).ok()); });
  ASSERT_TRUE(c.Join(Info(1, 2, model), absl::Seconds(10)).ok());
  t0.join();
  c.SessionLost(1);
  clock.t += absl::Seconds(5);
  EXPECT_FALSE(c.CheckHeartbeats()) << c.GetJob().failure;
}

TEST(CoordinatorTest, LearningRateVersionsAbortAndFinish) {
  FakeClock clock;
  Coordinator c(Options(1, &clock));
  ASSERT_TRUE(c.Join(Info(0, 1, {P("w", {8})}), absl::Seconds(1)).ok());
  EXPECT_EQ(*c.SetLearningRate(0.5), 1);
  EXPECT_EQ(*c.SetLearningRate(0.25), 2);
  auto hb = c.Heartbeat({0, 1, 0, 0});
  EXPECT_EQ(hb->learning_rate, 0.25);
  EXPECT_EQ(hb->hyper_params_version, 2);
  ASSERT_TRUE(c.Finish(0).ok());
  EXPECT_EQ(c.GetJob().state, JobState::kFinished);
  Coordinator d(Options(1, &clock));
  d.Abort("disk on fire", 0);
  EXPECT_EQ(d.GetJob().failure, "rank 0: disk on fire");
  EXPECT_EQ(d.Join(Info(0, 1, {P("w", {8})}), absl::Seconds(1)).status().code(),
            absl::StatusCode::kAborted);
}

// The service over gRPC.
struct Served {
  FakeClock clock;
  Coordinator coordinator;
  CoordinatorService service;
  std::unique_ptr<RpcServer> server;
  explicit Served(const std::string& token, int world = 1)
      : coordinator([&] {
          CoordinatorOptions o;
          o.world_size = world;
          return o;
        }()),
        service(&coordinator, token) {
    auto s = RpcServer::Start(RpcServerOptions(), {&service});
    EXPECT_TRUE(s.ok()) << s.status();
    server = std::move(*s);
  }
};

TEST(CoordinatorServiceTest, TokenIsRequiredOnEveryRpc) {
  Served s("sesame");
  CoordinatorClient none(s.server->address(), "");
  CoordinatorClient wrong(s.server->address(), "open");
  CoordinatorClient right(s.server->address(), "sesame");
  EXPECT_EQ(none.GetJob().status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(wrong.GetJob().status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(wrong.KvSet("k", "v").code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(wrong.SetLearningRate(1).status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(wrong.Abort("x", -1).code(), absl::StatusCode::kUnauthenticated);
  EXPECT_TRUE(right.GetJob().ok());
  EXPECT_EQ(s.coordinator.GetJob().state, JobState::kStarting);  // the bad abort did nothing
}

TEST(CoordinatorServiceTest, RendezvousHealthLayoutAndMemory) {
  Served s("");
  CoordinatorClient client(s.server->address(), "");
  GrpcKeyValueStore kv(&client);
  std::thread setter([&] { EXPECT_TRUE(kv.Set("a/b", std::string("\0\1", 2)).ok()); });
  auto v = kv.Get("a/b", absl::Seconds(10));
  setter.join();
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*v, std::string("\0\1", 2));
  EXPECT_EQ(kv.Get("missing", absl::Milliseconds(50)).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  auto h = client.Health();
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(*h, "SERVING");
  EXPECT_EQ(client.GetLayout().status().code(), absl::StatusCode::kFailedPrecondition);

  // A shard owner for rank 0, then the join.
  ShardOwnerService owner(
      [] {
        v1::GetShardInfoResponse r;
        r.set_state_bytes(1234);
        r.set_param_bytes(99);
        return r;
      },
      "");
  auto owner_server = RpcServer::Start(RpcServerOptions(), {&owner});
  ASSERT_TRUE(owner_server.ok());
  auto planned = Plan({P("w", {100, 3}), P("b", {3})}, 1);
  ASSERT_TRUE(planned.ok()) << planned.status();
  JoinRequestInfo info;
  info.shard_owner_port = (*owner_server)->port();
  v1::JoinRequest join = MakeJoinRequest(*planned, info);
  auto joined = client.Join(join, absl::Seconds(10));
  ASSERT_TRUE(joined.ok()) << joined.status();
  auto layout = client.GetLayout();
  ASSERT_TRUE(layout.ok());
  EXPECT_EQ(layout->num_elements(), 303);
  EXPECT_EQ(layout->ranges_size(), 1);
  EXPECT_EQ(layout->ranges(0).params_size(), 2);
  auto mem = client.GetMemory();
  ASSERT_TRUE(mem.ok()) << mem.status();
  ASSERT_EQ(mem->ranks_size(), 1);
  EXPECT_EQ(mem->ranks(0).state_bytes(), 1234);
  EXPECT_GT(mem->ranks(0).rss_bytes(), 0);
  // Bad field over the wire.
  join.set_rank(7);
  EXPECT_EQ(client.Join(join, absl::Seconds(2)).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// The coordinator rank 0 serves under srun: a taken port is one error that
// names SHARDOPT_PORT; a client started before it listens reaches it once
// it does (WaitUntilReachable); AwaitEnd does not wait for a job that never
// started.
TEST(HostedCoordinatorTest, PortTakenReachLaterAndAwaitEnd) {
  HostedCoordinatorOptions o;
  o.listen = "127.0.0.1:0";
  o.world_size = 2;
  auto first = HostedCoordinator::Start(o);
  ASSERT_TRUE(first.ok()) << first.status();
  const int port = (*first)->port();
  ASSERT_GT(port, 0);
  o.listen = absl::StrCat("127.0.0.1:", port);
  auto second = HostedCoordinator::Start(o);
  ASSERT_FALSE(second.ok());
  EXPECT_NE(second.status().message().find("SHARDOPT_PORT"), absl::string_view::npos)
      << second.status();
  const absl::Time t0 = absl::Now();
  const JobStatus j = (*first)->AwaitEnd(absl::Seconds(30));
  EXPECT_EQ(j.state, JobState::kStarting);
  EXPECT_LT(absl::Now() - t0, absl::Seconds(5));
  first->reset();  // the port is free again

  CoordinatorClient early(absl::StrCat("127.0.0.1:", port), "");
  absl::Status reached;
  std::thread waiter([&] { reached = early.WaitUntilReachable(absl::Seconds(20)); });
  absl::SleepFor(absl::Milliseconds(500));  // on purpose: the client starts first
  auto late = HostedCoordinator::Start(o);
  ASSERT_TRUE(late.ok()) << late.status();
  waiter.join();
  EXPECT_TRUE(reached.ok()) << reached;
  EXPECT_TRUE(early.GetJob().ok());
  CoordinatorClient nobody("127.0.0.1:1", "");
  absl::Status s = nobody.WaitUntilReachable(absl::Milliseconds(300));
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(s.message().find("127.0.0.1:1"), absl::string_view::npos) << s;
}

TEST(CoordinatorServiceTest, UnreachableCoordinatorIsOneClearError) {
  CoordinatorClient client("127.0.0.1:1", "");
  auto j = client.GetJob(absl::Seconds(2));
  EXPECT_EQ(j.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(j.status().message().find("cannot reach the coordinator"), absl::string_view::npos)
      << j.status();
}

}  // namespace
}  // namespace shardopt

namespace shardopt {
namespace {

// Certificates made by openssl for this test: a CA, a server certificate for
// 127.0.0.1, a client certificate.
std::string MakeCerts() {
  const std::string d = ::testing::TempDir() + "/certs";
  const std::string cmd =
      "set -e; rm -rf " + d + "; mkdir -p " + d + "; cd " + d +
      "; openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem -days 2 "
      "-subj /CN=test-ca 2>/dev/null"
      "; openssl req -newkey rsa:2048 -nodes -keyout server.key -out server.csr "
      "-subj /CN=127.0.0.1 2>/dev/null"
      "; printf 'subjectAltName=IP:127.0.0.1,DNS:localhost' > san.ext"
      "; openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial "
      "-out server.pem -days 2 -extfile san.ext 2>/dev/null"
      "; openssl req -newkey rsa:2048 -nodes -keyout client.key -out client.csr "
      "-subj /CN=rank 2>/dev/null"
      "; openssl x509 -req -in client.csr -CA ca.pem -CAkey ca.key -CAcreateserial "
      "-out client.pem -days 2 2>/dev/null";
  EXPECT_EQ(std::system(cmd.c_str()), 0);
  return d;
}

TEST(TlsTest, TlsAndMutualTls) {
  const std::string d = MakeCerts();
  CoordinatorOptions o;
  Coordinator coordinator(o);
  CoordinatorService service(&coordinator, "");
  RpcServerOptions tls;
  tls.tls_cert_file = d + "/server.pem";
  tls.tls_key_file = d + "/server.key";
  auto server = RpcServer::Start(tls, {&service});
  ASSERT_TRUE(server.ok()) << server.status();
  auto creds = MakeChannelCredentials({d + "/ca.pem", "", ""});
  ASSERT_TRUE(creds.ok());
  CoordinatorClient good((*server)->address(), "", *creds);
  EXPECT_TRUE(good.GetJob().ok()) << good.GetJob().status();
  CoordinatorClient plain((*server)->address(), "");
  EXPECT_FALSE(plain.GetJob(absl::Seconds(2)).ok());

  RpcServerOptions mtls = tls;
  mtls.tls_client_ca_file = d + "/ca.pem";
  auto mserver = RpcServer::Start(mtls, {&service});
  ASSERT_TRUE(mserver.ok()) << mserver.status();
  CoordinatorClient no_cert((*mserver)->address(), "", *creds);
  EXPECT_FALSE(no_cert.GetJob(absl::Seconds(2)).ok());
  auto mcreds = MakeChannelCredentials({d + "/ca.pem", d + "/client.pem", d + "/client.key"});
  ASSERT_TRUE(mcreds.ok());
  CoordinatorClient with_cert((*mserver)->address(), "", *mcreds);
  EXPECT_TRUE(with_cert.GetJob().ok()) << with_cert.GetJob().status();

  // The coordinator-to-owner hop: a shard owner served over TLS (as shardrun
  // --tls-cert makes the ranks do) answers a coordinator given TLS
  // credentials for its owners, and not one that speaks plaintext.
  ShardOwnerService owner(
      [] {
        v1::GetShardInfoResponse r;
        r.set_state_bytes(1234);
        return r;
      },
      "");
  auto owner_server = RpcServer::Start(tls, {&owner});
  ASSERT_TRUE(owner_server.ok()) << owner_server.status();
  auto planned = Plan({P("w", {100, 3})}, 1);
  ASSERT_TRUE(planned.ok()) << planned.status();
  JoinRequestInfo info;
  info.shard_owner_port = (*owner_server)->port();
  for (bool with_tls : {true, false}) {
    Coordinator c2(o);
    CoordinatorService svc(&c2, "");
    if (with_tls) svc.SetOwnerCredentials(*creds);
    auto srv = RpcServer::Start(RpcServerOptions(), {&svc});
    ASSERT_TRUE(srv.ok()) << srv.status();
    CoordinatorClient c((*srv)->address(), "");
    ASSERT_TRUE(c.Join(MakeJoinRequest(*planned, info), absl::Seconds(10)).ok());
    auto mem = c.GetMemory();
    ASSERT_TRUE(mem.ok()) << mem.status();
    ASSERT_EQ(mem->ranks_size(), 1);
    if (with_tls) {
      EXPECT_EQ(mem->ranks(0).error(), "");
      EXPECT_EQ(mem->ranks(0).state_bytes(), 1234);
    } else {
      EXPECT_NE(mem->ranks(0).error(), "") << "a plaintext coordinator must not reach a TLS owner";
      EXPECT_EQ(mem->ranks(0).state_bytes(), 0);
    }
    (*srv)->Shutdown();
  }

  RpcServerOptions bad = tls;
  bad.tls_key_file = d + "/missing.key";
  EXPECT_EQ(RpcServer::Start(bad, {&service}).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(MakeChannelCredentials({"", d + "/client.pem", ""}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace shardopt

namespace shardopt {
namespace {

TEST(SessionTest, NoticesArePushedWithoutWaitingForAHeartbeat) {
  CoordinatorOptions o;
  o.world_size = 1;
  Coordinator coordinator(o);
  CoordinatorService service(&coordinator, "");
  auto server = RpcServer::Start(RpcServerOptions(), {&service});
  ASSERT_TRUE(server.ok());
  ASSERT_TRUE(coordinator.Join(Info(0, 1, {P("w", {8})}), absl::Seconds(5)).ok());
  CoordinatorClient client((*server)->address(), "");
  auto session = client.OpenSession();
  v1::HeartbeatRequest hb;
  hb.set_rank(0);
  hb.set_step(3);
  ASSERT_TRUE(session->Send(hb));
  v1::HeartbeatResponse notice;
  ASSERT_TRUE(session->Receive(&notice));  // the answer to the first heartbeat
  EXPECT_FALSE(notice.abort());
  EXPECT_EQ(coordinator.GetJob().ranks[0].step, 3);
  ASSERT_TRUE(client.SetLearningRate(0.25).ok());
  ASSERT_TRUE(session->Receive(&notice));  // pushed
  EXPECT_EQ(notice.learning_rate(), 0.25);
  ASSERT_TRUE(client.RequestCheckpoint().ok());
  ASSERT_TRUE(session->Receive(&notice));
  EXPECT_EQ(notice.checkpoint_request(), 1);
  const absl::Time t0 = absl::Now();
  ASSERT_TRUE(client.Abort("operator said so", -1).ok());
  ASSERT_TRUE(session->Receive(&notice));
  EXPECT_TRUE(notice.abort());
  EXPECT_EQ(notice.abort_reason(), "operator said so");
  EXPECT_LT(absl::Now() - t0, absl::Seconds(1));
  session->Close();
  EXPECT_FALSE(session->Receive(&notice));
}

// Every notice pushed on a session carries only the newest resize's leaving
// ranks: the session's message is rebuilt, not appended to (after a drain of
// rank 0, the ranks that stayed took a later grow for their own leave).
TEST(SessionTest, EachNoticeCarriesOnlyTheNewestResize) {
  CoordinatorOptions o;
  o.world_size = 2;
  Coordinator coordinator(o);
  CoordinatorService service(&coordinator, "");
  auto server = RpcServer::Start(RpcServerOptions(), {&service});
  ASSERT_TRUE(server.ok());
  std::vector<std::thread> joins;
  std::vector<absl::Status> joined(2);
  for (int r = 0; r < 2; ++r) {
    joins.emplace_back([&, r] {
      JoinInfo j = Info(r, 2, {P("w", {8})});
      j.elastic = true;
      joined[r] = coordinator.Join(j, absl::Seconds(10)).status();
    });
  }
  for (auto& t : joins) t.join();
  for (const auto& s : joined) ASSERT_TRUE(s.ok()) << s;
  CoordinatorClient client((*server)->address(), "");
  auto session = client.OpenSession();
  v1::HeartbeatRequest hb;
  hb.set_rank(1);
  ASSERT_TRUE(session->Send(hb));
  v1::HeartbeatResponse notice;
  ASSERT_TRUE(session->Receive(&notice));
  ASSERT_TRUE(coordinator.RequestResize(1, {0}).ok());  // drain rank 0
  ASSERT_TRUE(session->Receive(&notice));
  ASSERT_EQ(notice.resize_leave_size(), 1);
  for (int i = 1; i <= 3; ++i) {
    ASSERT_TRUE(client.SetLearningRate(0.1 * i).ok());
    ASSERT_TRUE(session->Receive(&notice));
    ASSERT_EQ(notice.resize_leave_size(), 1) << "push " << i;
    EXPECT_EQ(notice.resize_leave(0), 0);
    EXPECT_EQ(RankAfterResize(1, {notice.resize_leave().begin(), notice.resize_leave().end()}), 0);
  }
  session->Close();
}

TEST(SessionTest, WrongTokenEndsTheSession) {
  CoordinatorOptions o;
  Coordinator coordinator(o);
  CoordinatorService service(&coordinator, "sesame");
  auto server = RpcServer::Start(RpcServerOptions(), {&service});
  ASSERT_TRUE(server.ok());
  CoordinatorClient client((*server)->address(), "wrong");
  auto session = client.OpenSession();
  v1::HeartbeatResponse notice;
  EXPECT_FALSE(session->Receive(&notice));
}

}  // namespace
}  // namespace shardopt

// Issue 12: bad learning rates, the learning rate status reports, and which
// services answer without the token.
namespace shardopt {
namespace {

// The rule itself is tested with the shared table (tests/unit/hyper_params_test.cc);
// here: the coordinator applies it to SetLearningRate.
TEST(LearningRateTest, SetLearningRateUsesTheSharedRule) {
  FakeClock clock;
  Coordinator c(Options(1, &clock));
  for (double bad : std::vector<double>{1e39, std::nan(""), INFINITY, -INFINITY, -1.0, 0.0, 1e-46,
                                        1e-40, -1e-3}) {
    auto v = c.SetLearningRate(bad);
    EXPECT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_EQ(v.status(), ValidateLearningRateChange(bad)) << bad;
  }
  EXPECT_NE(ValidateLearningRateChange(1e39).message().find("3.4028235e+38"),
            absl::string_view::npos)
      << ValidateLearningRateChange(1e39);
  EXPECT_NE(ValidateLearningRateChange(1e-46).message().find("0 means 'no change'"),
            absl::string_view::npos)
      << ValidateLearningRateChange(1e-46);
}

TEST(LearningRateTest, SetLrRefusesBadValuesOverGrpcAndTheJobKeepsRunning) {
  Served s("sesame", 1);
  ASSERT_TRUE(s.coordinator.Join(Info(0, 1, {P("w", {8})}), absl::Seconds(5)).ok());
  CoordinatorClient client(s.server->address(), "sesame");
  for (double bad : std::vector<double>{1e39, std::nan(""), INFINITY, -1.0, 0.0, 1e-46}) {
    auto v = client.SetLearningRate(bad);
    EXPECT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument) << bad << ": " << v.status();
    EXPECT_NE(v.status().message().find("invalid lr"), absl::string_view::npos) << v.status();
  }
  auto v = client.SetLearningRate(1e-3);
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*v, 1);  // the refused ones took no version
  auto job = client.GetJob();
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->state(), "running");
  EXPECT_EQ(job->requested_learning_rate(), 1e-3);
  EXPECT_EQ(s.coordinator.Notice().learning_rate, 1e-3);
}

TEST(LearningRateTest, StatusReportsTheLearningRateTheRanksTrainWith) {
  FakeClock clock;
  Coordinator c(Options(2, &clock));
  std::vector<ParamSpec> model = {P("w", {8})};
  JoinInfo j0 = Info(0, 2, model), j1 = Info(1, 2, model);
  j0.learning_rate = j1.learning_rate = 1e-4;
  std::thread t0([&] { ASSERT_TRUE(c.Join(j0, absl::Seconds(10)).ok()); });
  ASSERT_TRUE(c.Join(j1, absl::Seconds(10)).ok());
  t0.join();
  // Never set with set-lr: the ranks' own (this was "lr 0").
  EXPECT_EQ(c.GetJob().learning_rate, 1e-4);
  EXPECT_EQ(c.GetJob().requested_learning_rate, 0);
  // Requested, not applied yet: still the ranks' one.
  ASSERT_TRUE(c.SetLearningRate(1e-3).ok());
  EXPECT_EQ(c.GetJob().learning_rate, 1e-4);
  EXPECT_EQ(c.GetJob().requested_learning_rate, 1e-3);
  HeartbeatInfo hb{0, 5, 0.5, 100, 7};
  hb.learning_rate = 1e-3;
  ASSERT_TRUE(c.Heartbeat(hb).ok());
  hb.rank = 1;
  ASSERT_TRUE(c.Heartbeat(hb).ok());
  EXPECT_EQ(c.GetJob().learning_rate, 1e-3);
  EXPECT_EQ(c.GetJob().ranks[1].learning_rate, 1e-3);
  // A heartbeat that does not report it (0) keeps the last report.
  ASSERT_TRUE(c.Heartbeat({0, 6, 0.5, 100}).ok());
  EXPECT_EQ(c.GetJob().learning_rate, 1e-3);
  hb.learning_rate = std::nan("");
  EXPECT_EQ(c.Heartbeat(hb).status().code(), absl::StatusCode::kInvalidArgument);

  // Ranks that report nothing: the requested one, as before.
  Coordinator d(Options(1, &clock));
  ASSERT_TRUE(d.Join(Info(0, 1, model), absl::Seconds(5)).ok());
  EXPECT_EQ(d.GetJob().learning_rate, 0);
  ASSERT_TRUE(d.SetLearningRate(0.25).ok());
  EXPECT_EQ(d.GetJob().learning_rate, 0.25);
}

TEST(LearningRateTest, GetJobCarriesTheRanksLearningRateOverGrpc) {
  Served s("", 1);
  CoordinatorClient client(s.server->address(), "");
  auto planned = Plan({P("w", {8})}, 1);
  ASSERT_TRUE(planned.ok()) << planned.status();
  JoinRequestInfo info;
  info.shard_owner_port = 1000;
  info.learning_rate = 1e-4;
  ASSERT_TRUE(client.Join(MakeJoinRequest(*planned, info), absl::Seconds(10)).ok());
  auto job = client.GetJob();
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->learning_rate(), 1e-4);
  EXPECT_EQ(job->ranks(0).learning_rate(), 1e-4);
  v1::HeartbeatRequest hb;
  hb.set_rank(0);
  hb.set_learning_rate(2e-4);
  ASSERT_TRUE(client.Heartbeat(hb).ok());
  EXPECT_EQ(client.GetJob()->learning_rate(), 2e-4);
}

// grpc.reflection.v1alpha ListServices over a generic stream: the names of
// the services, or the call's error.
absl::StatusOr<std::string> ListServices(const std::string& address) {
  auto channel = grpc::CreateChannel(address, grpc::InsecureChannelCredentials());
  grpc::GenericStub stub(channel);
  grpc::CompletionQueue cq;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  auto call =
      stub.PrepareCall(&ctx, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", &cq);
  auto step = [&](intptr_t want) {
    void* tag = nullptr;
    bool ok = false;
    const auto r =
        cq.AsyncNext(&tag, &ok, std::chrono::system_clock::now() + std::chrono::seconds(10));
    return r == grpc::CompletionQueue::GOT_EVENT && reinterpret_cast<intptr_t>(tag) == want && ok;
  };
  call->StartCall(reinterpret_cast<void*>(1));
  step(1);
  // ServerReflectionRequest{list_services: ""}: field 7, length 0.
  grpc::Slice req_slice(std::string("\x3a\x00", 2));
  grpc::ByteBuffer req(&req_slice, 1), resp;
  call->Write(req, reinterpret_cast<void*>(2));
  step(2);
  call->Read(&resp, reinterpret_cast<void*>(3));
  const bool got = step(3);
  call->WritesDone(reinterpret_cast<void*>(4));
  step(4);
  grpc::Status status;
  call->Finish(&status, reinterpret_cast<void*>(5));
  step(5);
  cq.Shutdown();
  void* tag;
  bool ok;
  while (cq.Next(&tag, &ok)) {
  }
  if (!status.ok()) {
    return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
  }
  if (!got) return absl::UnknownError("no reflection response");
  std::vector<grpc::Slice> slices;
  (void)resp.Dump(&slices);
  std::string bytes;
  for (const auto& s : slices) bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return bytes;
}

TEST(AccessPolicyTest, WithATokenOnlyHealthIsOpenAndReflectionIsNotServed) {
  Served s("sesame");
  EXPECT_FALSE(s.server->serves_reflection());
  CoordinatorClient none(s.server->address(), "");
  auto h = none.Health();
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(*h, "SERVING");  // probes carry no token
  EXPECT_EQ(none.GetJob().status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(none.KvGet("k", absl::Milliseconds(10)).status().code(),
            absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(ListServices(s.server->address()).status().code(), absl::StatusCode::kUnimplemented);
  // A shard owner with the token: the same.
  ShardOwnerService owner([] { return v1::GetShardInfoResponse(); }, "sesame");
  auto owner_server = RpcServer::Start(RpcServerOptions(), {&owner});
  ASSERT_TRUE(owner_server.ok());
  EXPECT_EQ(ListServices((*owner_server)->address()).status().code(),
            absl::StatusCode::kUnimplemented);
}

TEST(AccessPolicyTest, WithoutATokenReflectionListsTheServices) {
  Served s("");
  EXPECT_TRUE(s.server->serves_reflection());
  auto names = ListServices(s.server->address());
  ASSERT_TRUE(names.ok()) << names.status();
  EXPECT_NE(names->find("shardopt.v1.Coordinator"), std::string::npos) << *names;
  RpcServerOptions off;
  off.reflection = false;
  Coordinator c2{CoordinatorOptions()};
  CoordinatorService service2(&c2, "");
  auto server2 = RpcServer::Start(off, {&service2});
  ASSERT_TRUE(server2.ok());
  EXPECT_EQ(ListServices((*server2)->address()).status().code(), absl::StatusCode::kUnimplemented);
}

}  // namespace
}  // namespace shardopt

// Issue 16: metrics in heartbeats, step-time windows, slow ranks, abort causes.
namespace shardopt {
namespace {

// Joins `world` ranks of a one-parameter model.
void JoinAll(Coordinator* c, int world) {
  std::vector<std::thread> t;
  for (int r = 0; r < world; ++r) {
    t.emplace_back([c, r, world] {
      ASSERT_TRUE(c->Join(Info(r, world, {P("w", {64})}), absl::Seconds(10)).ok());
    });
  }
  for (auto& x : t) x.join();
}

HeartbeatInfo Beat(int rank, int64_t step, std::vector<double> step_seconds, double comm_wait = 0) {
  HeartbeatInfo hb{rank, step, 0.5, 10, 2 * step};
  hb.has_metrics = true;
  hb.metrics.step_seconds = std::move(step_seconds);
  hb.metrics.comm_wait_seconds = comm_wait;
  return hb;
}

TEST(MetricsTest, HeartbeatMetricsStepWindowAndHistogram) {
  FakeClock clock;
  Coordinator c(Options(2, &clock));
  JoinAll(&c, 2);
  HeartbeatInfo hb = Beat(0, 3, {0.2, 0.4, 0.3}, 0.05);
  hb.metrics.grad_norm = 1.5;
  hb.metrics.update_seconds = 0.01;
  hb.metrics.bytes_sent_total = 1000;
  hb.metrics.master_bytes = 1;
  hb.metrics.state_bytes = 2;
  hb.metrics.grad_bytes = 3;
  hb.metrics.param_bytes = 4;
  hb.metrics.rss_bytes = 5;
  hb.metrics.stalls_total = 1;
  hb.metrics.checkpoints_total = 1;
  hb.metrics.last_checkpoint_step = 3;
  hb.metrics.last_checkpoint_seconds = 0.7;
  hb.metrics.last_checkpoint_bytes = 4096;
  ASSERT_TRUE(c.Heartbeat(hb).ok());
  JobStatus j = c.GetJob();
  const RankState& r = j.ranks[0];
  EXPECT_TRUE(r.has_metrics);
  EXPECT_FALSE(j.ranks[1].has_metrics);
  EXPECT_EQ(r.metrics.grad_norm, 1.5);
  EXPECT_EQ(r.metrics.comm_wait_seconds, 0.05);
  EXPECT_EQ(r.metrics.update_seconds, 0.01);
  EXPECT_EQ(r.metrics.bytes_sent_total, 1000);
  EXPECT_EQ(r.metrics.rss_bytes, 5);
  EXPECT_EQ(r.metrics.stalls_total, 1);
  EXPECT_TRUE(r.metrics.step_seconds.empty());  // they go to the window
  EXPECT_DOUBLE_EQ(r.step_seconds_p50, 0.3);
  EXPECT_DOUBLE_EQ(r.step_seconds_max, 0.4);
  EXPECT_EQ(r.step_count, 3u);
  EXPECT_DOUBLE_EQ(r.step_seconds_sum, 0.9);
  // 0.2 and 0.3 in (0.1, 0.25] and (0.25, 0.5]; 0.4 too.
  const size_t b025 = std::find(kStepSecondsBounds.begin(), kStepSecondsBounds.end(), 0.25) -
                      kStepSecondsBounds.begin();
  EXPECT_EQ(r.step_bucket_counts[b025], 1u);
  EXPECT_EQ(r.step_bucket_counts[b025 + 1], 2u);
  // Rank 0's checkpoints are the job's; the coordinator notes when it learned.
  EXPECT_EQ(j.checkpoints_total, 1);
  EXPECT_EQ(j.last_checkpoint_step, 3);
  EXPECT_EQ(j.last_checkpoint_bytes, 4096);
  EXPECT_EQ(j.last_checkpoint_time, clock.t);
  clock.t += absl::Seconds(30);
  ASSERT_TRUE(c.Heartbeat(Beat(0, 4, {1.0})).ok());
  j = c.GetJob();
  EXPECT_EQ(j.last_checkpoint_time, clock.t - absl::Seconds(30));  // no new checkpoint
  EXPECT_DOUBLE_EQ(j.ranks[0].step_seconds_p50, 0.35);
  EXPECT_DOUBLE_EQ(j.ranks[0].step_seconds_max, 1.0);
  // Steps older than the window's 60 s drop out, without a heartbeat.
  clock.t += absl::Seconds(31);
  j = c.GetJob();
  EXPECT_DOUBLE_EQ(j.ranks[0].step_seconds_p50, 1.0);
  EXPECT_EQ(j.ranks[0].step_count, 4u);  // the histogram keeps everything
  clock.t += absl::Seconds(30);
  EXPECT_EQ(c.GetJob().ranks[0].step_seconds_p50, 0);
  // At most kStepWindowSteps steps.
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(c.Heartbeat(Beat(1, 100 * (i + 1), std::vector<double>(100, 0.01 * (i + 1)))).ok());
  }
  j = c.GetJob();
  EXPECT_DOUBLE_EQ(j.ranks[1].step_seconds_p50, 0.025);  // 100 x 0.02 and 100 x 0.03
  EXPECT_DOUBLE_EQ(j.ranks[1].step_seconds_max, 0.03);
  EXPECT_EQ(j.ranks[1].step_count, 300u);
}

TEST(MetricsTest, BadMetricsAreRefusedNamingTheField) {
  FakeClock clock;
  Coordinator c(Options(1, &clock));
  JoinAll(&c, 1);
  auto refused = [&](HeartbeatInfo hb, const std::string& field) {
    auto r = c.Heartbeat(hb);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << field;
    EXPECT_NE(r.status().message().find(field), absl::string_view::npos) << r.status();
  };
  refused(Beat(0, 1, std::vector<double>(kMaxStepTimesPerHeartbeat + 1, 0.1)), "step_seconds");
  refused(Beat(0, 1, {0.1, std::nan("")}), "step_seconds");
  refused(Beat(0, 1, {-0.1}), "step_seconds");
  refused(Beat(0, 1, {0.1}, HUGE_VAL), "comm_wait_seconds");
  HeartbeatInfo hb = Beat(0, 1, {0.1});
  hb.metrics.rss_bytes = -1;
  refused(hb, "rss_bytes");
  hb = Beat(0, 1, {0.1});
  hb.metrics.last_checkpoint_seconds = -1;
  refused(hb, "last_checkpoint_seconds");
  EXPECT_FALSE(c.GetJob().ranks[0].has_metrics);  // nothing of them was kept
  // Exactly the limit is fine; a non-finite gradient norm is reported as such.
  hb = Beat(0, 1, std::vector<double>(kMaxStepTimesPerHeartbeat, 0.1));
  hb.metrics.grad_norm = std::nan("");
  ASSERT_TRUE(c.Heartbeat(hb).ok());
  EXPECT_TRUE(std::isnan(c.GetJob().ranks[0].metrics.grad_norm));
  // Metrics of a heartbeat that has none are ignored (old clients).
  HeartbeatInfo old{0, 2, 0.5, 10, 4};
  old.metrics.rss_bytes = -5;
  ASSERT_TRUE(c.Heartbeat(old).ok());
}

struct SlowJob {
  FakeClock clock;
  std::vector<std::string> events;
  std::unique_ptr<Coordinator> c;
  int64_t step = 0;
  explicit SlowJob(int world, double factor = 1.5, int windows = 3) {
    CoordinatorOptions o = Options(world, &clock);
    o.heartbeat_timeout = absl::Hours(1);
    o.slow_factor = factor;
    o.slow_windows = windows;
    o.slow_window = absl::Seconds(5);
    o.on_event = [this](const std::string& e) { events.push_back(e); };
    c = std::make_unique<Coordinator>(o);
    JoinAll(c.get(), world);
  }
  // One 5 s window of 1 Hz heartbeats: every rank steps in 1 s, of which
  // busy[r] (<= 1) outside collective waits. Returns how many ranks changed.
  int Window(const std::vector<double>& busy) {
    for (int s = 0; s < 5; ++s) {
      clock.t += absl::Seconds(1);
      ++step;
      for (int r = 0; r < static_cast<int>(busy.size()); ++r) {
        if (busy[r] < 0) continue;  // no step from this rank
        EXPECT_TRUE(c->Heartbeat(Beat(r, step, {1.0, 1.0}, 1.0 - busy[r])).ok());
      }
      if (s < 4) {
        EXPECT_EQ(c->CheckSlowRanks(), 0);  // not a window's end yet
      }
    }
    return c->CheckSlowRanks();
  }
};

TEST(SlowRankTest, NamedAfterKWindowsInARowAndRecoversAfterK) {
  SlowJob job(4);
  const std::vector<double> normal = {0.1, 0.1, 0.1, 0.1}, slow2 = {0.1, 0.11, 0.45, 0.09};
  EXPECT_EQ(job.Window(normal), 0);
  EXPECT_EQ(job.Window(slow2), 0);
  EXPECT_EQ(job.Window(slow2), 0);
  EXPECT_EQ(job.Window(normal), 0);  // the run is broken: start again
  EXPECT_EQ(job.Window(slow2), 0);
  EXPECT_EQ(job.Window(slow2), 0);
  EXPECT_TRUE(job.events.empty());
  EXPECT_TRUE(job.c->GetJob().slow_ranks.empty());
  EXPECT_EQ(job.Window(slow2), 1);
  ASSERT_EQ(job.events.size(), 1u);
  EXPECT_EQ(job.events[0],
            "rank 2 is slow: busy time per step (step time minus waiting on collectives) p50 "
            "0.45 s, 4.5x the median of the others (0.1 s), 3 windows of 5 s in a row");
  JobStatus j = job.c->GetJob();
  EXPECT_EQ(j.slow_ranks, std::vector<int>{2});
  EXPECT_TRUE(j.ranks[2].slow);
  EXPECT_NE(j.ranks[2].slow_reason.find("4.5x the median of the others"), std::string::npos);
  EXPECT_FALSE(j.ranks[1].slow);
  EXPECT_DOUBLE_EQ(j.ranks[2].busy_seconds_p50, 0.45);
  EXPECT_NEAR(j.ranks[2].busy_ratio, 4.5, 1e-9);
  EXPECT_DOUBLE_EQ(j.ranks[2].step_seconds_p50, 1.0);  // wall step times are all equal
  // Still slow: no new line. Recovery takes K windows under the factor too.
  EXPECT_EQ(job.Window(slow2), 0);
  EXPECT_EQ(job.Window(normal), 0);
  EXPECT_EQ(job.Window(normal), 0);
  EXPECT_TRUE(job.c->GetJob().ranks[2].slow);
  EXPECT_EQ(job.Window(normal), 1);
  ASSERT_EQ(job.events.size(), 2u);
  EXPECT_EQ(job.events[1].rfind("rank 2 is no longer slow: busy time per step", 0), 0u)
      << job.events[1];
  EXPECT_NE(job.events[1].find("1.0x the median of the others (0.1 s)"), std::string::npos)
      << job.events[1];
  j = job.c->GetJob();
  EXPECT_TRUE(j.slow_ranks.empty());
  EXPECT_FALSE(j.ranks[2].slow);
  EXPECT_EQ(j.ranks[2].slow_reason, "");
}

TEST(SlowRankTest, TwoRanksFactorNoDataAndSmallTimes) {
  // Two ranks: the median of the others is the other rank.
  SlowJob two(2, /*factor=*/2.0, /*windows=*/2);
  EXPECT_EQ(two.Window({0.1, 0.19}), 0);
  EXPECT_EQ(two.Window({0.1, 0.19}), 0);  // 1.9x < 2x
  EXPECT_EQ(two.Window({0.1, 0.25}), 0);
  // A window in which rank 1 finished no step gives no verdict either way.
  EXPECT_EQ(two.Window({0.1, -1}), 0);
  EXPECT_EQ(two.Window({0.1, 0.25}), 1);
  EXPECT_EQ(two.c->GetJob().slow_ranks, std::vector<int>{1});
  EXPECT_FALSE(two.c->GetJob().ranks[0].slow);  // the fast one is never named
  // Milliseconds apart is noise, whatever the ratio (slow_min_excess 5 ms).
  SlowJob tiny(3, 1.5, 1);
  EXPECT_EQ(tiny.Window({0.001, 0.001, 0.004}), 0);
  EXPECT_EQ(tiny.Window({0.001, 0.001, 0.0075}), 1);
  // One rank alone is never slow; nor are ranks without metrics.
  SlowJob one(1, 1.5, 1);
  EXPECT_EQ(one.Window({0.9}), 0);
  FakeClock clock;
  Coordinator old(Options(2, &clock));
  JoinAll(&old, 2);
  for (int i = 0; i < 20; ++i) {
    clock.t += absl::Seconds(1);
    ASSERT_TRUE(old.Heartbeat({0, i, 0, 0}).ok());
    ASSERT_TRUE(old.Heartbeat({1, i, 0, 0}).ok());
    EXPECT_EQ(old.CheckSlowRanks(), 0);
  }
}

TEST(SlowRankTest, NoVerdictsBeforeTheJobRunsOrAfterItEnds) {
  SlowJob job(2, 1.5, 1);
  job.c->Abort("stop", -1);
  EXPECT_EQ(job.Window({0.1, 0.9}), 0);
  EXPECT_TRUE(job.c->GetJob().slow_ranks.empty());
}

TEST(MetricsTest, AbortCausesAndDuration) {
  FakeClock clock;
  {
    Coordinator c(Options(2, &clock));
    JoinAll(&c, 2);
    clock.t += absl::Seconds(11);
    ASSERT_TRUE(c.CheckHeartbeats());
    JobStatus j = c.GetJob();
    EXPECT_EQ(j.failure_cause, AbortCause::kHeartbeatTimeout);
    EXPECT_EQ(j.duration(), absl::Seconds(11));
    clock.t += absl::Seconds(100);
    EXPECT_EQ(c.GetJob().duration(), absl::Seconds(11));  // stops when the job ends
    c.Abort("later", 0);
    EXPECT_EQ(c.GetJob().failure_cause, AbortCause::kHeartbeatTimeout);  // the first cause stands
  }
  struct Case {
    int rank;
    std::optional<AbortCause> given;
    AbortCause want;
  };
  for (const Case& k :
       std::vector<Case>{{0, std::nullopt, AbortCause::kRankAbort},
                         {-1, std::nullopt, AbortCause::kRequest},
                         {-1, AbortCause::kRankExit, AbortCause::kRankExit},
                         {-1, AbortCause::kInterrupted, AbortCause::kInterrupted}}) {
    Coordinator c(Options(1, &clock));
    if (k.given) {
      c.Abort("x", k.rank, *k.given);
    } else {
      c.Abort("x", k.rank);
    }
    EXPECT_EQ(c.GetJob().failure_cause, k.want) << AbortCauseName(k.want);
  }
  EXPECT_STREQ(AbortCauseName(AbortCause::kHeartbeatTimeout), "heartbeat_timeout");
  EXPECT_EQ(AllAbortCauses().size(), 5u);
  // A finished job's duration stops too.
  Coordinator f(Options(1, &clock));
  JoinAll(&f, 1);
  clock.t += absl::Seconds(3);
  ASSERT_TRUE(f.Finish(0).ok());
  clock.t += absl::Seconds(3);
  EXPECT_EQ(f.GetJob().duration(), absl::Seconds(3));
}

// Over gRPC: unary heartbeats and session heartbeats carry the metrics; GetJob
// returns them with the window statistics, slow ranks and the duration.
TEST(MetricsTest, MetricsTravelOverGrpcBothWays) {
  CoordinatorOptions o;
  o.world_size = 2;
  o.slow_window = absl::Milliseconds(200);
  o.slow_windows = 1;
  Coordinator coordinator(o);
  CoordinatorService service(&coordinator, "");
  auto server = RpcServer::Start(RpcServerOptions(), {&service});
  ASSERT_TRUE(server.ok());
  JoinAll(&coordinator, 2);
  CoordinatorClient client((*server)->address(), "");
  auto beat = [](int rank, double comm_wait) {
    v1::HeartbeatRequest hb;
    hb.set_rank(rank);
    hb.set_step(7);
    v1::RankMetrics* m = hb.mutable_metrics();
    m->add_step_seconds(0.5);
    m->add_step_seconds(0.7);
    m->set_grad_norm(2.5);
    m->set_comm_wait_seconds(comm_wait);
    m->set_update_seconds(0.125);
    m->set_bytes_sent_total(123456789);
    m->set_master_bytes(11);
    m->set_state_bytes(22);
    m->set_grad_bytes(33);
    m->set_param_bytes(44);
    m->set_rss_bytes(55);
    m->set_stalls_total(2);
    m->set_checkpoints_total(3);
    m->set_last_checkpoint_step(6);
    m->set_last_checkpoint_seconds(1.25);
    m->set_last_checkpoint_bytes(999);
    return hb;
  };
  ASSERT_TRUE(client.Heartbeat(beat(0, 0.6)).ok());  // unary: busy 0.1
  auto session = client.OpenSession();
  ASSERT_TRUE(session->Send(beat(1, 0.0)));  // session: busy 0.7
  v1::HeartbeatResponse notice;
  ASSERT_TRUE(session->Receive(&notice));  // the first heartbeat has been taken
  // Both ranks keep heartbeating (every 50 ms, for at most 5 s) until the
  // coordinator names rank 1 slow.
  absl::StatusOr<v1::GetJobResponse> job;
  bool sent = true;
  PollUntil(
      [&] {
        sent = client.Heartbeat(beat(0, 0.6)).ok() && session->Send(beat(1, 0.0));
        if (!sent) return true;
        job = client.GetJob();
        return !job.ok() || job->slow_ranks_size() > 0;
      },
      absl::Seconds(5), absl::Milliseconds(50));
  ASSERT_TRUE(sent);
  ASSERT_TRUE(job.ok()) << job.status();
  ASSERT_EQ(job->slow_ranks_size(), 1);
  EXPECT_EQ(job->slow_ranks(0), 1);
  EXPECT_GT(job->duration_seconds(), 0);
  const v1::RankStatus& r1 = job->ranks(1);
  EXPECT_TRUE(r1.slow());
  EXPECT_NE(r1.slow_reason().find("7.0x the median of the others (0.1 s)"), std::string::npos)
      << r1.slow_reason();
  EXPECT_FALSE(job->ranks(0).slow());
  for (const v1::RankStatus& r : job->ranks()) {
    EXPECT_DOUBLE_EQ(r.step_seconds_p50(), 0.6) << r.rank();
    EXPECT_DOUBLE_EQ(r.step_seconds_max(), 0.7);
    ASSERT_TRUE(r.has_metrics());
    EXPECT_EQ(r.metrics().step_seconds_size(), 0);
    EXPECT_EQ(r.metrics().grad_norm(), 2.5);
    EXPECT_EQ(r.metrics().update_seconds(), 0.125);
    EXPECT_EQ(r.metrics().bytes_sent_total(), 123456789);
    EXPECT_EQ(r.metrics().master_bytes(), 11);
    EXPECT_EQ(r.metrics().state_bytes(), 22);
    EXPECT_EQ(r.metrics().grad_bytes(), 33);
    EXPECT_EQ(r.metrics().param_bytes(), 44);
    EXPECT_EQ(r.metrics().rss_bytes(), 55);
    EXPECT_EQ(r.metrics().stalls_total(), 2);
    EXPECT_EQ(r.metrics().checkpoints_total(), 3);
    EXPECT_EQ(r.metrics().last_checkpoint_step(), 6);
    EXPECT_EQ(r.metrics().last_checkpoint_seconds(), 1.25);
    EXPECT_EQ(r.metrics().last_checkpoint_bytes(), 999);
  }
  // A bad metric ends the session with INVALID_ARGUMENT, like any bad field.
  v1::HeartbeatRequest bad = beat(1, 0.0);
  bad.mutable_metrics()->set_rss_bytes(-1);
  auto r = client.Heartbeat(bad);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("rss_bytes"), absl::string_view::npos) << r.status();
  session->Close();
}

}  // namespace
}  // namespace shardopt

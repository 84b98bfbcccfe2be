// Coordinator (domain logic, no network) and its gRPC service (over
// 127.0.0.1 with an OS-assigned port): joins and the layout check,
// rendezvous, heartbeats and failure detection with a fake clock,
// hyper-parameters, abort, bearer tokens, health, layout and memory queries.
#include "server/coordinator.h"

#include <thread>

#include "absl/strings/str_cat.h"
#include "client/coordinator_client.h"
#include "common/planner.h"
#include "gtest/gtest.h"
#include "server/coordinator_service.h"
#include "server/rpc_server.h"

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
  std::thread t0([&] { r0 = c.Join(Info(0, 2, {P("w", {10, 10}), P("b", {10})}), absl::Seconds(2)); });
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
  EXPECT_TRUE(c.CheckHeartbeats());   // rank 1 silent for 11 s
  JobStatus j = c.GetJob();
  EXPECT_EQ(j.state, JobState::kFailed);
  EXPECT_NE(j.failure.find("rank 1 sent no heartbeat"), std::string::npos) << j.failure;
  EXPECT_NE(j.failure.find("last step 3"), std::string::npos) << j.failure;
  auto hb = c.Heartbeat({0, 5, 0.4, 100});
  ASSERT_TRUE(hb.ok());
  EXPECT_TRUE(hb->abort);
  EXPECT_EQ(hb->abort_reason, j.failure);
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
  v1::JoinRequest join;
  join.set_job_id("job");
  join.set_rank(0);
  join.set_world_size(1);
  join.set_host("127.0.0.1");
  join.set_shard_owner_port((*owner_server)->port());
  std::vector<ParamSpec> model = {P("w", {100, 3}), P("b", {3})};
  for (const auto& p : model) {
    auto* pi = join.add_params();
    pi->set_name(p.name);
    for (int64_t d : p.shape) pi->add_shape(d);
    pi->set_dtype("float32");
    pi->set_trainable(true);
  }
  join.mutable_plan()->set_bucket_cap_elements(PlanOptions().bucket_cap_elements);
  join.mutable_plan()->set_alignment_elements(64);
  join.mutable_plan()->set_allow_cut(true);
  join.set_layout_hash(Plan(model, 1)->hash());
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
  EXPECT_EQ(client.Join(join, absl::Seconds(2)).status().code(), absl::StatusCode::kInvalidArgument);
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

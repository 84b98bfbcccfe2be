// Waiting calls (Join, KvGet) cost no thread, are bounded in number, end when
// the client goes away, and end at once when the coordinator shuts down
// (issue 12: a pending KvGet kept shardrun alive for 10 minutes, one thread
// per waiting call). Every wait in these tests is bounded.
#include <dirent.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <future>
#include <mutex>
#include <thread>

#include "absl/strings/str_cat.h"
#include "client/coordinator_client.h"
#include "client/join_request.h"
#include "common/planner.h"
#include "gtest/gtest.h"
#include "server/coordinator.h"
#include "server/coordinator_service.h"
#include "server/rpc_server.h"
#include "tests/testing/poll.h"

namespace shardopt {
namespace {

int ThreadCount() {
  int n = 0;
  if (DIR* d = opendir("/proc/self/task")) {
    while (dirent* e = readdir(d)) {
      if (e->d_name[0] != '.') ++n;
    }
    closedir(d);
  }
  return n;
}

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
  j.layout_hash = Plan(j.params, world, j.plan)->hash();
  return j;
}

// Unary calls in flight on the async (callback) client API, with bounded
// waits for their answers.
class Calls {
 public:
  void Add() {
    std::lock_guard<std::mutex> l(mu_);
    ++started_;
  }
  void Done(const grpc::Status& s) {
    std::lock_guard<std::mutex> l(mu_);
    codes_.push_back(s.error_code());
    messages_.push_back(s.error_message());
    cv_.notify_all();
  }
  bool WaitAll(std::chrono::seconds limit) {
    std::unique_lock<std::mutex> l(mu_);
    return cv_.wait_for(l, limit, [&] { return static_cast<int>(codes_.size()) == started_; });
  }
  int Count(grpc::StatusCode code) {
    std::lock_guard<std::mutex> l(mu_);
    return static_cast<int>(std::count(codes_.begin(), codes_.end(), code));
  }
  std::string AnyMessage(grpc::StatusCode code) {
    std::lock_guard<std::mutex> l(mu_);
    for (size_t i = 0; i < codes_.size(); ++i) {
      if (codes_[i] == code) return messages_[i];
    }
    return "";
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int started_ = 0;
  std::vector<grpc::StatusCode> codes_;
  std::vector<std::string> messages_;
};

struct KvGetCall {
  grpc::ClientContext ctx;
  v1::KvGetRequest req;
  v1::KvGetResponse resp;
};

struct Served {
  Coordinator coordinator;
  CoordinatorService service;
  std::unique_ptr<RpcServer> server;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::Coordinator::Stub> stub;
  explicit Served(CoordinatorOptions o) : coordinator(std::move(o)), service(&coordinator, "") {
    auto s = RpcServer::Start(RpcServerOptions(), {&service});
    EXPECT_TRUE(s.ok()) << s.status();
    server = std::move(*s);
    channel = grpc::CreateChannel(server->address(), grpc::InsecureChannelCredentials());
    stub = v1::Coordinator::NewStub(channel);
  }
  // Starts a KvGet of `key` waiting up to `wait_ms`; the client deadline is
  // the wait + 5 s, as CoordinatorClient sets it.
  void StartKvGet(KvGetCall* c, const std::string& key, int64_t wait_ms, Calls* calls) {
    c->ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(wait_ms) +
                        std::chrono::seconds(5));
    c->req.set_key(key);
    c->req.set_wait_ms(wait_ms);
    calls->Add();
    stub->async()->KvGet(&c->ctx, &c->req, &c->resp, [calls](grpc::Status s) { calls->Done(s); });
  }
};

CoordinatorOptions World(int n, int max_kv_waiters = 4096) {
  CoordinatorOptions o;
  o.world_size = n;
  o.max_kv_waiters = max_kv_waiters;
  return o;
}

TEST(CoordinatorWaitsTest, ShutdownEndsAPendingTenMinuteKvGetAtOnce) {
  Served s(World(1));
  KvGetCall call;
  Calls calls;
  s.StartKvGet(&call, "never", 600000, &calls);
  ASSERT_TRUE(PollUntil([&] { return s.coordinator.pending_waits() == 1; }, absl::Seconds(10)));
  const absl::Time t0 = absl::Now();
  s.server->Shutdown();
  const absl::Duration took = absl::Now() - t0;
  EXPECT_LT(took, absl::Seconds(2));
  const bool answered = calls.WaitAll(std::chrono::seconds(5));
  if (!answered) call.ctx.TryCancel();  // do not hang the test on failure
  ASSERT_TRUE(calls.WaitAll(std::chrono::seconds(5)));
  EXPECT_TRUE(answered);
  EXPECT_EQ(calls.Count(grpc::StatusCode::UNAVAILABLE), 1);
  EXPECT_EQ(calls.AnyMessage(grpc::StatusCode::UNAVAILABLE), "coordinator shutting down");
  EXPECT_EQ(s.coordinator.pending_waits(), 0);
  EXPECT_EQ(s.service.calls_in_flight(), 0);
}

TEST(CoordinatorWaitsTest, ShutdownWakesBlockingWaitsAndRefusesNewOnes) {
  Coordinator c(World(2));
  auto kv = std::async(std::launch::async, [&] { return c.KvGet("k", absl::Minutes(10)); });
  auto join = std::async(std::launch::async,
                         [&] { return c.Join(Info(0, 2, {P("w", {8})}), absl::Minutes(10)); });
  ASSERT_TRUE(PollUntil([&] { return c.pending_waits() == 2; }, absl::Seconds(10)));
  const absl::Time t0 = absl::Now();
  c.Shutdown();
  ASSERT_EQ(kv.wait_for(std::chrono::seconds(2)), std::future_status::ready);
  ASSERT_EQ(join.wait_for(std::chrono::seconds(2)), std::future_status::ready);
  EXPECT_LT(absl::Now() - t0, absl::Seconds(2));
  EXPECT_EQ(kv.get().status().code(), absl::StatusCode::kUnavailable);
  auto j = join.get();
  EXPECT_EQ(j.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(j.status().message(), "coordinator shutting down");
  EXPECT_EQ(c.KvGet("k", absl::Minutes(1)).status().code(), absl::StatusCode::kUnavailable);
  // What is there is still answered; queries still work.
  ASSERT_TRUE(c.KvSet("k", "v").ok());
  EXPECT_EQ(*c.KvGet("k", absl::Minutes(1)), "v");
  EXPECT_EQ(c.GetJob().world_size, 2);
}

// Clients ping their connections every 5 s, with calls or without
// (client/coordinator_client.cc): a connection idle for a while, then a
// KvGet that waits for its key (a rank in a rendezvous while the others
// start), must not be cut by the server's ping policy (gRPC's default counts
// a ping without calls as a strike and answers the third with GOAWAY
// "too_many_pings": the waiting call failed UNAVAILABLE).
TEST(CoordinatorWaitsTest, AnIdleConnectionThenALongWaitOutlastTheClientsKeepalivePings) {
  Served s(World(1));
  CoordinatorClient client(s.server->address(), "");
  ASSERT_TRUE(s.coordinator.KvSet("early", "v").ok());
  ASSERT_TRUE(client.KvGet("early", absl::Seconds(5)).ok());  // connected
  std::this_thread::sleep_for(std::chrono::seconds(11));      // idle: pings without calls
  auto kv = std::async(std::launch::async, [&] { return client.KvGet("late", absl::Seconds(60)); });
  ASSERT_EQ(kv.wait_for(std::chrono::seconds(10)), std::future_status::timeout);
  ASSERT_TRUE(s.coordinator.KvSet("late", "v").ok());
  ASSERT_EQ(kv.wait_for(std::chrono::seconds(10)), std::future_status::ready);
  auto got = kv.get();
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, "v");
}

TEST(CoordinatorWaitsTest, ThreeHundredWaitingKvGetsHoldNoThreads) {
  Served s(World(1));
  std::vector<std::unique_ptr<KvGetCall>> waiting;
  Calls calls;
  // Warm gRPC's own threads up before counting.
  ASSERT_TRUE(s.coordinator.KvSet("warm", "x").ok());
  {
    KvGetCall warm;
    Calls one;
    s.StartKvGet(&warm, "warm", 1000, &one);
    ASSERT_TRUE(one.WaitAll(std::chrono::seconds(10)));
  }
  const int before = ThreadCount();
  for (int i = 0; i < 300; ++i) {
    waiting.push_back(std::make_unique<KvGetCall>());
    s.StartKvGet(waiting.back().get(), "later", 60000, &calls);
  }
  ASSERT_TRUE(PollUntil([&] { return s.coordinator.pending_waits() == 300; }, absl::Seconds(10)))
      << s.coordinator.pending_waits();
  const int during = ThreadCount();
  std::printf("threads: %d before, %d with 300 KvGets waiting\n", before, during);
  // One thread per waiting call was 300 more; gRPC may add a few of its own.
  EXPECT_LT(during - before, 30) << before << " threads before, " << during << " with 300 waiting";
  ASSERT_TRUE(s.coordinator.KvSet("later", "value").ok());
  const bool all = calls.WaitAll(std::chrono::seconds(10));
  if (!all) {
    for (auto& c : waiting) c->ctx.TryCancel();
    calls.WaitAll(std::chrono::seconds(10));
  }
  ASSERT_TRUE(all);
  EXPECT_EQ(calls.Count(grpc::StatusCode::OK), 300);
  for (const auto& c : waiting) EXPECT_EQ(c->resp.value(), "value");
  EXPECT_EQ(s.coordinator.pending_waits(), 0);
}

TEST(CoordinatorWaitsTest, WaitingKvGetsAreBounded) {
  Served s(World(1, /*max_kv_waiters=*/10));
  std::vector<std::unique_ptr<KvGetCall>> waiting;
  Calls calls;
  for (int i = 0; i < 10; ++i) {
    waiting.push_back(std::make_unique<KvGetCall>());
    s.StartKvGet(waiting.back().get(), absl::StrCat("key", i), 60000, &calls);
  }
  ASSERT_TRUE(PollUntil([&] { return s.coordinator.pending_waits() == 10; }, absl::Seconds(10)));
  CoordinatorClient client(s.server->address(), "");
  auto over = client.KvGet("one-too-many", absl::Seconds(30));
  EXPECT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted) << over.status();
  EXPECT_NE(over.status().message().find("already waiting"), absl::string_view::npos)
      << over.status();
  // A key that is there needs no wait, so no slot.
  ASSERT_TRUE(client.KvSet("there", "1").ok());
  EXPECT_EQ(*client.KvGet("there", absl::Seconds(30)), "1");
  // The store answers the waiting ones; the slots free up.
  for (int i = 0; i < 10; ++i) ASSERT_TRUE(client.KvSet(absl::StrCat("key", i), "v").ok());
  ASSERT_TRUE(calls.WaitAll(std::chrono::seconds(10)));
  EXPECT_EQ(calls.Count(grpc::StatusCode::OK), 10);
  EXPECT_EQ(s.coordinator.pending_waits(), 0);
  ASSERT_TRUE(client.KvSet("one-too-many", "now").ok());
  EXPECT_EQ(*client.KvGet("one-too-many", absl::Seconds(30)), "now");
}

TEST(CoordinatorWaitsTest, AClientThatGoesAwayFreesItsWait) {
  Served s(World(2));
  KvGetCall call;
  Calls calls;
  s.StartKvGet(&call, "never", 600000, &calls);
  ASSERT_TRUE(PollUntil([&] { return s.coordinator.pending_waits() == 1; }, absl::Seconds(10)));
  call.ctx.TryCancel();
  ASSERT_TRUE(calls.WaitAll(std::chrono::seconds(5)));
  EXPECT_TRUE(PollUntil([&] { return s.coordinator.pending_waits() == 0; }, absl::Seconds(5)));

  // A client deadline shorter than the requested wait ends the wait there.
  KvGetCall short_call;
  Calls short_calls;
  short_call.ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(300));
  short_call.req.set_key("never");
  short_call.req.set_wait_ms(600000);
  short_calls.Add();
  s.stub->async()->KvGet(&short_call.ctx, &short_call.req, &short_call.resp,
                         [&](grpc::Status st) { short_calls.Done(st); });
  ASSERT_TRUE(short_calls.WaitAll(std::chrono::seconds(5)));
  EXPECT_EQ(short_calls.Count(grpc::StatusCode::DEADLINE_EXCEEDED), 1);
  EXPECT_TRUE(PollUntil([&] { return s.coordinator.pending_waits() == 0; }, absl::Seconds(5)));

  // A Join whose client gives up no longer holds its rank.
  CoordinatorClient client(s.server->address(), "");
  auto planned = Plan({P("w", {8})}, 2);
  ASSERT_TRUE(planned.ok()) << planned.status();
  JoinRequestInfo info;
  info.rank = 1;
  info.shard_owner_port = 1001;
  const v1::JoinRequest join = MakeJoinRequest(*planned, info);
  EXPECT_EQ(client.Join(join, absl::Milliseconds(500)).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(PollUntil([&] { return s.coordinator.pending_waits() == 0; }, absl::Seconds(5)));
  // Now both join.
  auto r1 = std::async(std::launch::async, [&] { return client.Join(join, absl::Seconds(20)); });
  ASSERT_TRUE(PollUntil([&] { return s.coordinator.pending_waits() == 1; }, absl::Seconds(10)));
  // A second Join for the same rank while one waits is refused.
  EXPECT_EQ(client.Join(join, absl::Seconds(2)).status().code(), absl::StatusCode::kAlreadyExists);
  auto r0 = s.coordinator.Join(Info(0, 2, {P("w", {8})}), absl::Seconds(10));
  ASSERT_TRUE(r0.ok()) << r0.status();
  ASSERT_EQ(r1.wait_for(std::chrono::seconds(10)), std::future_status::ready);
  auto joined = r1.get();
  ASSERT_TRUE(joined.ok()) << joined.status();
  EXPECT_EQ(joined->peers_size(), 2);
  EXPECT_EQ(s.coordinator.GetJob().state, JobState::kRunning);
}

TEST(CoordinatorWaitsTest, AFailedJobEndsEveryWait) {
  Coordinator c(World(2));
  auto kv = std::async(std::launch::async, [&] { return c.KvGet("k", absl::Minutes(10)); });
  auto join = std::async(std::launch::async,
                         [&] { return c.Join(Info(1, 2, {P("w", {8})}), absl::Minutes(10)); });
  ASSERT_TRUE(PollUntil([&] { return c.pending_waits() == 2; }, absl::Seconds(10)));
  c.Abort("operator said so", -1);
  ASSERT_EQ(kv.wait_for(std::chrono::seconds(2)), std::future_status::ready);
  ASSERT_EQ(join.wait_for(std::chrono::seconds(2)), std::future_status::ready);
  EXPECT_EQ(kv.get().status().code(), absl::StatusCode::kAborted);
  EXPECT_EQ(join.get().status().code(), absl::StatusCode::kAborted);
}

TEST(CoordinatorWaitsTest, SessionsEndAtShutdown) {
  Served s(World(1));
  ASSERT_TRUE(s.coordinator.Join(Info(0, 1, {P("w", {8})}), absl::Seconds(5)).ok());
  CoordinatorClient client(s.server->address(), "");
  auto session = client.OpenSession();
  v1::HeartbeatRequest hb;
  hb.set_rank(0);
  ASSERT_TRUE(session->Send(hb));
  v1::HeartbeatResponse notice;
  ASSERT_TRUE(session->Receive(&notice));
  const absl::Time t0 = absl::Now();
  auto done = std::async(std::launch::async, [&] {
    v1::HeartbeatResponse n;
    return session->Receive(&n);
  });
  s.server->Shutdown();
  EXPECT_LT(absl::Now() - t0, absl::Seconds(2));
  if (done.wait_for(std::chrono::seconds(5)) != std::future_status::ready) session->Close();
  EXPECT_FALSE(done.get());
}

TEST(CoordinatorWaitsTest, DestroyingTheServiceIsQuickWithWaitsPending) {
  Coordinator c(World(1));
  Calls calls;
  KvGetCall call;
  const absl::Time t0 = absl::Now();
  {
    CoordinatorService service(&c, "");
    auto server = RpcServer::Start(RpcServerOptions(), {&service});
    ASSERT_TRUE(server.ok());
    auto stub = v1::Coordinator::NewStub(
        grpc::CreateChannel((*server)->address(), grpc::InsecureChannelCredentials()));
    call.ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::minutes(11));
    call.req.set_key("never");
    call.req.set_wait_ms(600000);
    calls.Add();
    stub->async()->KvGet(&call.ctx, &call.req, &call.resp,
                         [&](grpc::Status st) { calls.Done(st); });
    ASSERT_TRUE(PollUntil([&] { return c.pending_waits() == 1; }, absl::Seconds(10)));
  }  // the server, then the service
  EXPECT_LT(absl::Now() - t0, absl::Seconds(5));
  if (!calls.WaitAll(std::chrono::seconds(5))) call.ctx.TryCancel();
  ASSERT_TRUE(calls.WaitAll(std::chrono::seconds(5)));
  EXPECT_EQ(calls.Count(grpc::StatusCode::UNAVAILABLE), 1);
}

}  // namespace
}  // namespace shardopt

// Thousands of random and mutated requests at every coordinator RPC: the
// server stays up, answers every call within its deadline, and refuses bad
// fields with INVALID_ARGUMENT (or a similar code), never OK for nonsense.
#include <grpcpp/generic/generic_stub.h>

#include <condition_variable>
#include <mutex>
#include <random>

#include "absl/strings/str_cat.h"
#include "client/coordinator_client.h"
#include "gtest/gtest.h"
#include "server/coordinator.h"
#include "server/coordinator_service.h"
#include "server/rpc_server.h"

namespace shardopt {
namespace {

class FuzzTest : public ::testing::Test {
 protected:
  void SetUp() override {
    CoordinatorOptions o;
    o.job_id = "job";
    o.world_size = 2;
    coordinator_ = std::make_unique<Coordinator>(o);
    service_ = std::make_unique<CoordinatorService>(coordinator_.get(), "");
    auto s = RpcServer::Start(RpcServerOptions(), {service_.get()});
    ASSERT_TRUE(s.ok());
    server_ = std::move(*s);
    channel_ = grpc::CreateChannel(server_->address(), grpc::InsecureChannelCredentials());
    stub_ = v1::Coordinator::NewStub(channel_);
  }
  std::unique_ptr<grpc::ClientContext> Ctx() {
    auto c = std::make_unique<grpc::ClientContext>();
    c->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(3));
    return c;
  }
  std::string RandomString(size_t max) {
    std::uniform_int_distribution<size_t> len(0, max);
    std::string s(len(rng_), '\0');
    for (char& c : s) c = static_cast<char>(rng_() & 0xff);
    return s;
  }
  std::mt19937 rng_{12345};
  std::unique_ptr<Coordinator> coordinator_;
  std::unique_ptr<CoordinatorService> service_;
  std::unique_ptr<RpcServer> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Coordinator::Stub> stub_;
};

TEST_F(FuzzTest, RandomRequestsAreRefusedAndTheServerStaysUp) {
  std::uniform_int_distribution<int> pick(0, 6), small(-5, 10);
  std::uniform_int_distribution<int64_t> dim(-3, int64_t{1} << 42);
  int ok_answers = 0, calls = 0;
  const char* kJobs[] = {"job", "other", "../../etc/passwd", ""};
  for (int i = 0; i < 3000; ++i) {
    grpc::Status s;
    auto ctx = Ctx();
    switch (pick(rng_)) {
      case 0: {
        v1::JoinRequest r;
        r.set_job_id(kJobs[rng_() % 4]);
        r.set_rank(small(rng_));
        r.set_world_size(small(rng_));
        r.set_host(RandomString(300));
        r.set_shard_owner_port(static_cast<int>(rng_() % 100000) - 10);
        const int n = static_cast<int>(rng_() % 4);
        for (int k = 0; k < n; ++k) {
          auto* p = r.add_params();
          p->set_name(RandomString(2000));
          const int d = static_cast<int>(rng_() % 20);
          for (int j = 0; j < d; ++j) p->add_shape(dim(rng_));
          p->set_dtype(rng_() % 2 ? "float32" : RandomString(10));
        }
        v1::JoinResponse resp;
        ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(300));
        s = stub_->Join(ctx.get(), r, &resp);
        break;
      }
      case 1: {
        v1::KvSetRequest r;
        r.set_key(RandomString(rng_() % 10 == 0 ? 2000 : 20));
        r.set_value(RandomString(rng_() % 50 == 0 ? (2 << 20) : 100));
        v1::KvSetResponse resp;
        s = stub_->KvSet(ctx.get(), r, &resp);
        if (!r.key().empty() && r.key().size() <= kMaxKeyBytes &&
            r.value().size() <= kMaxValueBytes) {
          continue;  // a legitimate rendezvous write
        }
        break;
      }
      case 2: {
        v1::KvGetRequest r;
        r.set_key(RandomString(rng_() % 10 == 0 ? 2000 : 5));
        r.set_wait_ms(static_cast<int64_t>(rng_() % 3 == 0 ? -1 : rng_() % 2 == 0 ? 10 : 1e9));
        v1::KvGetResponse resp;
        s = stub_->KvGet(ctx.get(), r, &resp);
        break;
      }
      case 3: {
        v1::HeartbeatRequest r;
        r.set_rank(small(rng_));
        r.set_step(static_cast<int64_t>(rng_()) - (1 << 30));
        r.set_samples_per_s(rng_() % 2 ? NAN : INFINITY);
        v1::HeartbeatResponse resp;
        s = stub_->Heartbeat(ctx.get(), r, &resp);
        break;
      }
      case 4: {
        v1::SetHyperParamsRequest r;
        const double vals[] = {-1, 0, NAN, -INFINITY, INFINITY};
        r.set_learning_rate(vals[rng_() % 5]);
        v1::SetHyperParamsResponse resp;
        s = stub_->SetHyperParams(ctx.get(), r, &resp);
        break;
      }
      case 5: {
        v1::FinishRequest r;
        r.set_rank(small(rng_) * 1000);
        v1::FinishResponse resp;
        s = stub_->Finish(ctx.get(), r, &resp);
        if (r.rank() >= 0 && r.rank() < 2) continue;  // a valid rank may finish
        break;
      }
      case 6: {
        v1::AbortRequest r;
        r.set_reason(RandomString(10000));
        r.set_rank(small(rng_));
        v1::AbortResponse resp;
        s = stub_->Abort(ctx.get(), r, &resp);
        if (r.reason().size() <= 4096) continue;  // short reasons are legitimate aborts
        break;
      }
    }
    ++calls;
    if (s.ok()) ++ok_answers;
  }
  EXPECT_EQ(ok_answers, 0) << "of " << calls << " invalid requests";
  CoordinatorClient client(server_->address(), "");
  EXPECT_EQ(*client.Health(), "SERVING");
  EXPECT_TRUE(client.GetJob().ok());
}

TEST_F(FuzzTest, MutatedBytesNeverCrashTheServer) {
  v1::JoinRequest valid;
  valid.set_job_id("job");
  valid.set_rank(1);
  valid.set_world_size(2);
  valid.set_host("127.0.0.1");
  valid.set_shard_owner_port(5000);
  auto* p = valid.add_params();
  p->set_name("w");
  p->add_shape(4);
  p->set_dtype("float32");
  const std::string bytes = valid.SerializeAsString();
  grpc::GenericStub generic(channel_);
  const char* methods[] = {
      "/shardopt.v1.Coordinator/Join",      "/shardopt.v1.Coordinator/KvSet",
      "/shardopt.v1.Coordinator/KvGet",     "/shardopt.v1.Coordinator/Heartbeat",
      "/shardopt.v1.Coordinator/GetLayout", "/shardopt.v1.Coordinator/SetHyperParams"};
  for (int i = 0; i < 1200; ++i) {
    std::string m = bytes;
    const int flips = 1 + static_cast<int>(rng_() % 8);
    for (int k = 0; k < flips; ++k) m[rng_() % m.size()] = static_cast<char>(rng_() & 0xff);
    if (rng_() % 5 == 0) m.resize(rng_() % m.size());
    grpc::Slice slice(m);
    grpc::ByteBuffer req(&slice, 1), resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(300));
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    generic.UnaryCall(&ctx, methods[i % 6], grpc::StubOptions(), &req, &resp, [&](grpc::Status) {
      std::lock_guard<std::mutex> l(mu);
      done = true;
      cv.notify_one();
    });
    std::unique_lock<std::mutex> l(mu);
    cv.wait(l, [&] { return done; });
  }
  CoordinatorClient client(server_->address(), "");
  EXPECT_EQ(*client.Health(), "SERVING");
  EXPECT_TRUE(client.GetJob().ok());
}

TEST_F(FuzzTest, OversizedMessagesAreRefused) {
  v1::KvSetRequest r;
  r.set_key("k");
  r.set_value(std::string(5 << 20, 'x'));  // over gRPC's 4 MiB default
  v1::KvSetResponse resp;
  auto ctx = Ctx();
  grpc::Status s = stub_->KvSet(ctx.get(), r, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  CoordinatorClient client(server_->address(), "");
  EXPECT_EQ(*client.Health(), "SERVING");
}

}  // namespace
}  // namespace shardopt

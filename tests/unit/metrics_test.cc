// server/metrics.h: the Prometheus text a job turns into (names, labels,
// values, the step-time histogram), and the HTTP endpoint (127.0.0.1, a port
// chosen by the OS) that serves it from a live Coordinator on every scrape.
#include "server/metrics.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/planner.h"
#include "gtest/gtest.h"
#include "server/coordinator.h"

namespace shardopt {
namespace {

struct FakeClock {
  absl::Time t = absl::FromUnixSeconds(1000);
};

JoinInfo Info(int rank, int world) {
  JoinInfo j;
  j.job_id = "job";
  j.rank = rank;
  j.world_size = world;
  j.host = "127.0.0.1";
  j.shard_owner_port = 1000 + rank;
  ParamSpec p;
  p.name = "w";
  p.shape = {64};
  j.params = {p};
  j.layout_hash = Plan(j.params, world, j.plan)->hash();
  return j;
}

std::unique_ptr<Coordinator> RunningJob(FakeClock* clock, int world) {
  CoordinatorOptions o;
  o.world_size = world;
  o.job_id = "metrics-job";
  o.heartbeat_timeout = absl::Hours(1);
  o.now = [clock] { return clock->t; };
  auto c = std::make_unique<Coordinator>(o);
  std::vector<std::thread> t;
  for (int r = 0; r < world; ++r) {
    t.emplace_back([&c, r, world] {
      JoinInfo j = Info(r, world);
      j.job_id = "metrics-job";
      ASSERT_TRUE(c->Join(j, absl::Seconds(10)).ok());
    });
  }
  for (auto& x : t) x.join();
  return c;
}

// The value of the one sample line "name{labels} value" (labels exactly as
// rendered, "" for none); nan when absent.
double Sample(const std::string& text, const std::string& series) {
  const std::string prefix = series + " ";
  size_t pos = 0;
  while ((pos = text.find(prefix, pos)) != std::string::npos) {
    if (pos == 0 || text[pos - 1] == '\n') {
      return std::stod(
          text.substr(pos + prefix.size(), text.find('\n', pos) - pos - prefix.size()));
    }
    pos += prefix.size();
  }
  return std::nan("");
}

TEST(MetricsRenderTest, NamesLabelsAndValues) {
  FakeClock clock;
  auto c = RunningJob(&clock, 2);
  clock.t += absl::Seconds(2);
  HeartbeatInfo hb{0, 12, 0.75, 321.5, 24};
  hb.learning_rate = 1e-4;
  hb.has_metrics = true;
  hb.metrics.step_seconds = {0.02, 0.2, 3};
  hb.metrics.grad_norm = 1.25;
  hb.metrics.comm_wait_seconds = 0.01;
  hb.metrics.update_seconds = 0.005;
  hb.metrics.bytes_sent_total = 1 << 20;
  hb.metrics.master_bytes = 0;
  hb.metrics.state_bytes = 2000;
  hb.metrics.grad_bytes = 1000;
  hb.metrics.param_bytes = 1000;
  hb.metrics.rss_bytes = 123456789;
  hb.metrics.stalls_total = 1;
  hb.metrics.checkpoints_total = 2;
  hb.metrics.last_checkpoint_step = 10;
  hb.metrics.last_checkpoint_seconds = 0.5;
  hb.metrics.last_checkpoint_bytes = 4000;
  ASSERT_TRUE(c->Heartbeat(hb).ok());
  ASSERT_TRUE(c->Heartbeat({1, 11, 0.5, 300}).ok());  // rank 1: no metrics (an old client)
  clock.t += absl::Seconds(1.5);
  const std::string text = RenderMetrics(c->GetJob());
  SCOPED_TRACE(text);
  EXPECT_EQ(Sample(text, "shardopt_job_info{job_id=\"metrics-job\"}"), 1);
  EXPECT_EQ(Sample(text, "shardopt_job_state{state=\"running\"}"), 1);
  EXPECT_EQ(Sample(text, "shardopt_job_state{state=\"failed\"}"), 0);
  EXPECT_EQ(Sample(text, "shardopt_job_world_size"), 2);
  EXPECT_EQ(Sample(text, "shardopt_job_step"), 11);
  EXPECT_EQ(Sample(text, "shardopt_job_duration_seconds"), 3.5);
  EXPECT_EQ(Sample(text, "shardopt_job_aborts_total{cause=\"heartbeat_timeout\"}"), 0);
  EXPECT_EQ(Sample(text, "shardopt_job_slow_ranks"), 0);
  EXPECT_EQ(Sample(text, "shardopt_checkpoints_total"), 2);
  EXPECT_EQ(Sample(text, "shardopt_last_checkpoint_step"), 10);
  EXPECT_EQ(Sample(text, "shardopt_last_checkpoint_duration_seconds"), 0.5);
  EXPECT_EQ(Sample(text, "shardopt_last_checkpoint_bytes"), 4000);
  EXPECT_EQ(Sample(text, "shardopt_last_checkpoint_timestamp_seconds"), 1002);
  EXPECT_EQ(Sample(text, "shardopt_rank_step{rank=\"0\"}"), 12);
  EXPECT_EQ(Sample(text, "shardopt_rank_step{rank=\"1\"}"), 11);
  EXPECT_EQ(Sample(text, "shardopt_rank_samples_per_second{rank=\"0\"}"), 321.5);
  EXPECT_EQ(Sample(text, "shardopt_rank_loss{rank=\"0\"}"), 0.75);
  EXPECT_EQ(Sample(text, "shardopt_rank_learning_rate{rank=\"0\"}"), 1e-4);
  EXPECT_EQ(Sample(text, "shardopt_rank_grad_norm{rank=\"0\"}"), 1.25);
  EXPECT_EQ(Sample(text, "shardopt_rank_comm_wait_seconds{rank=\"0\"}"), 0.01);
  EXPECT_EQ(Sample(text, "shardopt_rank_update_seconds{rank=\"0\"}"), 0.005);
  EXPECT_EQ(Sample(text, "shardopt_rank_sent_bytes_total{rank=\"0\"}"), 1 << 20);
  EXPECT_EQ(Sample(text, "shardopt_rank_memory_bytes{rank=\"0\",role=\"state\"}"), 2000);
  EXPECT_EQ(Sample(text, "shardopt_rank_memory_bytes{rank=\"0\",role=\"gradients\"}"), 1000);
  EXPECT_EQ(Sample(text, "shardopt_rank_memory_bytes{rank=\"0\",role=\"parameters\"}"), 1000);
  EXPECT_EQ(Sample(text, "shardopt_rank_memory_bytes{rank=\"0\",role=\"master\"}"), 0);
  EXPECT_EQ(Sample(text, "shardopt_rank_memory_bytes{rank=\"0\",role=\"rss\"}"), 123456789);
  EXPECT_EQ(Sample(text, "shardopt_rank_heartbeat_age_seconds{rank=\"0\"}"), 1.5);
  EXPECT_EQ(Sample(text, "shardopt_rank_stalls_total{rank=\"0\"}"), 1);
  EXPECT_EQ(Sample(text, "shardopt_rank_slow{rank=\"0\"}"), 0);
  EXPECT_EQ(Sample(text, "shardopt_rank_slow{rank=\"1\"}"), 0);
  // The histogram: cumulative buckets, +Inf, count and sum.
  EXPECT_EQ(Sample(text, "shardopt_rank_step_seconds_bucket{rank=\"0\",le=\"0.01\"}"), 0);
  EXPECT_EQ(Sample(text, "shardopt_rank_step_seconds_bucket{rank=\"0\",le=\"0.025\"}"), 1);
  EXPECT_EQ(Sample(text, "shardopt_rank_step_seconds_bucket{rank=\"0\",le=\"0.25\"}"), 2);
  EXPECT_EQ(Sample(text, "shardopt_rank_step_seconds_bucket{rank=\"0\",le=\"2.5\"}"), 2);
  EXPECT_EQ(Sample(text, "shardopt_rank_step_seconds_bucket{rank=\"0\",le=\"5\"}"), 3);
  EXPECT_EQ(Sample(text, "shardopt_rank_step_seconds_bucket{rank=\"0\",le=\"+Inf\"}"), 3);
  EXPECT_EQ(Sample(text, "shardopt_rank_step_seconds_count{rank=\"0\"}"), 3);
  EXPECT_DOUBLE_EQ(Sample(text, "shardopt_rank_step_seconds_sum{rank=\"0\"}"), 3.22);
  // A rank that sent no metrics has no series made of them (not zeros).
  EXPECT_TRUE(std::isnan(Sample(text, "shardopt_rank_grad_norm{rank=\"1\"}")));
  EXPECT_TRUE(std::isnan(Sample(text, "shardopt_rank_step_seconds_count{rank=\"1\"}")));
  EXPECT_EQ(text.find("rank=\"1\",role=\"rss\""), std::string::npos);
  // Types follow the conventions.
  EXPECT_NE(text.find("# TYPE shardopt_rank_step_seconds histogram"), std::string::npos);
  EXPECT_NE(text.find("# TYPE shardopt_rank_sent_bytes_total counter"), std::string::npos);
  EXPECT_NE(text.find("# TYPE shardopt_job_aborts_total counter"), std::string::npos);
  EXPECT_NE(text.find("# TYPE shardopt_rank_memory_bytes gauge"), std::string::npos);
  // Every metric name follows them: shardopt_ prefix, lowercase, and a
  // counter ends in _total.
  std::regex type_line("# TYPE (\\S+) (\\S+)");
  int families = 0;
  for (std::sregex_iterator it(text.begin(), text.end(), type_line), end; it != end; ++it) {
    const std::string name = (*it)[1], type = (*it)[2];
    ++families;
    EXPECT_EQ(name.rfind("shardopt_", 0), 0u) << name;
    EXPECT_TRUE(std::regex_match(name, std::regex("[a-z_]+"))) << name;
    if (type == "counter") {
      EXPECT_EQ(name.substr(name.size() - 6), "_total") << name;
    }
  }
  EXPECT_GE(families, 25);
}

TEST(MetricsRenderTest, FailuresSlowRanksAndAStartingJob) {
  FakeClock clock;
  CoordinatorOptions o;
  o.world_size = 2;
  o.now = [&clock] { return clock.t; };
  Coordinator starting(o);
  std::string text = RenderMetrics(starting.GetJob());
  EXPECT_EQ(Sample(text, "shardopt_job_state{state=\"starting\"}"), 1);
  EXPECT_EQ(text.find("shardopt_rank_step{"), std::string::npos);         // nobody joined
  EXPECT_EQ(text.find("shardopt_checkpoints_total"), std::string::npos);  // unknown yet

  auto c = RunningJob(&clock, 3);
  for (int w = 0; w < 3; ++w) {
    for (int s = 0; s < 5; ++s) {
      clock.t += absl::Seconds(1);
      for (int r = 0; r < 3; ++r) {
        HeartbeatInfo hb{r, s, 0, 0};
        hb.has_metrics = true;
        hb.metrics.step_seconds = {1.0};
        hb.metrics.comm_wait_seconds = r == 1 ? 0.1 : 0.8;  // rank 1 busy 0.9 s, the others 0.2 s
        ASSERT_TRUE(c->Heartbeat(hb).ok());
      }
    }
    c->CheckSlowRanks();
  }
  c->Abort("gone", 1);
  text = RenderMetrics(c->GetJob());
  EXPECT_EQ(Sample(text, "shardopt_rank_slow{rank=\"1\"}"), 1);
  EXPECT_EQ(Sample(text, "shardopt_rank_slow{rank=\"0\"}"), 0);
  EXPECT_EQ(Sample(text, "shardopt_job_slow_ranks"), 1);
  EXPECT_DOUBLE_EQ(Sample(text, "shardopt_rank_busy_seconds{rank=\"1\"}"), 0.9);
  EXPECT_DOUBLE_EQ(Sample(text, "shardopt_rank_busy_seconds{rank=\"0\"}"), 0.2);
  EXPECT_EQ(Sample(text, "shardopt_job_state{state=\"failed\"}"), 1);
  EXPECT_EQ(Sample(text, "shardopt_job_aborts_total{cause=\"rank_abort\"}"), 1);
  EXPECT_EQ(Sample(text, "shardopt_job_aborts_total{cause=\"request\"}"), 0);
  EXPECT_EQ(text.find("shardopt_last_checkpoint_timestamp_seconds "), std::string::npos);
}

// A plain HTTP GET over a socket; the whole response.
std::string HttpGet(int port, const std::string& path) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  timeval tv{10, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    close(fd);
    return "";
  }
  const std::string req =
      absl::StrCat("GET ", path, " HTTP/1.0\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
  (void)!write(fd, req.data(), req.size());
  std::string out;
  char buf[65536];
  ssize_t n;
  while ((n = read(fd, buf, sizeof buf)) > 0) out.append(buf, n);
  close(fd);
  return out;
}

TEST(MetricsServerTest, ServesTheLiveJobOnAnOsChosenPort) {
  FakeClock clock;
  auto c = RunningJob(&clock, 1);
  auto server = MetricsServer::Start(c.get(), "127.0.0.1", 0);
  ASSERT_TRUE(server.ok()) << server.status();
  const int port = (*server)->port();
  ASSERT_GT(port, 0);
  EXPECT_EQ((*server)->address(), absl::StrCat("127.0.0.1:", port));
  ASSERT_TRUE(c->Heartbeat({0, 5, 0.5, 10}).ok());
  std::string r = HttpGet(port, "/metrics");
  EXPECT_NE(r.find("200 OK"), std::string::npos) << r;
  EXPECT_NE(r.find("\nshardopt_rank_step{rank=\"0\"} 5\n"), std::string::npos) << r;
  // Computed on every scrape: a later heartbeat shows.
  ASSERT_TRUE(c->Heartbeat({0, 6, 0.5, 10}).ok());
  r = HttpGet(port, "/metrics");
  EXPECT_NE(r.find("\nshardopt_rank_step{rank=\"0\"} 6\n"), std::string::npos) << r;
  // Nothing else is served.
  EXPECT_EQ(HttpGet(port, "/").find("shardopt_"), std::string::npos);
  // The port is taken now: a second server there fails, naming it.
  auto second = MetricsServer::Start(c.get(), "127.0.0.1", port);
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(second.status().message().find(absl::StrCat("127.0.0.1:", port)), std::string::npos)
      << second.status();
  server->reset();
  EXPECT_EQ(HttpGet(port, "/metrics"), "");  // stopped
}

// Idle and half-sent connections (a slow proxy, a stuck scraper) do not
// block scrapes: 50 of them stay open while a scrape runs every 100 ms.
TEST(MetricsServerTest, IdleConnectionsDoNotBlockScrapes) {
  FakeClock clock;
  auto c = RunningJob(&clock, 1);
  auto server = MetricsServer::Start(c.get(), "127.0.0.1", 0);
  ASSERT_TRUE(server.ok()) << server.status();
  const int port = (*server)->port();
  std::vector<int> idle;
  for (int i = 0; i < 50; ++i) {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
    if (i % 2 == 0) {
      const std::string half = "GET /metrics HTTP/1.1\r\nHost: 127.0";  // never finished
      (void)!write(fd, half.data(), half.size());
    }
    idle.push_back(fd);
  }
  int answered = 0;
  for (int i = 0; i < 30; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    const std::string r = HttpGet(port, "/metrics");
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_NE(r.find("200 OK"), std::string::npos) << "scrape " << i << " after " << s << " s";
    EXPECT_LT(s, 1.0) << "scrape " << i;
    if (r.find("shardopt_rank_step") != std::string::npos) ++answered;
    // Pacing, not a wait: 30 scrapes 100 ms apart span 3 s, past the server's
    // 2 s request timeout for the half-sent requests held open above.
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_EQ(answered, 30);
  for (int fd : idle) close(fd);
}

}  // namespace
}  // namespace shardopt

// An in-memory CoordinatorApi (client/coordinator_client.h) for unit tests
// of what sits above the coordinator client (client/rank_agent.h): one fake
// per rank, as each rank has its own client. It records every call, answers
// Join at once, pushes scripted notices on the open session, and answers
// GetJob with what the test set. Thread-safe; every wait is bounded.
#ifndef SHARDOPT_TESTS_TESTING_FAKE_COORDINATOR_H_
#define SHARDOPT_TESTS_TESTING_FAKE_COORDINATOR_H_

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/coordinator_client.h"
#include "tests/testing/poll.h"

namespace shardopt {

class FakeCoordinator final : public CoordinatorApi {
 public:
  // ---- scripting

  // Delivered on the open session (or the next one opened); when the session
  // is broken (BreakSession), returned by the next unary Heartbeat instead.
  void PushNotice(const v1::HeartbeatResponse& notice) {
    std::lock_guard<std::mutex> l(mu_);
    notices_.push_back(notice);
    cv_.notify_all();
  }
  void PushAbort(const std::string& reason) {
    v1::HeartbeatResponse n;
    n.set_abort(true);
    n.set_abort_reason(reason);
    PushNotice(n);
  }
  // What GetJob answers from now on.
  void SetJob(const v1::GetJobResponse& job) {
    std::lock_guard<std::mutex> l(mu_);
    job_ = job;
  }
  void SetGetJobStatus(absl::Status s) {
    std::lock_guard<std::mutex> l(mu_);
    get_job_status_ = std::move(s);
  }
  void SetJoinResponse(absl::StatusOr<v1::JoinResponse> r) {
    std::lock_guard<std::mutex> l(mu_);
    join_response_ = std::move(r);
  }
  void SetReportFlightStatus(absl::Status s) {
    std::lock_guard<std::mutex> l(mu_);
    report_flight_status_ = std::move(s);
  }
  // The session's Send fails from now on, and its Receive returns false.
  void BreakSession() {
    std::lock_guard<std::mutex> l(mu_);
    session_broken_ = true;
    cv_.notify_all();
  }

  // ---- records

  std::vector<v1::JoinRequest> joins() const { return Locked(joins_); }
  std::vector<v1::HeartbeatRequest> heartbeats() const { return Locked(heartbeats_); }
  std::vector<std::pair<int, std::string>> aborts() const { return Locked(aborts_); }
  std::vector<int> finishes() const { return Locked(finishes_); }
  std::vector<v1::FlightRecord> flight_records() const { return Locked(flight_records_); }
  int sessions_opened() const { return Locked(sessions_opened_); }
  int sessions_closed() const { return Locked(sessions_closed_); }
  int get_job_calls() const { return Locked(get_job_calls_); }
  // Notices not yet taken by a session or heartbeat.
  size_t pending_notices() const {
    std::lock_guard<std::mutex> l(mu_);
    return notices_.size();
  }
  // Waits (bounded) until `pred` holds over the records; returns it.
  bool WaitFor(absl::FunctionRef<bool()> pred, absl::Duration timeout) {
    return PollUntil(pred, timeout);
  }

  // ---- CoordinatorApi

  absl::StatusOr<v1::JoinResponse> Join(const v1::JoinRequest& req, absl::Duration) override {
    std::lock_guard<std::mutex> l(mu_);
    joins_.push_back(req);
    if (!join_response_.ok()) return join_response_.status();
    v1::JoinResponse r = *join_response_;
    if (r.layout_hash() == 0) r.set_layout_hash(req.layout_hash());
    return r;
  }
  absl::StatusOr<v1::HeartbeatResponse> Heartbeat(const v1::HeartbeatRequest& req) override {
    std::lock_guard<std::mutex> l(mu_);
    heartbeats_.push_back(req);
    v1::HeartbeatResponse r;
    if (!notices_.empty()) {
      r = notices_.front();
      notices_.pop_front();
    }
    return r;
  }
  std::unique_ptr<CoordinatorSession> OpenSession() override {
    std::lock_guard<std::mutex> l(mu_);
    ++sessions_opened_;
    return std::make_unique<Session>(this);
  }
  absl::StatusOr<v1::GetJobResponse> GetJob(absl::Duration = absl::Seconds(5)) override {
    std::lock_guard<std::mutex> l(mu_);
    ++get_job_calls_;
    if (!get_job_status_.ok()) return get_job_status_;
    return job_;
  }
  absl::Status Abort(const std::string& reason, int rank) override {
    std::lock_guard<std::mutex> l(mu_);
    aborts_.emplace_back(rank, reason);
    return absl::OkStatus();
  }
  absl::Status Finish(int rank) override {
    std::lock_guard<std::mutex> l(mu_);
    finishes_.push_back(rank);
    return absl::OkStatus();
  }
  absl::Status ReportFlightRecord(const v1::FlightRecord& record) override {
    std::lock_guard<std::mutex> l(mu_);
    flight_records_.push_back(record);
    return report_flight_status_;
  }
  // Like the coordinator: a new version / request, pushed to the session.
  absl::StatusOr<int64_t> SetLearningRate(double lr) override {
    v1::HeartbeatResponse n;
    {
      std::lock_guard<std::mutex> l(mu_);
      n.set_learning_rate(lr);
      n.set_hyper_params_version(++lr_version_);
      n.set_checkpoint_request(checkpoint_request_);
    }
    PushNotice(n);
    return n.hyper_params_version();
  }
  absl::StatusOr<int64_t> RequestCheckpoint() override {
    v1::HeartbeatResponse n;
    {
      std::lock_guard<std::mutex> l(mu_);
      n.set_checkpoint_request(++checkpoint_request_);
    }
    PushNotice(n);
    return n.checkpoint_request();
  }
  absl::Status KvSet(const std::string& key, const std::string& value) override {
    std::lock_guard<std::mutex> l(mu_);
    kv_[key] = value;
    cv_.notify_all();
    return absl::OkStatus();
  }
  absl::StatusOr<std::string> KvGet(const std::string& key, absl::Duration wait) override {
    std::unique_lock<std::mutex> l(mu_);
    const bool found = cv_.wait_for(l, std::chrono::milliseconds(absl::ToInt64Milliseconds(wait)),
                                    [&] { return kv_.count(key) > 0; });
    if (!found) return absl::DeadlineExceededError("rendezvous get: " + key);
    return kv_[key];
  }

 private:
  class Session final : public CoordinatorSession {
   public:
    explicit Session(FakeCoordinator* f) : f_(f) {}
    bool Send(const v1::HeartbeatRequest& hb) override {
      std::lock_guard<std::mutex> l(f_->mu_);
      if (closed_ || f_->session_broken_) return false;
      f_->heartbeats_.push_back(hb);
      return true;
    }
    // Bounded by Close(), which the agent calls when it stops.
    bool Receive(v1::HeartbeatResponse* notice) override {
      std::unique_lock<std::mutex> l(f_->mu_);
      f_->cv_.wait(l, [&] { return closed_ || f_->session_broken_ || !f_->notices_.empty(); });
      if (closed_ || f_->session_broken_) return false;
      *notice = f_->notices_.front();
      f_->notices_.pop_front();
      return true;
    }
    void Close() override {
      std::lock_guard<std::mutex> l(f_->mu_);
      if (!closed_) ++f_->sessions_closed_;
      closed_ = true;
      f_->cv_.notify_all();
    }

   private:
    FakeCoordinator* const f_;
    bool closed_ = false;  // guarded by f_->mu_
  };

  template <typename T>
  T Locked(const T& v) const {
    std::lock_guard<std::mutex> l(mu_);
    return v;
  }

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<v1::HeartbeatResponse> notices_;
  v1::GetJobResponse job_;
  absl::Status get_job_status_;
  absl::StatusOr<v1::JoinResponse> join_response_ = v1::JoinResponse();
  absl::Status report_flight_status_;
  bool session_broken_ = false;
  std::vector<v1::JoinRequest> joins_;
  std::vector<v1::HeartbeatRequest> heartbeats_;
  std::vector<std::pair<int, std::string>> aborts_;
  std::vector<int> finishes_;
  std::vector<v1::FlightRecord> flight_records_;
  std::map<std::string, std::string> kv_;
  int sessions_opened_ = 0;
  int sessions_closed_ = 0;
  int get_job_calls_ = 0;
  int64_t lr_version_ = 0;
  int64_t checkpoint_request_ = 0;
};

}  // namespace shardopt

#endif  // SHARDOPT_TESTS_TESTING_FAKE_COORDINATOR_H_

// For tests: a Communicator that forwards the collectives to another one and
// has none of the optional capabilities (separate reduce-scatter chunks,
// device stream ordering), as a communicator without them behaves; tests
// derive from it to add a capability or a fault.
#ifndef SHARDOPT_TESTS_TESTING_FORWARDING_COMMUNICATOR_H_
#define SHARDOPT_TESTS_TESTING_FORWARDING_COMMUNICATOR_H_

#include <memory>
#include <utility>

#include "client/comm/communicator.h"

namespace shardopt {

class ForwardingCommunicator : public Communicator {
 public:
  explicit ForwardingCommunicator(std::unique_ptr<Communicator> inner)
      : owned_(std::move(inner)), inner_(owned_.get()) {}
  explicit ForwardingCommunicator(Communicator* inner) : inner_(inner) {}  // borrowed

  int rank() const override { return inner_->rank(); }
  int world_size() const override { return inner_->world_size(); }
  CommHandlePtr ReduceScatter(void* b, int64_t n, DType t, ReduceOp op) override {
    return inner_->ReduceScatter(b, n, t, op);
  }
  CommHandlePtr AllGather(void* b, int64_t n, DType t) override {
    return inner_->AllGather(b, n, t);
  }
  CommHandlePtr AllReduce(void* b, int64_t n, DType t, ReduceOp op) override {
    return inner_->AllReduce(b, n, t, op);
  }
  CommHandlePtr Broadcast(void* b, int64_t n, DType t, int root) override {
    return inner_->Broadcast(b, n, t, root);
  }
  CommHandlePtr Barrier() override { return inner_->Barrier(); }
  void Abort(const absl::Status& reason) override { inner_->Abort(reason); }
  ByteCounters counters() const override { return inner_->counters(); }

 protected:
  Communicator* inner() const { return inner_; }

 private:
  std::unique_ptr<Communicator> owned_;
  Communicator* inner_;
};

}  // namespace shardopt

#endif  // SHARDOPT_TESTS_TESTING_FORWARDING_COMMUNICATOR_H_

#!/usr/bin/python3
"""An independent client (Python grpcio, stubs generated from proto/shardopt.proto)
that reads the layout of a running job: python3 layout_client.py STUBS_DIR HOST:PORT."""
import sys

sys.path.insert(0, sys.argv[1])
import grpc  # noqa: E402
import shardopt_pb2  # noqa: E402
import shardopt_pb2_grpc  # noqa: E402

channel = grpc.insecure_channel(sys.argv[2])
stub = shardopt_pb2_grpc.CoordinatorStub(channel)
layout = stub.GetLayout(shardopt_pb2.GetLayoutRequest(), timeout=10)
job = stub.GetJob(shardopt_pb2.GetJobRequest(), timeout=10)
owned = sum(layout.owned_elements)
assert layout.world_size == job.world_size == 2, (layout.world_size, job.world_size)
assert owned == layout.num_elements, (owned, layout.num_elements)
assert layout.layout_hash == job.layout_hash
print(f"python client: job {job.job_id} {job.state}, {layout.world_size} ranks, "
      f"{layout.num_elements} elements, imbalance {layout.imbalance:.5f}, "
      f"{len(layout.ranges)} bucket ranges, hash {layout.layout_hash:016x}")

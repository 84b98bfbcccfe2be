"""Protobuf + gRPC C++ code generation with the system protoc (no downloads)."""

def cc_grpc_proto_library(name, src, deps = [], **kwargs):
    """Generates .pb.{h,cc} and .grpc.pb.{h,cc} for `src` and wraps them in a cc_library."""
    base = src[:-len(".proto")]
    outs = [base + ".pb.h", base + ".pb.cc", base + ".grpc.pb.h", base + ".grpc.pb.cc"]
    native.genrule(
        name = name + "_codegen",
        srcs = [src],
        outs = outs,
        cmd = ("protoc --proto_path=. --cpp_out=$(GENDIR) --grpc_out=$(GENDIR) " +
               "--plugin=protoc-gen-grpc=/usr/bin/grpc_cpp_plugin $(location " + src + ")"),
    )
    native.cc_library(
        name = name,
        srcs = [base + ".pb.cc", base + ".grpc.pb.cc"],
        hdrs = [base + ".pb.h", base + ".grpc.pb.h"],
        deps = deps + ["@system//:grpc"],
        **kwargs
    )

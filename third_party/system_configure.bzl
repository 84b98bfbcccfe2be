"""Debian's system libraries as the repository @system.

Link flags come from the libraries' own pkg-config files (so their order and
the Abseil libraries gRPC needs follow the installed versions, not a list kept
by hand), headers are declared (so an upgraded package rebuilds what includes
it), and the CPython include directory is the one of /usr/bin/python3.
Headers live under /usr/include, which the compiler searches already.
"""

# pkg-config modules per target. Abseil: the components the code uses (their
# .pc files pull in what they need, in link order).
_PKG = {
    "absl": [
        "absl_statusor",
        "absl_status",
        "absl_strings",
        "absl_str_format",
        "absl_synchronization",
        "absl_time",
        "absl_hash",
        "absl_raw_hash_set",
        "absl_flat_hash_map",
        "absl_node_hash_map",
        "absl_cord",
    ],
    "grpc": ["grpc++"],  # (grpc++_reflection has no .pc file: named below)
    "protobuf": ["protobuf"],
    "gtest": ["gtest"],
    "gtest_main": ["gtest_main"],
    "glog": ["libglog"],
    "prometheus_cpp": ["prometheus-cpp-pull", "prometheus-cpp-core"],
}

# Header folders under /usr/include declared per target.
_HDRS = {
    "absl": ["absl/**"],
    "grpc": ["grpc/**", "grpcpp/**", "grpc++/**"],
    "protobuf": ["google/protobuf/**"],
    "gtest": ["gtest/**", "gmock/**"],
    "glog": ["glog/**", "gflags/**"],
    "gloo": ["gloo/**"],
    "nlohmann_json": ["nlohmann/**"],
    "prometheus_cpp": ["prometheus/**"],
}

def _fail(msg):
    fail("@system (third_party/system_configure.bzl): " + msg +
         "; tools/setup.sh installs what the build needs")

def _pkg_libs(ctx, modules):
    r = ctx.execute(["pkg-config", "--libs"] + modules)
    if r.return_code != 0:
        _fail("pkg-config --libs %s failed: %s" % (" ".join(modules), r.stderr.strip()))
    return [f for f in r.stdout.replace("\n", " ").split(" ") if f]

def _python_include(ctx):
    r = ctx.execute(["/usr/bin/python3", "-c",
                     "import sysconfig; print(sysconfig.get_paths()['include'])"])
    if r.return_code != 0:
        _fail("/usr/bin/python3 cannot say where its headers are: " + r.stderr.strip())
    inc = r.stdout.strip()
    if not inc.startswith("/usr/include/"):
        _fail("python3's headers are at %s, not under /usr/include" % inc)
    if not ctx.path(inc + "/Python.h").exists:
        _fail("%s/Python.h is missing (python3-dev)" % inc)
    return inc[len("/usr/"):]

def _dedup_keep_last(flags):
    # A static-link order needs each library after its users: when pkg-config
    # repeats a library, its last position is the right one.
    seen = {}
    out = []
    for f in reversed(flags):
        if f.startswith("-l") and f in seen:
            continue
        seen[f] = True
        out.append(f)
    return list(reversed(out))

def _target(name, linkopts, hdrs, deps = [], includes = []):
    return """
cc_library(
    name = "{name}",
    hdrs = {hdrs},
    includes = {includes},
    linkopts = {linkopts},
    deps = {deps},
)
""".format(name = name, hdrs = hdrs, includes = includes, linkopts = linkopts, deps = deps)

def _globbed(patterns):
    return "glob(%s, allow_empty = True)" % ["include/" + p for p in patterns]

def _system_configure_impl(ctx):
    ctx.symlink("/usr/include", "include")
    libs = {name: _dedup_keep_last(_pkg_libs(ctx, mods)) for name, mods in _PKG.items()}
    py_inc = _python_include(ctx)
    out = []
    out.append(_target("absl", libs["absl"] + ["-lpthread"], _globbed(_HDRS["absl"])))
    out.append(_target("glog", libs["glog"], _globbed(_HDRS["glog"])))
    out.append(_target("gtest", libs["gtest"] + ["-lpthread"], _globbed(_HDRS["gtest"])))
    out.append(_target("gtest_main", libs["gtest_main"], "[]", deps = [":gtest"]))
    out.append(_target("protobuf", libs["protobuf"], _globbed(_HDRS["protobuf"])))
    out.append(_target(
        "grpc",
        ["-lgrpc++_reflection"] + libs["grpc"],
        _globbed(_HDRS["grpc"]),
        deps = [":absl", ":protobuf"],
    ))
    out.append(_target(
        "torch",
        ["-ltorch", "-ltorch_cpu", "-lc10"],
        _globbed(["torch/csrc/api/include/**/*.h"]),
        includes = ["include/torch/csrc/api/include"],
    ))
    out.append(_target("gloo", ["-lgloo"], _globbed(_HDRS["gloo"])))
    out.append(_target("nlohmann_json", [], _globbed(_HDRS["nlohmann_json"])))
    out.append(_target("openmp", ["-fopenmp"], "[]"))
    out.append(_target(
        "prometheus_cpp",
        libs["prometheus_cpp"],
        _globbed(_HDRS["prometheus_cpp"]),
    ))

    # CPython headers and LibTorch's Python bindings (python3-torch, the same
    # build as libtorch-dev), for the Python extension only; it does not link
    # libpython (the interpreter provides it).
    out.append(_target(
        "torch_python",
        ["-ltorch_python"],
        _globbed([py_inc[len("include/"):] + "/**/*.h"]),
        deps = [":torch"],
        includes = [py_inc],
    ))
    ctx.file("BUILD", """# Generated by third_party/system_configure.bzl from pkg-config and
# /usr/bin/python3 (CPython headers: /usr/{py}).
package(default_visibility = ["//visibility:public"])
{targets}""".format(py = py_inc, targets = "".join(out)))

system_configure = repository_rule(
    implementation = _system_configure_impl,
    local = True,
)

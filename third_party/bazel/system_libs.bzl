"""Wires Debian's system C++ libraries into Bazel through pkg-config.

One cc_library per pkg-config package, with the exact flags pkg-config reports,
so Abseil's versioned symbols and gRPC's transitive libraries link correctly.
Nothing is downloaded.
"""

_PACKAGES = {
    # bazel name: pkg-config modules
    "grpcpp": ["grpc++"],
    "protobuf": ["protobuf"],
    "absl": [
        "absl_status",
        "absl_statusor",
        "absl_strings",
        "absl_str_format",
        "absl_flags",
        "absl_flags_parse",
        "absl_flags_usage",
        "absl_synchronization",
        "absl_time",
        "absl_flat_hash_map",
        "absl_flat_hash_set",
        "absl_span",
        "absl_inlined_vector",
        "absl_optional",
        "absl_cleanup",
        "absl_random_random",
        "absl_hash",
    ],
    "yaml_cpp": ["yaml-cpp"],
    "gtest": ["gtest"],
    "gtest_main": ["gtest_main"],
    "gmock": ["gmock"],
    "benchmark": ["benchmark"],
    "spdlog": ["spdlog"],
    "xxhash": ["libxxhash"],
    "zlib": ["zlib"],  # crc32 of the zip entries in DCP data files
    "uring": ["liburing"],
    "nlohmann_json": ["nlohmann_json"],
    "simdjson": ["simdjson"],
    "prometheus_cpp": ["prometheus-cpp-pull", "prometheus-cpp-core"],
    "systemd": ["libsystemd"],
    "crypto": ["libcrypto"],  # HMAC-SHA256 of multi-node job keys (server/multinode/job_mac.h)
    "curl": ["libcurl"],  # S3 requests (core/io/s3)
    "expat": ["expat"],  # S3's XML answers (core/io/s3/s3_xml.h)
}

def _pkg_config(ctx, args):
    res = ctx.execute(["pkg-config"] + args)
    if res.return_code != 0:
        fail("pkg-config %s failed: %s (run deploy/install-deps.sh)" % (" ".join(args), res.stderr))
    return [f for f in res.stdout.strip().split(" ") if f]

def _system_libs_impl(ctx):
    lines = ['package(default_visibility = ["//visibility:public"])', ""]
    for name, modules in _PACKAGES.items():
        cflags = [f for f in _pkg_config(ctx, ["--cflags"] + modules) if f != "-I/usr/include"]
        libs = _pkg_config(ctx, ["--libs"] + modules)
        defines = [f[2:] for f in cflags if f.startswith("-D")]
        copts = [f for f in cflags if not f.startswith("-D")]
        lines.append("cc_library(")
        lines.append('    name = "%s",' % name)
        lines.append("    copts = %s," % repr(copts))
        lines.append("    defines = %s," % repr(defines))
        lines.append("    linkopts = %s," % repr(libs + ["-lpthread"]))
        lines.append(")")
        lines.append("")
    ctx.file("WORKSPACE", 'workspace(name = "%s")\n' % ctx.name)
    ctx.file("BUILD", "\n".join(lines))

system_libs = repository_rule(
    implementation = _system_libs_impl,
    local = True,
    environ = ["PKG_CONFIG_PATH"],
)

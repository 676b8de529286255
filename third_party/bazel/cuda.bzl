"""Wires the local CUDA toolkit (headers, cudart, NCCL) into Bazel, offline.

Creates repository @cuda with:
  :cuda_headers  the toolkit's include/ (globbed: some headers have no extension)
  :cudart        + -lcudart (rpath to the toolkit's lib64)
  :nccl          + -lnccl
Targets use them only under --config=cuda (select on //:cuda). When the
toolkit is absent the libraries are empty, so the CPU build never needs it.
"""

def _cuda_repository_impl(ctx):
    root = ctx.os.environ.get("CKPTD_CUDA_PATH", "/usr/local/cuda")
    have = ctx.path(root + "/include/cuda_runtime_api.h").exists
    lib = root + "/lib64"
    lines = ['package(default_visibility = ["//visibility:public"])', ""]
    if have:
        ctx.symlink(root + "/include", "include")
        lines += [
            "cc_library(",
            '    name = "cuda_headers",',
            # The CCCL tree (thrust/cub/libcu++) is large and unused by ckptd.
            '    hdrs = glob(["include/**"], exclude = ["include/cccl/**"]),',
            '    includes = ["include"],',
            ")",
            "",
            "cc_library(",
            '    name = "cudart",',
            '    linkopts = ["-L%s", "-Wl,-rpath,%s", "-lcudart"],' % (lib, lib),
            '    deps = [":cuda_headers"],',
            ")",
            "",
            "cc_library(",
            '    name = "nccl",',
            '    linkopts = ["-L%s", "-Wl,-rpath,%s", "-lnccl"],' % (lib, lib),
            '    deps = [":cudart"],',
            ")",
        ]
    else:
        for name in ["cuda_headers", "cudart", "nccl"]:
            lines.append('cc_library(name = "%s")' % name)
    ctx.file("WORKSPACE", 'workspace(name = "%s")\n' % ctx.name)
    ctx.file("BUILD", "\n".join(lines) + "\n")

cuda_repository = repository_rule(
    implementation = _cuda_repository_impl,
    local = True,
    environ = ["CKPTD_CUDA_PATH"],
)

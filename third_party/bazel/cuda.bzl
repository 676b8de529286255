"""Wires the local CUDA toolkit (headers, cudart, NCCL) into Bazel, offline.

Creates repository @cuda with:
  :cuda_headers  the toolkit's include/ (globbed: some headers have no extension)
  :cudart        + libcudart_static.a (no libcudart.so is needed at run time;
                 only the driver's libcuda.so, which cudart finds itself)
  :nccl          headers only: ckptd loads libnccl.so.2 with dlopen at first
                 use (server/cuda/nccl_api.h), so binaries start without it
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
            '    linkopts = ["%s/libcudart_static.a", "-ldl", "-lpthread", "-lrt"],' % lib,
            '    deps = [":cuda_headers"],',
            ")",
            "",
            "cc_library(",
            '    name = "nccl",',
            '    linkopts = ["-ldl"],',
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

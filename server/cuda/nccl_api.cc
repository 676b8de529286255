#include "server/cuda/nccl_api.h"

#include <dlfcn.h>
#include <glob.h>

#include <cstdlib>
#include <vector>

#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace ckptd::gpu {
namespace {

std::vector<std::string> Candidates() {
  std::vector<std::string> out;
  if (const char* p = std::getenv("CKPTD_NCCL_LIBRARY"); p != nullptr && *p != '\0') {
    out.push_back(p);
  }
  out.push_back("libnccl.so.2");
  std::vector<std::string> patterns;
  const std::string tail = "/nvidia/nccl/lib/libnccl.so.2";
  if (const char* v = std::getenv("VIRTUAL_ENV"); v != nullptr && *v != '\0') {
    patterns.push_back(absl::StrCat(v, "/lib/python3*/site-packages", tail));
  }
  for (const char* base : {"/usr/local/lib/python3*/dist-packages", "/usr/local/lib/python3*/site-packages",
                           "/usr/lib/python3*/dist-packages", "/usr/lib/python3/dist-packages",
                           "/opt/*/.venv/lib/python3*/site-packages", "/opt/conda/lib/python3*/site-packages"}) {
    patterns.push_back(absl::StrCat(base, tail));
  }
  if (const char* h = std::getenv("HOME"); h != nullptr && *h != '\0') {
    patterns.push_back(absl::StrCat(h, "/.local/lib/python3*/site-packages", tail));
  }
  for (const std::string& pat : patterns) {
    glob_t g{};
    if (glob(pat.c_str(), 0, nullptr, &g) == 0) {
      for (size_t i = 0; i < g.gl_pathc; ++i) out.push_back(g.gl_pathv[i]);
    }
    globfree(&g);
  }
  return out;
}

template <typename F>
bool Bind(void* lib, const char* name, F* fn, std::vector<std::string>* missing) {
  *fn = reinterpret_cast<F>(dlsym(lib, name));
  if (*fn == nullptr) missing->push_back(name);
  return *fn != nullptr;
}

absl::StatusOr<NcclApi> Load() {
  std::vector<std::string> tried;
  for (const std::string& path : Candidates()) {
    void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      const char* err = dlerror();
      tried.push_back(absl::StrCat(path, ": ", err != nullptr ? err : "not loadable"));
      continue;
    }
    NcclApi api;
    api.path = path;
    std::vector<std::string> missing;
    ncclResult_t (*get_version)(int*) = nullptr;
    Bind(lib, "ncclGetVersion", &get_version, &missing);
    Bind(lib, "ncclGetErrorString", &api.GetErrorString, &missing);
    Bind(lib, "ncclGetUniqueId", &api.GetUniqueId, &missing);
    Bind(lib, "ncclCommInitRankConfig", &api.CommInitRankConfig, &missing);
    Bind(lib, "ncclCommGetAsyncError", &api.CommGetAsyncError, &missing);
    Bind(lib, "ncclCommFinalize", &api.CommFinalize, &missing);
    Bind(lib, "ncclCommDestroy", &api.CommDestroy, &missing);
    Bind(lib, "ncclCommAbort", &api.CommAbort, &missing);
    Bind(lib, "ncclSend", &api.Send, &missing);
    Bind(lib, "ncclRecv", &api.Recv, &missing);
    if (!missing.empty()) {
      tried.push_back(absl::StrCat(path, ": lacks ", absl::StrJoin(missing, ", "),
                                   " (NCCL 2.14 or newer is needed)"));
      dlclose(lib);
      continue;
    }
    if (get_version(&api.version) != ncclSuccess) api.version = 0;
    return api;
  }
  return absl::FailedPreconditionError(
      absl::StrCat("NCCL is not available (set CKPTD_NCCL_LIBRARY to libnccl.so.2, or install "
                   "libnccl2 or pip's nvidia-nccl): tried ",
                   absl::StrJoin(tried, "; ")));
}

}  // namespace

absl::StatusOr<const NcclApi*> LoadNccl() {
  static const absl::StatusOr<NcclApi>* loaded = [] {
    auto* r = new absl::StatusOr<NcclApi>(Load());
    if (r->ok()) {
      spdlog::info("NCCL {} loaded from {}", (*r)->version, (*r)->path);
    } else {
      spdlog::warn("{}", std::string(r->status().message()));
    }
    return r;
  }();
  if (!loaded->ok()) return loaded->status();
  return &**loaded;
}

}  // namespace ckptd::gpu

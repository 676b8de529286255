// Reading the PEM files of the TLS settings (tcp_tls_*, peer_tls_*).
#ifndef CKPTD_SERVER_PEM_H_
#define CKPTD_SERVER_PEM_H_

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace ckptd {

// The PEM text of `path` (config key `key` in errors); at most 1 MiB, and
// it must hold at least one "-----BEGIN" block.
inline absl::StatusOr<std::string> ReadPem(const std::string& path, const std::string& key) {
  FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) {
    return absl::NotFoundError(absl::StrCat(key, ": cannot open ", path, ": ", std::strerror(errno)));
  }
  std::string out;
  char buf[16384];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), f)) > 0 && out.size() <= (1 << 20)) out.append(buf, n);
  std::fclose(f);
  if (out.size() > (1 << 20)) {
    return absl::InvalidArgumentError(absl::StrCat(key, ": ", path, " is larger than 1 MiB"));
  }
  if (!absl::StrContains(out, "-----BEGIN ")) {
    return absl::InvalidArgumentError(absl::StrCat(key, ": ", path, " holds no PEM block"));
  }
  return out;
}

}  // namespace ckptd

#endif  // CKPTD_SERVER_PEM_H_

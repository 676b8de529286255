#include "server/multinode/job_mac.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>

#include "absl/strings/str_cat.h"

namespace ckptd {
namespace {

// HMAC-SHA256 of the fields, each followed by a NUL (no field holds one:
// job ids and node addresses are checked names; a NUL in one only changes
// which MAC it gets).
std::string Mac(absl::string_view key, std::initializer_list<absl::string_view> fields) {
  if (key.empty()) return std::string();
  std::string message;
  for (absl::string_view f : fields) absl::StrAppend(&message, f, absl::string_view("\0", 1));
  unsigned char out[EVP_MAX_MD_SIZE];
  unsigned int n = 0;
  if (::HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()),
             reinterpret_cast<const unsigned char*>(message.data()), message.size(), out,
             &n) == nullptr) {
    return std::string();  // never matches a real MAC (MacMatches: empty vs not)
  }
  return std::string(reinterpret_cast<const char*>(out), n);
}

}  // namespace

std::string JoinMac(absl::string_view key, absl::string_view job_id, absl::string_view node) {
  return Mac(key, {"ckptd/1 join", job_id, node});
}

std::string PlanMac(absl::string_view key, absl::string_view job_id,
                    absl::string_view coordinator, absl::string_view node) {
  return Mac(key, {"ckptd/1 plan", job_id, coordinator, node});
}

std::string CoordinatorMac(absl::string_view key, absl::string_view job_id,
                           absl::string_view node) {
  return Mac(key, {"ckptd/1 coordinator", job_id, node});
}

bool MacMatches(absl::string_view got, absl::string_view want) {
  if (got.size() != want.size()) return false;
  return got.empty() || CRYPTO_memcmp(got.data(), want.data(), got.size()) == 0;
}

}  // namespace ckptd

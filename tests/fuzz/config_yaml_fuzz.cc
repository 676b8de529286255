// Fuzz target: the daemon's YAML configuration (config/config.h):
// ParseConfig, then ValidateConfig, as `ckptd --config` and
// `ckptd --check-config` do; and the value parsers it uses (ParseBytes,
// ParseDuration, HostOf, IsLoopbackAddress) on the raw input.
//
// Property: a configuration that parses and validates is written by
// ConfigToYaml as YAML that parses again.
#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"
#include "config/config.h"
#include "tests/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text = ckptd_fuzz::Str(data, size);

  (void)ckptd::ParseBytes(text);
  (void)ckptd::ParseDuration(text);
  (void)ckptd::HostOf(text);
  (void)ckptd::IsLoopbackAddress(text);

  auto config = ckptd::ParseConfig(text, "fuzz.yaml");
  ckptd_fuzz::Note("ParseConfig", config.status());
  if (!config.ok()) return 0;
  const absl::Status valid = ckptd::ValidateConfig(*config);
  ckptd_fuzz::Note("ValidateConfig", valid);
  if (!valid.ok()) return 0;
  const std::string yaml = ckptd::ConfigToYaml(*config);
  auto again = ckptd::ParseConfig(yaml, "ConfigToYaml");
  FUZZ_CHECK(again.ok(), absl::StrCat(again.status().ToString(), "\n", yaml));
  return 0;
}

// Fuzz target: the native metadata file `{uid}.metadata` (core/format/metadata.h):
// ParseMetadataJson, then ValidateMetadata on what parses (what
// OpenCheckpoint does with a native checkpoint's metadata).
//
// Property: a model that validates survives MetadataToJson -> parse ->
// validate, and its JSON is then a fixed point.
#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"
#include "core/format/metadata.h"
#include "tests/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text = ckptd_fuzz::Str(data, size);
  auto m = ckpt::ParseMetadataJson("fuzz.metadata", text);
  ckptd_fuzz::Note("ParseMetadataJson", m.status());
  if (!m.ok()) return 0;
  absl::Status valid = ckpt::ValidateMetadata(*m, "fuzz.metadata");
  ckptd_fuzz::Note("ValidateMetadata", valid);
  if (!valid.ok()) return 0;

  const std::string json = ckpt::MetadataToJson(*m);
  auto again = ckpt::ParseMetadataJson("round-trip.metadata", json);
  FUZZ_CHECK(again.ok(), absl::StrCat(again.status().ToString(), "\n", json));
  absl::Status valid_again = ckpt::ValidateMetadata(*again, "round-trip.metadata");
  FUZZ_CHECK(valid_again.ok(), absl::StrCat(valid_again.ToString(), "\n", json));
  FUZZ_CHECK(ckpt::MetadataToJson(*again) == json, json);
  return 0;
}

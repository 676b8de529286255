// Fuzz target: layout files (core/tools/layout.h), what `ckptctl shard/load
// --layout` reads: ParseLayout, then PlanLoad of the layout's ranks against a
// fixed checkpoint (fuzz_model.h, examples/tiny-model saved as two ranks).
//
// Properties: a layout that parses survives LayoutToJson -> ParseLayout with
// the same JSON; every plan satisfies CheckPlan (the executor trusts plans).
#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"
#include "core/tools/layout.h"
#include "core/plan/planner.h"
#include "tests/fuzz/fuzz_model.h"
#include "tests/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text = ckptd_fuzz::Str(data, size);
  auto layout = ckpt::ParseLayout("fuzz.json", text);
  ckptd_fuzz::Note("ParseLayout", layout.status());
  if (!layout.ok()) return 0;

  const std::string json = ckpt::LayoutToJson(*layout);
  auto again = ckpt::ParseLayout("round-trip.json", json);
  FUZZ_CHECK(again.ok(), absl::StrCat(again.status().ToString(), "\n", json));
  FUZZ_CHECK(ckpt::LayoutToJson(*again) == json, json);

  auto plan = ckpt::PlanLoad(ckptd_fuzz::TinyCheckpoint(), layout->ranks);
  ckptd_fuzz::Note("PlanLoad", plan.status());
  if (plan.ok()) ckptd_fuzz::CheckPlan(*plan, layout->ranks, "PlanLoad");
  return 0;
}

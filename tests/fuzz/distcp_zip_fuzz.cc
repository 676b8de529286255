// Fuzz target: PyTorch DCP storage items (core/format/torch_dcp.h): each item of a
// `.distcp` file is a whole torch.save zip archive, read through its central
// directory (ReadZipDirectory, zip64 aware), its local headers
// (ZipEntryDataOffset) and its data.pkl (ReadTorchSaveTensor).
//
// Input: one item. It is read at offset 0 of a file of its own size, and
// again as an item in the middle of a larger file (as single_file_per_rank
// writes them), which must give the same answers shifted by the offset.
//
// Properties: every entry's data offset lies inside the item, and so do
// the bytes of the tensor found.
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/format/pickle.h"
#include "core/format/torch_dcp.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

constexpr uint64_t kPrefix = 13;  // bytes of another item before this one
constexpr uint64_t kSuffix = 7;   // and after it

struct Result {
  bool dir_ok = false;
  std::vector<ckpt::ZipEntry> entries;
  std::vector<std::string> offsets;  // per entry: offset relative to the item, or the error
  bool tensor_ok = false;
  ckpt::TorchSavedTensor tensor;
};

Result ReadItem(const ckpt::RandomAccessFile& f, uint64_t begin, uint64_t length) {
  Result r;
  auto entries = ckpt::ReadZipDirectory(f, begin, length);
  if (entries.ok()) {
    r.dir_ok = true;
    r.entries = *entries;
    for (const ckpt::ZipEntry& e : *entries) {
      auto at = ckpt::ZipEntryDataOffset(f, begin, length, e);
      if (at.ok()) {
        FUZZ_CHECK(*at >= begin && *at - begin <= length && e.size <= length - (*at - begin),
                   absl::StrCat("entry '", e.name, "' data at ", *at, " + ", e.size,
                                " outside the item [", begin, ", +", length, ")"));
        r.offsets.push_back(absl::StrCat(*at - begin));
      } else {
        r.offsets.push_back(std::string(absl::StatusCodeToString(at.status().code())));
      }
    }
  }
  ckptd_fuzz::Note("ReadZipDirectory", entries.status());
  auto t = ckpt::ReadTorchSaveTensor(f, begin, length);
  ckptd_fuzz::Note("ReadTorchSaveTensor", t.status());
  if (t.ok()) {
    r.tensor_ok = true;
    r.tensor = *t;
    FUZZ_CHECK(t->data_offset >= begin && t->data_offset - begin <= length &&
                   t->nbytes <= length - (t->data_offset - begin),
               absl::StrCat("tensor bytes at ", t->data_offset, " + ", t->nbytes,
                            " outside the item [", begin, ", +", length, ")"));
  }
  return r;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string item = ckptd_fuzz::Str(data, size);
  ckpt::MemoryFile alone("__0_0.distcp", item);
  const Result a = ReadItem(alone, 0, size);

  const std::string framed = std::string(kPrefix, 'P') + item + std::string(kSuffix, 'S');
  ckpt::MemoryFile inside("__0_0.distcp", framed);
  const Result b = ReadItem(inside, kPrefix, size);

  FUZZ_CHECK(a.dir_ok == b.dir_ok && a.entries.size() == b.entries.size() &&
                 a.offsets == b.offsets && a.tensor_ok == b.tensor_ok,
             "the item reads differently at another offset");
  if (a.tensor_ok) {
    FUZZ_CHECK(b.tensor.data_offset == a.tensor.data_offset + kPrefix &&
                   b.tensor.nbytes == a.tensor.nbytes && b.tensor.size == a.tensor.size,
               "the tensor moves differently from its item");
  }
  return 0;
}

// Fuzz target: the safetensors header parser (core/format/safetensors.h), which
// reads every data file of every checkpoint format before anything else.
//
// Input: 8 bytes little-endian, the file's total size; then the header JSON.
// The same header is checked twice: ParseSafetensorsHeader(json, file_size),
// and ReadSafetensorsHeader over a file of that size whose first bytes are
// the length field and the JSON (the rest zeros, never materialised).
//
// Properties (docs/file-format.md): both entry points agree; a header that
// parses has tensors that tile [data_start, file_size) exactly, each holding
// prod(shape) * itemsize bytes.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "core/format/safetensors.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

// A file of `size` bytes that starts with `head`, zeros after it.
class SparseFile : public ckpt::RandomAccessFile {
 public:
  SparseFile(std::string head, uint64_t size) : head_(std::move(head)), size_(size) {}
  const std::string& path() const override { return path_; }
  uint64_t size() const override { return size_; }
  absl::Status Read(uint64_t offset, uint64_t n, void* dst) const override {
    if (offset > size_ || n > size_ - offset) {
      return absl::OutOfRangeError(absl::StrCat(path_, ": truncated"));
    }
    // Callers read small ranges (the length field and the header).
    FUZZ_CHECK(n <= head_.size() + (1u << 20), absl::StrCat("read of ", n, " bytes"));
    auto* out = static_cast<char*>(dst);
    std::memset(out, 0, n);
    if (offset < head_.size()) {
      std::memcpy(out, head_.data() + offset, std::min<uint64_t>(n, head_.size() - offset));
    }
    return absl::OkStatus();
  }

 private:
  const std::string path_ = "fuzz.safetensors";
  std::string head_;
  uint64_t size_;
};

uint64_t Le64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 8) return 0;
  const uint64_t file_size = Le64(data);
  const std::string json = ckptd_fuzz::Str(data + 8, size - 8);

  auto parsed = ckpt::ParseSafetensorsHeader("fuzz.safetensors", json, file_size);

  std::string head(8, '\0');
  for (int i = 0; i < 8; ++i) head[i] = static_cast<char>((json.size() >> (8 * i)) & 0xff);
  head += json;
  SparseFile file(head, file_size);
  auto read = ckpt::ReadSafetensorsHeader(file);
  ckptd_fuzz::Note("ParseSafetensorsHeader", parsed.status());
  FUZZ_CHECK(parsed.ok() == read.ok(),
             absl::StrCat("Parse: ", parsed.status().ToString(), " / Read: ", read.status().ToString()));

  if (!parsed.ok()) return 0;
  const ckpt::SafetensorsHeader& h = *parsed;
  FUZZ_CHECK(h.data_start == 8 + json.size() && h.file_size == file_size, "data_start/file_size");
  uint64_t pos = h.data_start;
  for (const ckpt::SafetensorsTensor& t : h.tensors) {
    FUZZ_CHECK(t.begin == pos && t.end >= t.begin, absl::StrCat("tensor '", t.name, "' not tiled"));
    auto nbytes = ckpt::CheckedNumBytes(t.shape, ckpt::DTypeSize(t.dtype));
    FUZZ_CHECK(nbytes.ok() && static_cast<uint64_t>(*nbytes) == t.end - t.begin,
               absl::StrCat("tensor '", t.name, "' size"));
    FUZZ_CHECK(h.Find(t.name) != nullptr, t.name);
    pos = t.end;
  }
  FUZZ_CHECK(pos == file_size, "tensors do not end at the end of the file");
  return 0;
}

// WriteDcpDataFile: DCP data files written by ckptd read back by ckptd's own
// torch.save reader (ReadTorchSaveTensor), byte for byte; the zip's CRC-32s
// checked against zlib over the bytes in the file. (torch.load reading them
// is checked end to end by tests/foreign:dcp_writer_test.)
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "core/io/file.h"
#include "core/format/torch_dcp.h"
#include "gtest/gtest.h"
#include "tests/testing/temp_dir.h"
#include "zlib.h"

namespace ckpt {
namespace {

uint64_t LE(const std::string& s, size_t at, int n) {
  uint64_t v = 0;
  for (int i = n - 1; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(s[at + i]);
  return v;
}

std::string ReadAll(const RandomAccessFile& f) {
  std::string s(f.size(), '\0');
  EXPECT_TRUE(f.Read(0, s.size(), s.data()).ok());
  return s;
}

TEST(DcpWriter, TensorsAndRawItemsReadBackExactly) {
  testing::TempDir tmp;
  auto dir = Directory::Open(tmp.path(), /*confine=*/true);
  ASSERT_TRUE(dir.ok()) << dir.status();
  std::vector<float> a(7 * 5);
  std::iota(a.begin(), a.end(), -3.5f);
  std::vector<int64_t> b(3 * 4 * 2);
  for (size_t i = 0; i < b.size(); ++i) b[i] = static_cast<int64_t>(i) * 1000003 - (1ll << 40);
  const std::string raw = "\x80\x02}q\x00.";  // a pickled {} (a bytes entry)
  uint16_t bf = 0x3f80;                       // a 0-d bf16 tensor: 1.0
  std::vector<DcpItemToWrite> items = {
      {"a", DType::kF32, {7, 5}, a.data(), a.size() * 4, false},
      {"extra", DType::kU8, {static_cast<int64_t>(raw.size())}, raw.data(), raw.size(), true},
      {"b", DType::kI64, {3, 4, 2}, b.data(), b.size() * 8, false},
      {"s", DType::kBF16, {}, &bf, 2, false},
      {"empty", DType::kF16, {0, 3}, nullptr, 0, false},
  };
  auto written = WriteDcpDataFile(*dir, "__0_0.distcp", items);
  ASSERT_TRUE(written.ok()) << written.status();
  ASSERT_EQ(written->size(), items.size());
  auto f = (*dir)->OpenFile("__0_0.distcp");
  ASSERT_TRUE(f.ok()) << f.status();
  const std::string bytes = ReadAll(**f);
  for (size_t i = 0; i < items.size(); ++i) {
    const DcpItemWritten& w = (*written)[i];
    SCOPED_TRACE(items[i].name);
    EXPECT_EQ(w.offset % 64, 0u);
    ASSERT_LE(w.offset + w.length, bytes.size());
    if (items[i].raw) {
      EXPECT_EQ(bytes.substr(w.offset, w.length), raw);
      continue;
    }
    auto t = ReadTorchSaveTensor(**f, w.offset, w.length);
    ASSERT_TRUE(t.ok()) << t.status();
    EXPECT_EQ(t->dtype, items[i].dtype);
    EXPECT_EQ(t->size, items[i].shape);
    EXPECT_EQ(t->storage_offset, 0);
    EXPECT_EQ(t->nbytes, items[i].nbytes);
    if (t->nbytes > 0) {
      EXPECT_EQ(t->data_offset % 64, 0u);  // aligned, as torch aligns
    }
    if (items[i].nbytes > 0) {
      EXPECT_EQ(std::memcmp(bytes.data() + t->data_offset, items[i].data, items[i].nbytes), 0);
    }
    // Every entry's CRC-32, in the central directory and the local header,
    // is zlib's over the entry's bytes in the file.
    auto entries = ReadZipDirectory(**f, w.offset, w.length);
    ASSERT_TRUE(entries.ok()) << entries.status();
    ASSERT_EQ(entries->size(), 3u);
    EXPECT_EQ((*entries)[0].name, "archive/data.pkl");  // torch.load finds the archive by it
    // The data entry last: the small entries' headers stay below 4 GiB, which
    // their 4-byte central-directory offsets can hold, for any tensor size.
    EXPECT_EQ((*entries)[2].name, "archive/data/0");
    EXPECT_LT((*entries)[1].header_offset, (*entries)[2].header_offset);
    const std::string arch = bytes.substr(w.offset, w.length);
    // Central directory CRCs: walk the records (46-byte headers) from the first.
    const size_t cd = arch.find(std::string("\x50\x4b\x01\x02", 4));
    ASSERT_NE(cd, std::string::npos);
    for (const ZipEntry& z : *entries) {
      auto at = ZipEntryDataOffset(**f, w.offset, w.length, z);
      ASSERT_TRUE(at.ok()) << at.status();
      const uint32_t want = static_cast<uint32_t>(
          crc32_z(0, reinterpret_cast<const Bytef*>(bytes.data() + *at), z.size));
      const uint64_t local = w.offset + z.header_offset;
      EXPECT_EQ(LE(bytes, local + 14, 4), want) << z.name << " (local header)";
      size_t p = cd;
      bool found = false;
      while (p != std::string::npos && p + 46 <= arch.size()) {
        const uint64_t name_len = LE(arch, p + 28, 2);
        if (arch.compare(p + 46, name_len, z.name) == 0) {
          EXPECT_EQ(LE(arch, p + 16, 4), want) << z.name << " (central directory)";
          found = true;
          break;
        }
        p = arch.find(std::string("\x50\x4b\x01\x02", 4), p + 46);
      }
      EXPECT_TRUE(found) << z.name;
    }
  }
}

TEST(DcpWriter, DtypesTorchCannotStoreAreRefusedNamingTheTensor) {
  testing::TempDir tmp;
  auto dir = Directory::Open(tmp.path(), /*confine=*/true);
  ASSERT_TRUE(dir.ok());
  uint16_t v = 1;
  auto w = WriteDcpDataFile(*dir, "x.distcp", {{"u16", DType::kU16, {1}, &v, 2, false}});
  ASSERT_FALSE(w.ok());
  EXPECT_EQ(w.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(w.status().message().find("'u16'"), std::string::npos) << w.status();
  EXPECT_NE(w.status().message().find("U16"), std::string::npos) << w.status();
  // A size that does not match the shape.
  auto bad = WriteDcpDataFile(*dir, "y.distcp", {{"f", DType::kF32, {2}, &v, 2, false}});
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("'f'"), std::string::npos) << bad.status();
  // Nothing is left behind under either name.
  EXPECT_FALSE((*dir)->Exists("x.distcp").value_or(true));
  EXPECT_FALSE((*dir)->Exists("y.distcp").value_or(true));
}

TEST(DcpWriter, StridesThatWouldOverflowAreRefused) {
  // Empty (a 0 dimension), so CheckedNumBytes accepts it; its strides do not fit.
  auto p = TorchTensorPickle(DType::kF32, {0, int64_t{1} << 62, int64_t{1} << 62});
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.status().message().find("overflow"), std::string::npos) << p.status();
}

TEST(DcpWriter, LargeIntsInThePickleUseLongs) {
  // Sizes past 2^31 elements need LONG1 in data.pkl (no data is written).
  auto p = TorchTensorPickle(DType::kU8, {int64_t{3} << 31});
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_NE(p->find(std::string("\x8a\x08", 2)), std::string::npos);
}

}  // namespace
}  // namespace ckpt

// Fuzz target: the safe pickle machine (core/format/pickle.h) and what reads its
// documents, on every path a pickle reaches ckptd by:
//  1. a pickled `{uid}.metadata` (Paddle flex_checkpoint or PyTorch DCP):
//     OpenPickledCheckpoint, which parses with the metadata allow-list,
//     converts (PaddleMetadataToModel + LocatePaddleData, or
//     TorchDcpToModel) and validates. Data files are opened in a scratch
//     directory that holds a few real small data files (pickle_data_files.inc,
//     written by make_corpus.py: a two-rank DCP checkpoint saved with
//     single_file_per_rank, and Paddle data files), so seeds that name them
//     convert all the way;
//  2. a Paddle data file (pickled numpy arrays, or safetensors):
//     ReadPaddleDataFile over the input held in memory;
//  3. torch.save's data.pkl: ParseBuffer with the tensor allow-list and
//     persistent ids, then every value described.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/format/checkpoint.h"
#include "core/io/file.h"
#include "core/format/foreign.h"
#include "core/format/paddle_format.h"
#include "core/format/pickle.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

struct EmbeddedFile {
  const char* name;
  const char* data;
  unsigned size;
};
#include "tests/fuzz/pickle_data_files.inc"

// The checkpoint directory: the embedded data files, opened confined as the
// daemon opens checkpoints.
const ckpt::Directory& DataDir() {
  static const std::shared_ptr<const ckpt::Directory> dir = [] {
    const std::string path = ckptd_fuzz::ScratchDir() + "/ckpt";
    if (::mkdir(path.c_str(), 0700) != 0) std::abort();
    for (const EmbeddedFile& f : kEmbeddedFiles) {
      const std::string p = path + "/" + f.name;
      int fd = ::open(p.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
      if (fd < 0 || ::write(fd, f.data, f.size) != static_cast<ssize_t>(f.size)) std::abort();
      ::close(fd);
    }
    auto d = ckpt::Directory::Open(path, /*confine=*/true);
    if (!d.ok()) std::abort();
    return *d;
  }();
  return *dir;
}

// Walks a document as a consumer would: by schema, bounded (documents may be
// cyclic). Describe() must cope with every value.
void Touch(const ckpt::pickle::Document& doc) {
  (void)doc.Describe(doc.root);
  size_t budget = 4096;
  for (const ckpt::pickle::Seq& s : doc.seqs) {
    for (const ckpt::pickle::Value& v : s.items) {
      if (budget-- == 0) return;
      (void)doc.Describe(v);
    }
  }
  for (const ckpt::pickle::Object& o : doc.objects) {
    if (budget-- == 0) return;
    (void)doc.ClassName(o);
    (void)doc.Tag(o);
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  (void)DataDir();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string bytes = ckptd_fuzz::Str(data, size);
  const ckpt::Directory& dir = DataDir();

  // 1. Pickled checkpoint metadata.
  ckpt::Checkpoint c;
  c.dir = dir.path();
  c.confine = true;
  absl::Status opened = ckpt::OpenPickledCheckpoint(&c, dir, "0.metadata", bytes);
  ckptd_fuzz::Note("OpenPickledCheckpoint", opened);

  // 2. A Paddle data file.
  ckpt::MemoryFile file("0_0.distcp", bytes);
  auto index = ckpt::ReadPaddleDataFile(file);
  ckptd_fuzz::Note("ReadPaddleDataFile", index.status());
  if (index.ok()) {
    for (const auto& [key, arrays] : index->arrays) {
      for (const ckpt::PaddleArray& a : arrays) {
        FUZZ_CHECK(a.offset <= size && a.nbytes <= size - a.offset,
                   absl::StrCat("array '", key, "' at ", a.offset, " + ", a.nbytes,
                                " outside the ", size, "-byte file"));
      }
    }
  }

  // 3. torch.save's data.pkl.
  auto doc = ckpt::pickle::ParseBuffer("data.pkl", bytes, ckpt::TorchTensorPickleOptions());
  ckptd_fuzz::Note("ParseBuffer(data.pkl)", doc.status());
  if (doc.ok()) Touch(*doc);
  return 0;
}

// A safe pickle reader: a small pickle machine that never executes code.
//
// It runs the opcode subset that PaddlePaddle and PyTorch checkpoints use
// (protocols 2-5: frames, memo, tuples/lists/dicts, GLOBAL/STACK_GLOBAL,
// REDUCE/NEWOBJ/BUILD, and BINPERSID where the caller allows it) and turns
// the pickle into an inert value graph (Document). Globals are looked up in
// an allow-list given by the caller; each allowed global has a role that says
// what calling it produces (a record, a dict, a tuple, bytes, an enum member),
// so nothing named in a file is ever imported or called. Anything else
// (unknown opcodes, text opcodes, INST/OBJ/NEWOBJ_EX/EXT*, out-of-band
// buffers, globals not on the list such as builtins.eval or os.system) is a
// DATA_LOSS error naming the file, the byte offset and the opcode or global.
//
// Byte payloads (SHORT_BINBYTES, BINBYTES, BINBYTES8, BYTEARRAY8) are not
// copied: the machine records their absolute file offset and length and skips
// over them (small ones are also kept inline), so a multi-GB tensor pickled
// into a file costs a seek, not a copy. Strings are read (up to a limit).
//
// Limits (nesting depth, stack size, memo size, number of values, string
// length) keep hostile files from exhausting memory; cyclic graphs (a list
// appended to itself through the memo) are possible, so consumers walk
// documents by schema, never by unbounded recursion.
//
// Thread-compatible: a Document is immutable after parsing.
#ifndef CKPTD_CORE_PICKLE_H_
#define CKPTD_CORE_PICKLE_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/base/box.h"
#include "core/io/file.h"

namespace ckpt {
namespace pickle {

enum class Kind : uint8_t {
  kInvalid,  // an unset memo slot; never in a Document
  kNone,
  kBool,
  kInt,
  kFloat,
  kStr,
  kBytes,
  kTuple,
  kList,
  kDict,
  kGlobal,  // an allow-listed global referenced as a value (torch.float32)
  kObject,  // a record: class/function call, persistent id, enum member
};

// One value: scalars inline, everything else an index into a Document pool.
struct Value {
  Kind kind = Kind::kNone;
  uint32_t ref = 0;  // pool index (str, bytes, seq, global, object)
  int64_t i = 0;     // int, bool (0/1); float as its bit pattern
};

// What calling an allowed global produces. Nothing is ever executed: each role
// is an inert C++ handler.
enum class GlobalRole : uint8_t {
  kClass,         // NEWOBJ cls(*args) or REDUCE cls(*args) -> a record; BUILD sets its state
  kFunction,      // REDUCE f(*args) -> a record of the call; BUILD sets its state
  kConstant,      // referenced only (torch.float32); calling it is an error
  kOrderedDict,   // REDUCE () -> an empty dict (filled by SETITEMS)
  kTupleOfArg,    // REDUCE ((x, ...),) -> that tuple (torch.Size)
  kLatin1Encode,  // REDUCE (str, 'latin1') -> bytes (_codecs.encode, protocol 2 bytes)
  kEnumClass,     // an Enum class: REDUCE (value,) -> a record; target of kEnumGetattr
  kEnumGetattr,   // builtins.getattr(<kEnumClass>, name) -> an enum member record, nothing else
};

struct AllowedGlobal {
  std::string module;
  std::string name;
  GlobalRole role = GlobalRole::kClass;
  int tag = 0;  // caller's identifier
};

struct Limits {
  uint32_t max_depth = 512;           // nesting of containers and records
  uint64_t max_stack = 1ull << 24;    // values on the stack
  uint64_t max_marks = 1ull << 16;    // open MARKs
  // Memo slots; besides, a memo index must be below the number of bytes
  // read so far (a pickler numbers its memo 0, 1, 2, ... one stored value
  // at a time), so the memo never grows faster than the input.
  uint64_t max_memo = 1ull << 27;
  uint64_t max_values = 1ull << 28;   // strings, bytes, containers and records created
  uint64_t max_string = 64ull << 20;  // longer strings are located, not read
  uint64_t inline_bytes = 4096;       // byte payloads up to this size are also kept inline
};

struct Options {
  std::vector<AllowedGlobal> globals;
  bool allow_persistent_id = false;  // BINPERSID (torch.save's data.pkl only)
  Limits limits;
};

struct Str {
  uint64_t offset = 0;  // absolute file offset of the UTF-8 payload
  uint64_t length = 0;  // bytes of UTF-8
  bool loaded = false;  // false when longer than Limits::max_string
  std::string text;
};

struct Bytes {
  uint64_t offset = 0;  // absolute file offset of the payload
  uint64_t length = 0;
  bool bytearray = false;    // BYTEARRAY8 (protocol 5 in-band buffer)
  // The bytes are the latin-1 encoding of a str (protocol 2's
  // _codecs.encode(str, 'latin1')): the payload in the file is that str's
  // UTF-8 text, so (offset, length) locate UTF-8, not the raw bytes.
  bool latin1_text = false;
  bool has_inline = false;   // `inline_data` holds the (decoded) bytes
  std::string inline_data;
};

struct Seq {
  Kind kind = Kind::kTuple;   // kTuple, kList or kDict
  std::vector<Value> items;   // a dict holds key, value, key, value, ...
  uint32_t depth = 1;
};

struct Object {
  enum class How : uint8_t { kNewObj, kReduce, kPersistentId, kEnumMember };
  How how = How::kReduce;
  int32_t global = -1;  // index into Document::globals; -1 for a persistent id
  Value args;           // a tuple (the persistent id itself for kPersistentId)
  bool has_state = false;
  Value state;          // what BUILD gave
  uint32_t depth = 1;
};

class Document {
 public:
  std::string path;  // for errors
  int protocol = 0;
  Value root;
  std::vector<AllowedGlobal> globals;
  std::vector<Str> strs;
  std::vector<Bytes> bytes;
  std::vector<Seq> seqs;
  std::vector<Object> objects;

  // Typed access; errors are DATA_LOSS naming the file and `what`.
  absl::StatusOr<int64_t> Int(const Value& v, absl::string_view what) const;
  absl::StatusOr<bool> Bool(const Value& v, absl::string_view what) const;
  absl::StatusOr<const std::string*> Text(const Value& v, absl::string_view what) const;
  // Items of a tuple or list.
  absl::StatusOr<const std::vector<Value>*> Items(const Value& v, absl::string_view what) const;
  // Key, value pairs of a dict.
  absl::StatusOr<const std::vector<Value>*> DictItems(const Value& v,
                                                      absl::string_view what) const;
  absl::StatusOr<const Object*> Obj(const Value& v, absl::string_view what) const;
  // A tuple/list of ints.
  absl::StatusOr<Shape> IntList(const Value& v, absl::string_view what) const;

  // The allow-list tag of the object's class/function, or -1.
  int Tag(const Object& o) const;
  int GlobalTag(const Value& v) const;  // for kGlobal values; -1 otherwise
  // "module.name" of the object's class/function ("persistent id" for those).
  std::string ClassName(const Object& o) const;
  // For records whose BUILD state is a dict of str keys (dataclasses): the
  // value of `field`, last one wins like a Python dict; nullopt if absent.
  std::optional<Value> Field(const Object& o, absl::string_view field) const;
  // For a dict with str keys: the value of `key` (last wins); nullopt if absent.
  std::optional<Value> DictGet(const Value& dict, absl::string_view key) const;

  // A short description for errors: "int 3", "str 'x'", "tuple of 2", ...
  std::string Describe(const Value& v) const;
  absl::Status Error(absl::string_view what) const;  // DATA_LOSS "path: what"
};

// Parses the pickle in bytes [begin, end) of `file` (end: the pickle may be
// followed by other data; nothing is read at or past `end`).
absl::StatusOr<Document> Parse(const RandomAccessFile& file, uint64_t begin, uint64_t end,
                               const Options& options);

// Parses a pickle held in memory; offsets are relative to `data`.
absl::StatusOr<Document> ParseBuffer(const std::string& path, absl::string_view data,
                                     const Options& options);

// Name of a pickle opcode ("BINGET"), or "" when unknown.
absl::string_view OpcodeName(uint8_t op);

}  // namespace pickle
}  // namespace ckpt

#endif  // CKPTD_CORE_PICKLE_H_

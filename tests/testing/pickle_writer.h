// Test helper: writes pickle opcodes by hand, with optional protocol-4
// framing done like Python's framer (frames of about 64 KiB cut at opcode
// boundaries; an opcode carrying a payload of 64 KiB or more goes outside
// any frame).
//
//   PickleWriter w(4);
//   w.Global("m", "C").Memoize().EmptyTuple().NewObj().EmptyDict().Build().Stop();
//   std::string bytes = w.Finish(/*frames=*/true);
#ifndef CKPTD_TESTS_TESTING_PICKLE_WRITER_H_
#define CKPTD_TESTS_TESTING_PICKLE_WRITER_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace ckpt::testing {

class PickleWriter {
 public:
  explicit PickleWriter(int protocol = 4) {
    if (protocol >= 2) {
      head_.push_back(static_cast<char>(0x80));
      head_.push_back(static_cast<char>(protocol));
    }
  }

  PickleWriter& Op(uint8_t op) {
    Begin();
    Put8(op);
    return *this;
  }
  PickleWriter& Raw(std::string_view s) {
    Begin();
    cur().append(s);
    return *this;
  }
  PickleWriter& Str(std::string_view s) {
    Begin();
    if (s.size() < 256) {
      Put8(0x8c);
      Put8(static_cast<uint8_t>(s.size()));
    } else {
      Put8('X');
      PutLE(s.size(), 4);
    }
    cur().append(s);
    return *this;
  }
  PickleWriter& Int(int64_t v) {
    Begin();
    if (v >= 0 && v < 256) {
      Put8('K');
      Put8(static_cast<uint8_t>(v));
    } else if (v >= 0 && v < 65536) {
      Put8('M');
      PutLE(static_cast<uint64_t>(v), 2);
    } else if (v >= INT32_MIN && v <= INT32_MAX) {
      Put8('J');
      PutLE(static_cast<uint32_t>(static_cast<int32_t>(v)), 4);
    } else {
      Put8(0x8a);
      Put8(8);
      PutLE(static_cast<uint64_t>(v), 8);
    }
    return *this;
  }
  PickleWriter& Global(std::string_view module, std::string_view name) {
    Str(module);
    Str(name);
    return Op(0x93);
  }
  PickleWriter& GlobalText(std::string_view module, std::string_view name) {
    Begin();
    Put8('c');
    cur().append(module);
    cur().push_back('\n');
    cur().append(name);
    cur().push_back('\n');
    return *this;
  }
  PickleWriter& Memoize() { return Op(0x94); }
  PickleWriter& Get(uint32_t idx) {
    Begin();
    if (idx < 256) {
      Put8('h');
      Put8(static_cast<uint8_t>(idx));
    } else {
      Put8('j');
      PutLE(idx, 4);
    }
    return *this;
  }
  PickleWriter& PutMemo(uint32_t idx) {
    Begin();
    if (idx < 256) {
      Put8('q');
      Put8(static_cast<uint8_t>(idx));
    } else {
      Put8('r');
      PutLE(idx, 4);
    }
    return *this;
  }
  PickleWriter& Bytes(std::string_view data) {
    Begin();
    if (data.size() < 256) {
      Put8('C');
      Put8(static_cast<uint8_t>(data.size()));
    } else if (data.size() <= UINT32_MAX) {
      Put8('B');
      PutLE(data.size(), 4);
    }
    cur().append(data);
    return *this;
  }
  PickleWriter& Bytes8(std::string_view data, uint8_t op = 0x8e) {  // 0x96: BYTEARRAY8
    Begin();
    Put8(op);
    PutLE(data.size(), 8);
    cur().append(data);
    return *this;
  }
  PickleWriter& Mark() { return Op('('); }
  PickleWriter& Tuple() { return Op('t'); }  // after Mark()
  PickleWriter& Tuple(int n) { return Op(n == 0 ? ')' : static_cast<uint8_t>(0x84 + n)); }
  PickleWriter& EmptyTuple() { return Op(')'); }
  PickleWriter& EmptyList() { return Op(']'); }
  PickleWriter& EmptyDict() { return Op('}'); }
  PickleWriter& Append() { return Op('a'); }
  PickleWriter& Appends() { return Op('e'); }
  PickleWriter& SetItem() { return Op('s'); }
  PickleWriter& SetItems() { return Op('u'); }
  PickleWriter& NewObj() { return Op(0x81); }
  PickleWriter& Reduce() { return Op('R'); }
  PickleWriter& Build() { return Op('b'); }
  PickleWriter& None() { return Op('N'); }
  PickleWriter& Bool(bool b) { return Op(b ? 0x88 : 0x89); }
  PickleWriter& Stop() { return Op('.'); }

  std::string Finish(bool frames = false) const {
    std::string out = head_;
    if (!frames) return out + buf_;
    std::string frame;
    auto flush = [&] {
      if (frame.empty()) return;
      out.push_back(static_cast<char>(0x95));
      for (int i = 0; i < 8; ++i) {
        out.push_back(static_cast<char>((frame.size() >> (8 * i)) & 0xff));
      }
      out += frame;
      frame.clear();
    };
    for (size_t i = 0; i < starts_.size(); ++i) {
      const size_t end = i + 1 < starts_.size() ? starts_[i + 1] : buf_.size();
      std::string_view op(buf_.data() + starts_[i], end - starts_[i]);
      if (op.size() >= (64u << 10)) {
        flush();
        out += op;
        continue;
      }
      frame += op;
      if (frame.size() >= (64u << 10)) flush();
    }
    flush();
    return out;
  }

 private:
  void Begin() { starts_.push_back(buf_.size()); }
  std::string& cur() { return buf_; }
  void Put8(uint8_t v) { cur().push_back(static_cast<char>(v)); }
  void PutLE(uint64_t v, int n) {
    for (int i = 0; i < n; ++i) cur().push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  }

  std::string head_;
  std::string buf_;
  std::vector<size_t> starts_;  // where each opcode begins in buf_
};

}  // namespace ckpt::testing

#endif  // CKPTD_TESTS_TESTING_PICKLE_WRITER_H_

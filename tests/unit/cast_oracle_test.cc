// ConvertElements for every floating cast pair (F64, F32, F16, BF16) against
// a reference that shares no code with core/base/dtype.cc: a code's value is
// computed from its fields with ldexp, and the correctly rounded code of a
// value is found by binary search over the target's codes (finite codes of
// an IEEE format increase with their value), ties to the even code,
// overflow to infinity at max + ulp/2. F32 targets use the hardware's
// double -> float conversion (IEEE round to nearest even) as the reference.
// Inputs: every 16-bit code of the 16-bit sources; for F32 and F64 sources
// the specials, the target's boundaries, exact ties between consecutive
// target codes and their neighbours one source ulp away (the inputs that
// catch double rounding), and random bit patterns.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "core/base/dtype.h"
#include "gtest/gtest.h"

namespace ckpt {
namespace {

struct Format {
  int exp_bits;
  int man_bits;
};
constexpr Format kHalf{5, 10};
constexpr Format kBF16{8, 7};

int Bias(Format f) { return (1 << (f.exp_bits - 1)) - 1; }
uint32_t ExpMask(Format f) { return ((1u << f.exp_bits) - 1) << f.man_bits; }
uint32_t SignBit(Format f) { return 1u << (f.exp_bits + f.man_bits); }
uint32_t MaxFinite(Format f) { return ExpMask(f) - 1; }  // exponent all ones minus one, mantissa all ones

// The value of a 16-bit code, from its fields.
double Value(Format f, uint32_t code) {
  const bool neg = (code & SignBit(f)) != 0;
  const uint32_t e = (code & ExpMask(f)) >> f.man_bits;
  const uint32_t m = code & ((1u << f.man_bits) - 1);
  double v;
  if (e == (1u << f.exp_bits) - 1) {
    v = m == 0 ? std::numeric_limits<double>::infinity() : std::numeric_limits<double>::quiet_NaN();
  } else if (e == 0) {
    v = std::ldexp(static_cast<double>(m), 1 - Bias(f) - f.man_bits);
  } else {
    v = std::ldexp(static_cast<double>((1u << f.man_bits) + m),
                   static_cast<int>(e) - Bias(f) - f.man_bits);
  }
  return neg ? -v : v;
}

// The correctly rounded code of `x` (round to nearest, ties to even).
uint32_t Encode(Format f, double x) {
  if (std::isnan(x)) return ExpMask(f) | (1u << (f.man_bits - 1));
  const uint32_t sign = std::signbit(x) ? SignBit(f) : 0;
  const double a = std::fabs(x);
  const uint32_t max = MaxFinite(f);
  const double vmax = Value(f, max);
  if (a >= vmax + (vmax - Value(f, max - 1)) / 2) return sign | ExpMask(f);
  // Largest code c with Value(c) <= a.
  uint32_t lo = 0, hi = max;
  while (lo < hi) {
    const uint32_t mid = (lo + hi + 1) / 2;
    if (Value(f, mid) <= a) lo = mid; else hi = mid - 1;
  }
  uint32_t c = lo;
  if (c < max) {
    const double below = a - Value(f, c), above = Value(f, c + 1) - a;
    if (above < below || (above == below && (c & 1) != 0)) c = c + 1;
  }
  return sign | c;
}

double Load(DType t, const uint8_t* p) {
  switch (t) {
    case DType::kF64: { double v; std::memcpy(&v, p, 8); return v; }
    case DType::kF32: { float v; std::memcpy(&v, p, 4); return v; }
    case DType::kF16: { uint16_t v; std::memcpy(&v, p, 2); return Value(kHalf, v); }
    default: { uint16_t v; std::memcpy(&v, p, 2); return Value(kBF16, v); }
  }
}

// Reference bytes of `x` (exact in double) in type `t`.
std::vector<uint8_t> Want(DType t, double x) {
  std::vector<uint8_t> out(DTypeSize(t));
  switch (t) {
    case DType::kF64: std::memcpy(out.data(), &x, 8); break;
    case DType::kF32: { const float v = static_cast<float>(x); std::memcpy(out.data(), &v, 4); break; }
    case DType::kF16: { const uint16_t v = static_cast<uint16_t>(Encode(kHalf, x)); std::memcpy(out.data(), &v, 2); break; }
    default: { const uint16_t v = static_cast<uint16_t>(Encode(kBF16, x)); std::memcpy(out.data(), &v, 2); break; }
  }
  return out;
}

std::string Hex(const std::vector<uint8_t>& b) {
  std::string s;
  char buf[3];
  for (size_t i = b.size(); i-- > 0;) {
    std::snprintf(buf, sizeof(buf), "%02x", b[i]);
    s += buf;
  }
  return s;
}

// Source values as bytes of type `from`.
std::vector<std::vector<uint8_t>> Inputs(DType from) {
  std::vector<std::vector<uint8_t>> in;
  auto add_double = [&](double v) {
    std::vector<uint8_t> b(DTypeSize(from));
    if (from == DType::kF64) {
      std::memcpy(b.data(), &v, 8);
    } else {
      const float f = static_cast<float>(v);
      std::memcpy(b.data(), &f, 4);
    }
    in.push_back(std::move(b));
  };
  if (from == DType::kF16 || from == DType::kBF16) {
    for (uint32_t c = 0; c < 0x10000; ++c) {
      const uint16_t v = static_cast<uint16_t>(c);
      std::vector<uint8_t> b(2);
      std::memcpy(b.data(), &v, 2);
      in.push_back(std::move(b));
    }
    return in;
  }
  const double inf = std::numeric_limits<double>::infinity();
  for (double v : {0.0, -0.0, inf, -inf, std::numeric_limits<double>::quiet_NaN(), 1.0, -1.0,
                   1e-300, 1e300, -1e300, 3.4028234663852886e38, 3.5e38,
                   static_cast<double>(std::numeric_limits<float>::denorm_min()),
                   static_cast<double>(std::numeric_limits<float>::min())}) {
    add_double(v);
  }
  // Exact ties between consecutive codes of each 16-bit format, and the
  // values one source ulp on either side.
  std::mt19937_64 rng(5);
  for (Format f : {kHalf, kBF16}) {
    std::vector<uint32_t> codes;
    for (uint32_t c = 0; c < 64; ++c) codes.push_back(c);                    // subnormals
    for (uint32_t c = MaxFinite(f) - 64; c <= MaxFinite(f); ++c) codes.push_back(c);
    for (int i = 0; i < 4000; ++i) codes.push_back(static_cast<uint32_t>(rng() % MaxFinite(f)));
    for (uint32_t c : codes) {
      const double lo = Value(f, c);
      const double hi = c < MaxFinite(f) ? Value(f, c + 1) : lo + (lo - Value(f, c - 1));
      const double tie = (lo + hi) / 2;
      for (double s : {1.0, -1.0}) {
        add_double(s * tie);
        if (from == DType::kF64) {
          add_double(s * std::nextafter(tie, inf));
          add_double(s * std::nextafter(tie, 0.0));
          // Above the tie by less than half an F32 ulp: rounds to the tie in
          // F32, so a conversion through float rounds twice.
          add_double(s * (tie + std::ldexp(tie, -40)));
          add_double(s * (tie - std::ldexp(tie, -40)));
        } else {
          add_double(s * static_cast<double>(std::nextafter(static_cast<float>(tie), INFINITY)));
          add_double(s * static_cast<double>(std::nextafter(static_cast<float>(tie), 0.f)));
        }
      }
    }
  }
  for (int i = 0; i < 200000; ++i) {
    std::vector<uint8_t> b(DTypeSize(from));
    const uint64_t r = rng();
    std::memcpy(b.data(), &r, b.size());
    in.push_back(std::move(b));
  }
  return in;
}

class CastOracle : public ::testing::TestWithParam<std::pair<DType, DType>> {};

TEST_P(CastOracle, EveryInputMatchesTheReference) {
  const auto [from, to] = GetParam();
  ASSERT_TRUE(CanConvert(from, to));
  const auto inputs = Inputs(from);
  std::vector<uint8_t> src;
  for (const auto& b : inputs) src.insert(src.end(), b.begin(), b.end());
  std::vector<uint8_t> dst(inputs.size() * DTypeSize(to), 0xA5);
  ConvertElements(src.data(), from, dst.data(), to, inputs.size());
  int bad = 0;
  for (size_t i = 0; i < inputs.size() && bad < 10; ++i) {
    const double x = Load(from, inputs[i].data());
    const std::vector<uint8_t> got(dst.begin() + i * DTypeSize(to),
                                   dst.begin() + (i + 1) * DTypeSize(to));
    if (std::isnan(x)) {
      EXPECT_TRUE(std::isnan(Load(to, got.data()))) << "NaN input " << Hex(inputs[i]) << " -> "
                                                     << Hex(got);
      continue;
    }
    const std::vector<uint8_t> want = Want(to, x);
    if (got != want) {
      ++bad;
      ADD_FAILURE() << DTypeName(from) << " " << Hex(inputs[i]) << " (" << std::hexfloat << x
                    << ") -> " << DTypeName(to) << ": got " << Hex(got) << ", want "
                    << Hex(want);
    }
  }
}

std::vector<std::pair<DType, DType>> Pairs() {
  const DType floats[] = {DType::kF64, DType::kF32, DType::kF16, DType::kBF16};
  std::vector<std::pair<DType, DType>> out;
  for (DType a : floats) {
    for (DType b : floats) {
      if (a != b) out.emplace_back(a, b);
    }
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(AllFloatPairs, CastOracle, ::testing::ValuesIn(Pairs()),
                         [](const auto& info) {
                           return std::string(DTypeName(info.param.first)) + "_to_" +
                                  std::string(DTypeName(info.param.second));
                         });

// The BF16 -> F32 fast path (8 at a time, then one by one) for every count
// up to 40 and every alignment of both buffers: each F32 is its BF16 in the
// top half, exactly, and nothing past `count` is written.
TEST(CastFastPath, Bf16ToF32EveryCountAndAlignment) {
  std::mt19937 rng(7);
  for (size_t count = 0; count <= 40; ++count) {
    for (size_t src_off = 0; src_off < 4; ++src_off) {
      for (size_t dst_off = 0; dst_off < 4; ++dst_off) {
        std::vector<uint8_t> src(2 * count + src_off), dst(4 * count + dst_off + 8, 0xAB);
        for (auto& b : src) b = static_cast<uint8_t>(rng());
        ConvertElements(src.data() + src_off, DType::kBF16, dst.data() + dst_off, DType::kF32,
                        count);
        for (size_t i = 0; i < count; ++i) {
          uint16_t h;
          uint32_t f;
          std::memcpy(&h, src.data() + src_off + 2 * i, 2);
          std::memcpy(&f, dst.data() + dst_off + 4 * i, 4);
          ASSERT_EQ(f, static_cast<uint32_t>(h) << 16) << "count " << count << " element " << i;
        }
        for (size_t k = 0; k < dst_off; ++k) ASSERT_EQ(dst[k], 0xAB);
        for (size_t k = dst_off + 4 * count; k < dst.size(); ++k) ASSERT_EQ(dst[k], 0xAB);
      }
    }
  }
}

}  // namespace
}  // namespace ckpt

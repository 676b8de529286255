#include "core/base/dtype.h"

#if defined(__x86_64__) || defined(__SSE2__)
#include <emmintrin.h>
#endif

#include <cmath>
#include <cstring>
#include <limits>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace ckpt {
namespace {

struct DTypeInfo {
  DType dtype;
  absl::string_view name;
  size_t size;
};

constexpr DTypeInfo kInfos[] = {
    {DType::kF64, "F64", 8},       {DType::kF32, "F32", 4},
    {DType::kF16, "F16", 2},       {DType::kBF16, "BF16", 2},
    {DType::kF8E4M3, "F8_E4M3", 1}, {DType::kF8E5M2, "F8_E5M2", 1},
    {DType::kI64, "I64", 8},       {DType::kI32, "I32", 4},
    {DType::kI16, "I16", 2},       {DType::kI8, "I8", 1},
    {DType::kU64, "U64", 8},       {DType::kU32, "U32", 4},
    {DType::kU16, "U16", 2},       {DType::kU8, "U8", 1},
    {DType::kBool, "BOOL", 1},
};

// Aliases used by Paddle, numpy and torch metadata, lower-case.
struct Alias {
  absl::string_view name;
  DType dtype;
};
constexpr Alias kAliases[] = {
    {"float64", DType::kF64},   {"double", DType::kF64},    {"fp64", DType::kF64},
    {"float32", DType::kF32},   {"float", DType::kF32},     {"fp32", DType::kF32},
    {"float16", DType::kF16},   {"half", DType::kF16},      {"fp16", DType::kF16},
    {"bfloat16", DType::kBF16}, {"bf16", DType::kBF16},
    {"float8_e4m3fn", DType::kF8E4M3}, {"float8_e4m3", DType::kF8E4M3},
    {"float8_e5m2", DType::kF8E5M2},
    {"int64", DType::kI64},     {"long", DType::kI64},
    {"int32", DType::kI32},     {"int", DType::kI32},
    {"int16", DType::kI16},     {"short", DType::kI16},
    {"int8", DType::kI8},
    {"uint64", DType::kU64},    {"uint32", DType::kU32},
    {"uint16", DType::kU16},    {"uint8", DType::kU8},
    {"bool", DType::kBool},
};

const DTypeInfo& Info(DType d) { return kInfos[static_cast<int>(d)]; }

bool IsFloat(DType d) {
  return d == DType::kF64 || d == DType::kF32 || d == DType::kF16 || d == DType::kBF16;
}
bool IsSigned(DType d) {
  return d == DType::kI64 || d == DType::kI32 || d == DType::kI16 || d == DType::kI8;
}
bool IsUnsigned(DType d) {
  return d == DType::kU64 || d == DType::kU32 || d == DType::kU16 || d == DType::kU8;
}

double LoadFloat(const uint8_t* p, DType d) {
  switch (d) {
    case DType::kF64: { double v; std::memcpy(&v, p, 8); return v; }
    case DType::kF32: { float v; std::memcpy(&v, p, 4); return v; }
    case DType::kF16: { uint16_t v; std::memcpy(&v, p, 2); return F16ToFloat(v); }
    case DType::kBF16: { uint16_t v; std::memcpy(&v, p, 2); return BF16ToFloat(v); }
    default: return 0;
  }
}

// `x` as a float rounded to odd: truncated toward zero, with the last
// mantissa bit set when that lost anything. Rounding this float to a format
// with at least two fewer mantissa bits (F16: 10, BF16: 7, against 23) gives
// the correctly rounded result of `x` itself; rounding x to float to nearest
// first would round twice (a double just above a half-way point between two
// F16 values can land exactly on it in float, and the tie then goes to even).
float RoundToOddFloat(double x) {
  if (std::isnan(x)) return static_cast<float>(x);
  constexpr double kMax = std::numeric_limits<float>::max();
  if (std::fabs(x) > kMax) {
    if (std::isinf(x)) return static_cast<float>(x);
    return static_cast<float>(std::copysign(kMax, x));  // odd mantissa: rounds up past max
  }
  float f = static_cast<float>(x);
  if (static_cast<double>(f) == x) return f;
  if (std::fabs(static_cast<double>(f)) > std::fabs(x)) f = std::nextafter(f, 0.0f);
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  bits |= 1u;
  std::memcpy(&f, &bits, 4);
  return f;
}

void StoreFloat(uint8_t* p, DType d, double x) {
  switch (d) {
    case DType::kF64: std::memcpy(p, &x, 8); break;
    case DType::kF32: { float v = static_cast<float>(x); std::memcpy(p, &v, 4); break; }
    case DType::kF16: { uint16_t v = FloatToF16(RoundToOddFloat(x)); std::memcpy(p, &v, 2); break; }
    case DType::kBF16: { uint16_t v = FloatToBF16(RoundToOddFloat(x)); std::memcpy(p, &v, 2); break; }
    default: break;
  }
}

int64_t LoadSigned(const uint8_t* p, DType d) {
  switch (d) {
    case DType::kI64: { int64_t v; std::memcpy(&v, p, 8); return v; }
    case DType::kI32: { int32_t v; std::memcpy(&v, p, 4); return v; }
    case DType::kI16: { int16_t v; std::memcpy(&v, p, 2); return v; }
    case DType::kI8: { int8_t v; std::memcpy(&v, p, 1); return v; }
    case DType::kU64: { uint64_t v; std::memcpy(&v, p, 8); return static_cast<int64_t>(v); }
    case DType::kU32: { uint32_t v; std::memcpy(&v, p, 4); return v; }
    case DType::kU16: { uint16_t v; std::memcpy(&v, p, 2); return v; }
    case DType::kU8: return *p;
    case DType::kBool: return *p != 0;
    default: return 0;
  }
}

void StoreInt(uint8_t* p, DType d, int64_t x) {
  switch (d) {
    case DType::kI64: case DType::kU64: std::memcpy(p, &x, 8); break;
    case DType::kI32: case DType::kU32: { int32_t v = static_cast<int32_t>(x); std::memcpy(p, &v, 4); break; }
    case DType::kI16: case DType::kU16: { int16_t v = static_cast<int16_t>(x); std::memcpy(p, &v, 2); break; }
    default: *p = static_cast<uint8_t>(x); break;
  }
}

}  // namespace

size_t DTypeSize(DType dtype) { return Info(dtype).size; }

absl::string_view DTypeName(DType dtype) { return Info(dtype).name; }

absl::StatusOr<DType> ParseDType(absl::string_view name) {
  for (const DTypeInfo& info : kInfos) {
    if (info.name == name) return info.dtype;
  }
  std::string lower = absl::AsciiStrToLower(name);
  absl::string_view l = lower;
  // Accept "paddle.float32", "torch.bfloat16", "numpy.float32".
  size_t dot = l.rfind('.');
  if (dot != absl::string_view::npos) l = l.substr(dot + 1);
  for (const Alias& a : kAliases) {
    if (a.name == l) return a.dtype;
  }
  for (const DTypeInfo& info : kInfos) {
    if (absl::AsciiStrToLower(info.name) == l) return info.dtype;
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown dtype '", name, "'"));
}

bool CanConvert(DType from, DType to) {
  if (from == to) return true;
  if (IsFloat(from) && IsFloat(to)) return true;
  size_t fs = DTypeSize(from), ts = DTypeSize(to);
  if (from == DType::kBool) return IsSigned(to) || IsUnsigned(to);
  if (IsSigned(from)) return IsSigned(to) && ts > fs;
  if (IsUnsigned(from)) return (IsUnsigned(to) && ts > fs) || (IsSigned(to) && ts > fs);
  return false;
}

void ConvertElements(const void* src, DType from, void* dst, DType to, size_t count) {
  const uint8_t* s = static_cast<const uint8_t*>(src);
  uint8_t* d = static_cast<uint8_t*>(dst);
  if (from == to) {
    std::memcpy(d, s, count * DTypeSize(from));
    return;
  }
  // Hot cases: F32 <-> BF16/F16 without the double round trip.
  if (from == DType::kBF16 && to == DType::kF32) {
    size_t i = 0;
#if defined(__x86_64__) || defined(__SSE2__)
    // A BF16 is the top half of its F32: interleaving zeros below 8 of them
    // at a time widens them exactly (the scalar loop below does the rest).
    const __m128i zero = _mm_setzero_si128();
    for (; i + 8 <= count; i += 8) {
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 2 * i));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(d + 4 * i), _mm_unpacklo_epi16(zero, v));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(d + 4 * i + 16), _mm_unpackhi_epi16(zero, v));
    }
#endif
    for (; i < count; ++i) {
      uint16_t v;
      std::memcpy(&v, s + 2 * i, 2);
      uint32_t bits = static_cast<uint32_t>(v) << 16;
      std::memcpy(d + 4 * i, &bits, 4);
    }
    return;
  }
  if (from == DType::kF32 && to == DType::kBF16) {
    for (size_t i = 0; i < count; ++i) {
      float v;
      std::memcpy(&v, s + 4 * i, 4);
      uint16_t b = FloatToBF16(v);
      std::memcpy(d + 2 * i, &b, 2);
    }
    return;
  }
  const size_t fs = DTypeSize(from), ts = DTypeSize(to);
  if (IsFloat(from)) {
    for (size_t i = 0; i < count; ++i) StoreFloat(d + ts * i, to, LoadFloat(s + fs * i, from));
  } else {
    for (size_t i = 0; i < count; ++i) StoreInt(d + ts * i, to, LoadSigned(s + fs * i, from));
  }
}

float BF16ToFloat(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t FloatToBF16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7f800000u) == 0x7f800000u && (bits & 0x007fffffu) != 0) {
    return static_cast<uint16_t>((bits >> 16) | 0x40);  // quiet NaN
  }
  uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

float F16ToFloat(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do {
        ++e;
        mant <<= 1;
      } while ((mant & 0x400u) == 0);
      mant &= 0x3ffu;
      bits = sign | (static_cast<uint32_t>(127 - 15 - e) << 23) | (mant << 13);
    }
  } else if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t FloatToF16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  uint32_t abs = bits & 0x7fffffffu;
  if (abs >= 0x7f800000u) {  // inf or NaN
    return sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u : 0);
  }
  if (abs >= 0x477ff000u) return sign | 0x7c00u;  // rounds to >= 65520: inf
  if (abs < 0x38800000u) {                         // below the smallest normal half
    if (abs < 0x33000000u) return sign;             // rounds to zero
    uint32_t exp = abs >> 23;
    uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126 - exp;  // 14 + (113 - exp) ... bits to drop for subnormal
    uint32_t half = mant >> shift;
    uint32_t rem = mant & ((1u << shift) - 1);
    uint32_t mid = 1u << (shift - 1);
    if (rem > mid || (rem == mid && (half & 1u))) ++half;
    return sign | static_cast<uint16_t>(half);
  }
  uint32_t rounded = abs + 0xfffu + ((abs >> 13) & 1u);
  return sign | static_cast<uint16_t>((rounded - 0x38000000u) >> 13);
}

}  // namespace ckpt

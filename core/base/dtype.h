// Element types of checkpoint tensors.
//
// Names follow safetensors ("F32", "BF16", ...). Paddle/numpy style names
// ("float32", "bfloat16", "int64", "bool", ...) are accepted on input, so
// metadata written by other frameworks parses. Thread-safe: pure functions.
#ifndef CKPTD_CORE_DTYPE_H_
#define CKPTD_CORE_DTYPE_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace ckpt {

enum class DType : uint8_t {
  kF64,
  kF32,
  kF16,
  kBF16,
  kF8E4M3,
  kF8E5M2,
  kI64,
  kI32,
  kI16,
  kI8,
  kU64,
  kU32,
  kU16,
  kU8,
  kBool,
};

// Size of one element in bytes.
size_t DTypeSize(DType dtype);

// Canonical safetensors name: "F32", "BF16", "F8_E4M3", "BOOL", ...
absl::string_view DTypeName(DType dtype);

// Parses a safetensors name or a Paddle/numpy/torch name ("float32", "fp32",
// "bfloat16", "float8_e4m3fn", "int64", "uint8", "bool", ...).
absl::StatusOr<DType> ParseDType(absl::string_view name);

// Whether ConvertElements() supports converting `from` into `to`. Identical
// types are always supported. Supported conversions: between floating types
// (F64, F32, F16, BF16), and widening of integers (signed into wider signed,
// unsigned into wider signed or unsigned, BOOL into any integer).
bool CanConvert(DType from, DType to);

// Converts `count` elements from `src` (type `from`) into `dst` (type `to`).
// Requires CanConvert(from, to). Floating narrowing rounds to nearest even.
void ConvertElements(const void* src, DType from, void* dst, DType to, size_t count);

// Half/bfloat16 helpers, exposed for tests.
float BF16ToFloat(uint16_t v);
uint16_t FloatToBF16(float f);
float F16ToFloat(uint16_t v);
uint16_t FloatToF16(float f);

}  // namespace ckpt

#endif  // CKPTD_CORE_DTYPE_H_

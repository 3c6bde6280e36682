// Fuzz targets of the public C++ entry points (CPU backend): each decodes a byte string into a
// call (shapes, dtypes, strides, values with NaN / inf / ties, invalid arguments mixed in), makes
// it, and checks either a clean error (a message, nothing written) or the result against the
// brute-force references of the tests and the documented invariants. A target returns "" or a
// description of what is wrong. fuzz_main.cpp drives them; they also fit LLVMFuzzerTestOneInput.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace sy_fuzz {

// Typed reads from the fuzzer's bytes; past the end every read is 0.
class Bytes {
 public:
  Bytes(const std::uint8_t* data, std::size_t size) : data_(data), size_(size) {}
  std::uint8_t u8() { return pos_ < size_ ? data_[pos_++] : 0; }
  std::uint32_t u32() {
    std::uint32_t v = 0;
    for (int i = 0; i < 4; ++i) v |= static_cast<std::uint32_t>(u8()) << (8 * i);
    return v;
  }
  std::uint64_t u64() { return static_cast<std::uint64_t>(u32()) | (static_cast<std::uint64_t>(u32()) << 32); }
  // A value in [0, n) (0 when n <= 0).
  int pick(int n) { return n > 0 ? static_cast<int>(u32() % static_cast<std::uint32_t>(n)) : 0; }
  bool chance(int one_in) { return pick(one_in) == 0; }
  float raw_f32() {
    const std::uint32_t bits = u32();
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  }

 private:
  const std::uint8_t* data_;
  std::size_t size_;
  std::size_t pos_ = 0;
};

struct Target {
  const char* name;
  std::string (*run)(const std::uint8_t* data, std::size_t size);
};

// Every target: route, layout, route_and_layout, gather, combine, ep.
const std::vector<Target>& targets();

}  // namespace sy_fuzz

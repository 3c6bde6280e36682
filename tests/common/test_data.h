// Shared test inputs: random logits, skewed expert ids, poison values. Header-only.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

namespace sy_test {

// Poison for int32 outputs: a value no correct output takes.
constexpr std::int32_t kPoisonI32 = 0x5a5a5a5a;
constexpr std::uint8_t kPoisonByte = 0xA5;

inline std::mt19937_64& rng() {
  static std::mt19937_64 gen(std::random_device{}());
  return gen;
}

// Seed for a test: fresh each run, printed on failure via SCOPED_TRACE by the caller.
inline std::uint64_t fresh_seed() { return rng()(); }

// A fresh seed each run, or SY_TEST_SEED from the environment to replay a failure.
inline std::uint64_t test_seed() {
  if (const char* env = std::getenv("SY_TEST_SEED")) return std::strtoull(env, nullptr, 10);
  return fresh_seed();
}

// The layout / permute sweep axes of the CPU tests (the GPU tests add larger T and E).
constexpr std::int64_t kSweepTokens[] = {0, 1, 3, 19, 111, 989, 4096};
constexpr int kSweepExperts[] = {8, 160, 256, 384, 512, 2048};
constexpr int kSweepTopK[] = {1, 2, 8, 10, 22, 32};
constexpr int kSweepTiles[] = {1, 7, 64, 128, 192};

inline std::vector<float> random_normal(std::size_t n, std::uint64_t seed, float stddev = 1.0f) {
  std::mt19937_64 g(seed);
  std::normal_distribution<float> d(0.0f, stddev);
  std::vector<float> v(n);
  for (float& x : v) x = d(g);
  return v;
}

// Logits with many exact ties: values drawn from a handful of levels.
inline std::vector<float> random_tied(std::size_t n, std::uint64_t seed, int levels = 4) {
  std::mt19937_64 g(seed);
  std::uniform_int_distribution<int> d(0, levels - 1);
  std::vector<float> v(n);
  for (float& x : v) x = 0.25f * static_cast<float>(d(g));
  return v;
}

// A flat-top row of E logits (in place, drawing from g): every logit lowered by 6, then 4-16 experts
// (random, possibly repeated) set to 2^-14 plus 0-8191 ulps. Distinct logits in different packed
// buckets whose softmax p nearly all round equal (exp(s - m) rounds to 1), so that the oracle ranks them
// by expert, not by logit: the staged softmax rows' p test (src/common/softmax_picks.h).
inline void flat_top_row(float* row, int E, std::mt19937_64& g) {
  for (int e = 0; e < E; ++e) row[e] -= 6.0f;
  const float base = 0x1p-14f;
  std::uint32_t u;
  std::memcpy(&u, &base, 4);
  const int m = 4 + static_cast<int>(g() % 13);
  for (int j = 0; j < m; ++j) {
    const std::uint32_t b = u + static_cast<std::uint32_t>(g() % 8192);
    std::memcpy(&row[g() % E], &b, 4);
  }
}

enum class Skew { kUniform, kZipf, kOneHot };
constexpr Skew kSkews[] = {Skew::kUniform, Skew::kZipf, Skew::kOneHot};

inline const char* skew_name(Skew s) {
  switch (s) {
    case Skew::kUniform:
      return "uniform";
    case Skew::kZipf:
      return "zipf";
    case Skew::kOneHot:
      return "onehot";
  }
  return "?";
}

// Expert ids [T,K] in [0,E): distinct within a row, drawn uniformly, Zipf(1.2)-weighted, or
// with every token on expert `hot` first (the rest distinct).
inline std::vector<std::int64_t> random_ids(std::int64_t T, int K, int E, Skew skew, std::uint64_t seed,
                                            int hot = 0) {
  std::mt19937_64 g(seed);
  std::vector<double> w(E, 1.0);
  if (skew == Skew::kZipf)
    for (int e = 0; e < E; ++e) w[e] = 1.0 / std::pow(static_cast<double>(e + 1), 1.2);
  std::vector<std::int64_t> ids(static_cast<std::size_t>(T) * K);
  std::vector<char> used(E);
  std::discrete_distribution<int> draw(w.begin(), w.end());
  for (std::int64_t t = 0; t < T; ++t) {
    std::fill(used.begin(), used.end(), 0);
    for (int k = 0; k < K; ++k) {
      int e;
      if (skew == Skew::kOneHot && k == 0) {
        e = hot;
      } else {
        do e = draw(g);
        while (used[e]);
      }
      used[e] = 1;
      ids[t * K + k] = e;
    }
  }
  return ids;
}

// The ids of random_ids (same distributions, other draws), O(log E) per pick: random_ids builds a
// distribution over E experts per pick, too slow for millions of picks.
inline std::vector<std::int64_t> fast_random_ids(std::int64_t T, int K, int E, Skew skew, std::uint64_t seed,
                                                 int hot = 0) {
  std::mt19937_64 g(seed);
  std::vector<double> cdf(E);
  double sum = 0;
  for (int e = 0; e < E; ++e) {
    sum += skew == Skew::kZipf ? 1.0 / std::pow(e + 1.0, 1.2) : 1.0;
    cdf[e] = sum;
  }
  std::uniform_real_distribution<double> u(0.0, sum);
  std::vector<std::int64_t> ids(static_cast<std::size_t>(T * K));
  std::vector<char> used(E, 0);
  for (std::int64_t t = 0; t < T; ++t) {
    for (int k = 0; k < K; ++k) {
      int e = hot;
      if (!(skew == Skew::kOneHot && k == 0)) {
        do {
          e = std::min<int>(E - 1,
                            static_cast<int>(std::upper_bound(cdf.begin(), cdf.end(), u(g)) - cdf.begin()));
        } while (used[e]);
      }
      used[e] = 1;
      ids[t * K + k] = e;
    }
    for (int k = 0; k < K; ++k) used[ids[t * K + k]] = 0;
  }
  return ids;
}

// Gives some tokens of ids [T,K] two picks of one expert (ids are data: nothing forbids that, and
// each pick is placed): in each token t >= first_token, kept with probability 1 / every, a drawn
// slot k in [1, K) repeats one of the token's slots before k.
inline void repeat_slots(std::vector<std::int64_t>& ids, std::int64_t T, int K, std::mt19937_64& g,
                         std::int64_t first_token, int every) {
  if (K < 2) return;
  for (std::int64_t t = std::max<std::int64_t>(first_token, 0); t < T; ++t) {
    if (every > 1 && g() % static_cast<std::uint64_t>(every) != 0) continue;
    const int k = 1 + static_cast<int>(g() % static_cast<std::uint64_t>(K - 1));
    ids[t * K + k] = ids[t * K + static_cast<int>(g() % static_cast<std::uint64_t>(k))];
  }
}

inline std::uint16_t bf16_bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>(u >> 16);
}
inline float bf16_value(std::uint16_t h) {
  std::uint32_t u = static_cast<std::uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

}  // namespace sy_test

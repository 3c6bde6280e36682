// Runs the fuzz targets (fuzz_targets.h): first every input of the committed corpus
// (tests/fuzz/corpus/<target>/*: inputs that once found a bug, kept as regression tests), then
// random byte strings for a bounded time, round robin over the targets. A failing input is
// written to <out-dir>/<target>-<n>.bin and the run exits 1.
//   fuzz_switchyard [--seconds S] [--target NAME] [--seed N] [--corpus DIR] [--out-dir DIR] [--cuda]
// --cuda: every call that succeeds on the CPU also runs on the CUDA backend and must give the same
// bytes (the differential run; the expert-parallel target runs its ranks on a loopback GpuGroup).
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "fuzz/fuzz_cuda.h"
#include "fuzz/fuzz_targets.h"

namespace fs = std::filesystem;

int main(int argc, char** argv) {
  double seconds = 10.0;
  std::string only, corpus, out_dir = ".";
  std::uint64_t seed = std::random_device{}();
  for (int a = 1; a < argc; ++a) {
    const std::string arg = argv[a];
    const bool has_value = a + 1 < argc;
    if (arg == "--seconds" && has_value) {
      seconds = std::atof(argv[++a]);
    } else if (arg == "--target" && has_value) {
      only = argv[++a];
    } else if (arg == "--seed" && has_value) {
      seed = std::strtoull(argv[++a], nullptr, 10);
    } else if (arg == "--corpus" && has_value) {
      corpus = argv[++a];
    } else if (arg == "--out-dir" && has_value) {
      out_dir = argv[++a];
    } else if (arg == "--cuda") {
      const std::string why = sy_fuzz::cuda_unavailable();
      if (!why.empty()) {
        std::fprintf(stderr, "fuzz_switchyard: --cuda, but %s\n", why.c_str());
        return 2;
      }
      sy_fuzz::cuda_enabled() = true;
    } else {
      std::fprintf(stderr, "fuzz_switchyard: unknown argument %s\n", arg.c_str());
      return 2;
    }
  }
  std::vector<sy_fuzz::Target> targets;
  for (const sy_fuzz::Target& t : sy_fuzz::targets()) {
    if (only.empty() || only == t.name) targets.push_back(t);
  }
  if (targets.empty()) {
    std::fprintf(stderr, "fuzz_switchyard: no target named %s\n", only.c_str());
    return 2;
  }
  int failures = 0;
  auto report = [&](const sy_fuzz::Target& t, const std::vector<std::uint8_t>& input, const std::string& what,
                    const std::string& origin) {
    const std::string path = out_dir + "/" + t.name + "-" + std::to_string(failures) + ".bin";
    std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(input.data()),
                                                static_cast<std::streamsize>(input.size()));
    std::printf("FAIL %s (%s, %zu bytes, saved as %s): %s\n", t.name, origin.c_str(), input.size(), path.c_str(),
                what.c_str());
    ++failures;
  };
  std::map<std::string, long> runs;
  for (const sy_fuzz::Target& t : targets) {
    const fs::path dir = fs::path(corpus) / t.name;
    if (corpus.empty() || !fs::is_directory(dir)) continue;
    for (const auto& entry : fs::directory_iterator(dir)) {
      std::ifstream f(entry.path(), std::ios::binary);
      const std::vector<std::uint8_t> input((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
      const std::string what = t.run(input.data(), input.size());
      ++runs[std::string(t.name) + " (corpus)"];
      if (!what.empty()) report(t, input, what, "corpus " + entry.path().filename().string());
    }
  }
  std::mt19937_64 g(seed);
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  std::vector<std::uint8_t> input;
  for (std::size_t i = 0; std::chrono::steady_clock::now() < end && failures < 5; ++i) {
    const sy_fuzz::Target& t = targets[i % targets.size()];
    input.resize(g() % 160);
    for (std::uint8_t& v : input) v = static_cast<std::uint8_t>(g());
    const std::string what = t.run(input.data(), input.size());
    ++runs[t.name];
    if (!what.empty()) report(t, input, what, "random");
  }
  std::printf("fuzz_switchyard%s: seed %llu, %.0f s:", sy_fuzz::cuda_enabled() ? " (CPU against CUDA)" : "",
              static_cast<unsigned long long>(seed), seconds);
  for (const auto& [name, n] : runs) std::printf(" %s %ld", name.c_str(), n);
  std::printf("; %d failing inputs\n", failures);
  return failures == 0 ? 0 : 1;
}

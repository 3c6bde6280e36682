// Benchmark of the permute stage: pending (see its issue).
#include <cstdio>
int main() { std::printf("bench_permute: not written yet\n"); return 1; }

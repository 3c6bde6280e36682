// Benchmark of the layout stage: pending (see its issue).
#include <cstdio>
int main() { std::printf("bench_layout: not written yet\n"); return 1; }

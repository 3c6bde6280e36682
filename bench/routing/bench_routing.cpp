// Benchmark of the routing stage: pending (see its issue).
#include <cstdio>
int main() { std::printf("bench_routing: not written yet\n"); return 1; }

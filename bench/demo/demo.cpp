#include <cstdio>
int main() { std::puts("demo: not written yet"); return 1; }

// SY_GIT_COMMIT: the commit stamped into benchmark output, from the header the build generates
// before every build of the benchmarks (bench/stamp_commit.cmake), or "unknown" without it.
#pragma once

#if __has_include("sy_git_commit.h")
#include "sy_git_commit.h"
#endif
#ifndef SY_GIT_COMMIT
#define SY_GIT_COMMIT "unknown"
#endif

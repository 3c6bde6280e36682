// A start gate for timing multi-stream work (bench/ep/gate.cu).
#pragma once

#include <cuda_runtime.h>

#include <string>

namespace sy_bench {

class Gate {
 public:
  Gate() = default;
  ~Gate();
  Gate(const Gate&) = delete;
  Gate& operator=(const Gate&) = delete;

  bool init(std::string* error);
  // Enqueues on `stream` a kernel that waits until open(*value) (at most timeout_seconds).
  bool close(cudaStream_t stream, double timeout_seconds, unsigned* value);
  // Lets the gate kernel waiting for `value` (and every earlier one) finish.
  void open(unsigned value);
  // Whether a gate kernel gave up waiting (the timing of that call is then meaningless).
  bool timed_out() const;

 private:
  unsigned* host_ = nullptr;    // [0] the open value, [1] timed-out flag (mapped pinned)
  unsigned* device_ = nullptr;  // the same words as the device addresses them
  unsigned count_ = 0;
};

}  // namespace sy_bench

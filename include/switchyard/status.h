// Status: every fallible Switchyard call returns one. Errors are values: the library never
// calls exit or abort and never traps on the device in release builds.
#pragma once

#include <string>
#include <utility>

namespace switchyard {

enum class StatusCode : int {
  kOk = 0,
  kInvalidArgument = 1,  // bad shape, dtype, device, pointer, size or configuration value
  kUnsupported = 2,      // valid request this build or backend does not implement
  kCudaError = 3,        // a CUDA runtime call failed; the message carries cudaGetErrorString
  kInternal = 4,         // a bug in Switchyard; please report it
  kTimeout = 5,          // a peer did not arrive in time (expert parallelism); the group is broken
};

const char* status_code_name(StatusCode code);

class Status {
 public:
  Status() = default;  // ok
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status Ok() { return Status(); }
  static Status InvalidArgument(std::string message) {
    return Status(StatusCode::kInvalidArgument, std::move(message));
  }
  static Status Unsupported(std::string message) {
    return Status(StatusCode::kUnsupported, std::move(message));
  }
  static Status CudaError(std::string message) {
    return Status(StatusCode::kCudaError, std::move(message));
  }
  static Status Internal(std::string message) {
    return Status(StatusCode::kInternal, std::move(message));
  }
  static Status Timeout(std::string message) {
    return Status(StatusCode::kTimeout, std::move(message));
  }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // "InvalidArgument: route: argument 'topk_ids': ..." or "Ok".
  std::string to_string() const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

}  // namespace switchyard

// Propagates a non-ok Status to the caller.
#define SY_RETURN_IF_ERROR(expr)                       \
  do {                                                 \
    ::switchyard::Status sy_status_ = (expr);          \
    if (!sy_status_.ok()) return sy_status_;           \
  } while (0)

// The build's identity for deltaserve_build_info: set by CMake at configure time.
#pragma once

namespace deltaserve::telemetry {

extern const char* const kVersion;   // the project version, e.g. "0.1.0"
extern const char* const kRevision;  // `git rev-parse --short HEAD` at configure time, or "unknown"

}  // namespace deltaserve::telemetry

#include "telemetry/build_info.hpp"

#ifndef DELTASERVE_VERSION
#define DELTASERVE_VERSION "unknown"
#endif
#ifndef DELTASERVE_REVISION
#define DELTASERVE_REVISION "unknown"
#endif

namespace deltaserve::telemetry {

const char* const kVersion = DELTASERVE_VERSION;
const char* const kRevision = DELTASERVE_REVISION;

}  // namespace deltaserve::telemetry

#include "kvstore/transfer/fault_injection.hpp"

#include <charconv>

namespace deltaserve::kvstore::transfer {
namespace {

constexpr std::pair<std::string_view, FaultPoint> kPoints[] = {
    {"send.drop_piece", FaultPoint::kDropPiece},
    {"send.corrupt_byte", FaultPoint::kCorruptByte},
    {"send.delay_piece", FaultPoint::kDelayPiece},
    {"send.kill_endpoint", FaultPoint::kKillEndpoint},
};

bool parse_u32(std::string_view text, uint32_t& out) {
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), out);
  return ec == std::errc() && end == text.data() + text.size() && !text.empty();
}

}  // namespace

const char* fault_point_name(FaultPoint point) {
  for (const auto& [name, p] : kPoints) {
    if (p == point) return name.data();
  }
  return "?";
}

Result<std::vector<Fault>> parse_faults(std::string_view spec) {
  std::vector<Fault> faults;
  if (spec.empty()) return faults;
  if (!kFaultInjectionCompiled) {
    return Status(StatusCode::kInvalidArgument,
                  "fault injection is compiled out of this build (spec '" + std::string(spec) + "')");
  }
  while (!spec.empty()) {
    const size_t comma = spec.find(',');
    std::string_view item = spec.substr(0, comma);
    spec = comma == std::string_view::npos ? std::string_view{} : spec.substr(comma + 1);
    const size_t colon = item.find(':');
    if (colon == std::string_view::npos) return invalid_argument("fault '" + std::string(item) + "': missing ':piece'");
    const std::string_view name = item.substr(0, colon);
    std::string_view rest = item.substr(colon + 1);
    Fault fault;
    bool known = false;
    for (const auto& [n, p] : kPoints) {
      if (n == name) {
        fault.point = p;
        known = true;
      }
    }
    if (!known) return invalid_argument("fault '" + std::string(item) + "': unknown point");
    const size_t colon2 = rest.find(':');
    const std::string_view piece = rest.substr(0, colon2);
    if (!parse_u32(piece, fault.piece)) return invalid_argument("fault '" + std::string(item) + "': bad piece");
    if (colon2 != std::string_view::npos) {
      if (fault.point != FaultPoint::kDelayPiece || !parse_u32(rest.substr(colon2 + 1), fault.delay_ms)) {
        return invalid_argument("fault '" + std::string(item) + "': bad delay");
      }
    } else if (fault.point == FaultPoint::kDelayPiece) {
      return invalid_argument("fault '" + std::string(item) + "': delay_piece needs ':delay_ms'");
    }
    faults.push_back(fault);
  }
  return faults;
}

}  // namespace deltaserve::kvstore::transfer

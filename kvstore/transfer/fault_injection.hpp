// Named fault-injection points of the transfer layer, compiled in only when
// DELTASERVE_TRANSFER_FAULTS is defined (the ds_kvstore_transfer_faults library that the tests and the
// test helper link; the release library ds_kvstore_transfer has none and rejects a fault spec).
//
// Points (all on the sending engine, matched by piece sequence number):
//   send.drop_piece      the piece's puts and its kPiece notice are skipped (a lost piece)
//   send.corrupt_byte    after the piece's puts, one byte in the middle of its first segment is
//                        overwritten with its complement before the notice (corruption in flight); with GPU
//                        sources, one bit of the announced checksum is flipped instead
//   send.delay_piece     the piece's notice goes out `delay_ms` later (a slow or stuck link)
//   send.kill_endpoint   the endpoint to the receiver is force-closed instead of sending the piece
// Spec text (EngineConfig::faults): comma-separated `point:piece[:delay_ms]`, e.g.
// "send.drop_piece:3,send.delay_piece:1:500".
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.hpp"

namespace deltaserve::kvstore::transfer {

enum class FaultPoint { kDropPiece, kCorruptByte, kDelayPiece, kKillEndpoint };

struct Fault {
  FaultPoint point = FaultPoint::kDropPiece;
  uint32_t piece = 0;
  uint32_t delay_ms = 0;  // kDelayPiece only
};

inline constexpr bool kFaultInjectionCompiled =
#ifdef DELTASERVE_TRANSFER_FAULTS
    true;
#else
    false;
#endif

// Parses a spec; kInvalidArgument on unknown points or bad numbers, and on any non-empty spec when
// fault injection is compiled out.
Result<std::vector<Fault>> parse_faults(std::string_view spec);

const char* fault_point_name(FaultPoint point);

}  // namespace deltaserve::kvstore::transfer

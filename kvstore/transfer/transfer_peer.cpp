// Test helper: one side of a transfer in its own process, driven over stdin/stdout lines.
//   transfer_peer send [options]   reads "descriptor <hex>" from stdin, sends every piece filled with
//                                  payload_byte(seed, i) (i = byte index across pieces in order), finishes,
//                                  waits, prints "result <CODE> <message>"; exit 0 iff OK.
//   transfer_peer recv <bytes> <pieces> [options]
//                                  allocates a region, expects <pieces> equal pieces, prints
//                                  "descriptor <hex>", waits, checks the payload, prints "result ...".
// Options: --tls X  --net-devices X  --detect-peer-failure  --faults SPEC  --seed N  --deadline-ms N
//          --carrier put|message (default: carrier_for_transports of --tls)
//          --stall-after N (send: after N pieces print "stalled" and sleep; recv: print the descriptor
//          and sleep without progressing, as a hung receiver)
#include <chrono>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include <signal.h>
#include <sys/prctl.h>
#include <unistd.h>

#include "kvstore/transfer/payload.hpp"
#include "kvstore/transfer/transfer_engine.hpp"
#include "kvstore/transfer/wire.hpp"

using namespace deltaserve;
using namespace deltaserve::kvstore::transfer;

namespace {

struct Options {
  EngineConfig engine;
  uint64_t seed = 1;
  uint32_t deadline_ms = 5000;
  int64_t stall_after = -1;
};

[[noreturn]] void die(const std::string& what) {
  std::printf("error %s\n", what.c_str());
  std::fflush(stdout);
  std::exit(2);
}

void print_result(const Status& s) {
  std::printf("result %s %s\n", status_code_name(s.code()), s.message().c_str());
  std::fflush(stdout);
}

// Stops producing: with an engine, keeps progressing it (a live sender busy elsewhere); without one,
// does nothing at all (a hung process).
[[noreturn]] void stall(TransferEngine* engine) {
  std::printf("stalled\n");
  std::fflush(stdout);
  for (;;) {
    if (engine != nullptr) {
      engine->progress();
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    } else {
      std::this_thread::sleep_for(std::chrono::seconds(1));
    }
  }
}

int run_send(const Options& o) {
  std::string line;
  if (!std::getline(std::cin, line) || !line.starts_with("descriptor ")) die("expected a descriptor line");
  auto bytes = from_hex(line.substr(11));
  if (!bytes.is_ok()) die(bytes.status().to_string());
  auto descriptor = decode_descriptor(*bytes);
  if (!descriptor.is_ok()) die(descriptor.status().to_string());
  auto engine = TransferEngine::create(o.engine);
  if (!engine.is_ok()) die(engine.status().to_string());
  auto& e = **engine;
  uint64_t total = 0;
  for (const auto& piece : descriptor->pieces) total += piece_bytes(piece);
  auto source = e.allocate_region(total);
  if (!source.is_ok()) die(source.status().to_string());
  fill_payload(e.region_data(*source), o.seed, 0);
  auto id = e.start_send(*bytes);
  if (!id.is_ok()) die(id.status().to_string());
  uint64_t offset = 0;
  for (uint32_t p = 0; p < descriptor->pieces.size(); ++p) {
    if (o.stall_after >= 0 && p == o.stall_after) stall(&e);
    const uint64_t n = piece_bytes(descriptor->pieces[p]);
    std::array<std::span<const std::byte>, 1> src{e.region_data(*source).subspan(offset, n)};
    offset += n;
    const Status s = e.send_piece(*id, p, src);
    if (!s.is_ok()) break;  // the transfer failed; wait() reports why
    e.progress();
  }
  (void)e.finish_send(*id);
  const Status s = e.wait(*id);
  print_result(s);
  return s.is_ok() ? 0 : 1;
}

int run_recv(const Options& o, uint64_t bytes, uint32_t pieces) {
  auto engine = TransferEngine::create(o.engine);
  if (!engine.is_ok()) die(engine.status().to_string());
  auto& e = **engine;
  auto region = e.allocate_region(bytes);
  if (!region.is_ok()) die(region.status().to_string());
  ReceiveSpec spec;
  spec.deadline = std::chrono::milliseconds(o.deadline_ms);
  const uint64_t piece = bytes / pieces;
  for (uint32_t p = 0; p < pieces; ++p) {
    spec.pieces.push_back({{*region, p * piece, p + 1 == pieces ? bytes - p * piece : piece}});
  }
  auto expected = e.expect(std::move(spec));
  if (!expected.is_ok()) die(expected.status().to_string());
  std::printf("descriptor %s\n", to_hex(expected->descriptor).c_str());
  std::fflush(stdout);
  if (o.stall_after >= 0) stall(nullptr);
  Status s = e.wait(expected->id);
  if (s.is_ok() && !payload_matches(e.region_data(*region), o.seed, 0)) s = data_loss("payload differs");
  print_result(s);
  return s.is_ok() ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  // Die with the test process, even when it is killed: tests leave no process behind.
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() == 1) return 3;
  if (argc < 2) die("usage: transfer_peer send|recv ...");
  const std::string mode = argv[1];
  Options o;
  std::string carrier;
  std::vector<std::string> positional;
  for (int i = 2; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) die("missing value for " + a);
      return argv[++i];
    };
    if (a == "--tls")
      o.engine.tls = next();
    else if (a == "--net-devices")
      o.engine.net_devices = next();
    else if (a == "--detect-peer-failure")
      o.engine.detect_peer_failure = true;
    else if (a == "--faults")
      o.engine.faults = next();
    else if (a == "--seed")
      o.seed = std::stoull(next());
    else if (a == "--deadline-ms")
      o.deadline_ms = static_cast<uint32_t>(std::stoul(next()));
    else if (a == "--stall-after")
      o.stall_after = std::stoll(next());
    else if (a == "--carrier")
      carrier = next();
    else
      positional.push_back(a);
  }
  if (carrier.empty()) {
    o.engine.carrier = carrier_for_transports(o.engine.tls);
  } else if (carrier == "put" || carrier == "message") {
    o.engine.carrier = carrier == "put" ? EngineConfig::PieceCarrier::kPut : EngineConfig::PieceCarrier::kMessage;
  } else {
    die("--carrier: put or message, not '" + carrier + "'");
  }
  if (mode == "send") return run_send(o);
  if (mode == "recv" && positional.size() == 2) {
    return run_recv(o, std::stoull(positional[0]), static_cast<uint32_t>(std::stoul(positional[1])));
  }
  die("usage: transfer_peer send|recv <bytes> <pieces> [options]");
}

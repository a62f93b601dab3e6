// GPU memory in the transfer layer (ctest label gpu): the kSum64 kernel against the CPU function, and two
// engines in one process moving pieces from GPU memory into GPU memory (cuda_ipc / cuda_copy, whichever UCX
// picks) with every fault point of the sender. Needs a UCX that registers CUDA memory (PyPI's libucx-cu13
// first on LD_LIBRARY_PATH); the engine cases fail, not skip, without one: on the GPU host that is a setup
// error.
#include <cstring>
#include <random>
#include <vector>

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include "kvstore/transfer/checksum.hpp"
#include "kvstore/transfer/cuda/cuda_device_memory.hpp"
#include "kvstore/transfer/transfer_engine.hpp"

namespace deltaserve::kvstore::transfer::cuda {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

std::vector<std::byte> random_bytes(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<std::byte> out(n);
  for (auto& b : out) b = static_cast<std::byte>(rng());
  return out;
}

struct DeviceBuffer {
  std::byte* data = nullptr;
  size_t bytes = 0;
  explicit DeviceBuffer(size_t n) : bytes(n) { EXPECT_EQ(cudaMalloc(reinterpret_cast<void**>(&data), n), cudaSuccess); }
  ~DeviceBuffer() { cudaFree(data); }
  void upload(const std::vector<std::byte>& host) {
    ASSERT_EQ(cudaMemcpy(data, host.data(), host.size(), cudaMemcpyHostToDevice), cudaSuccess);
  }
  std::vector<std::byte> download() const {
    std::vector<std::byte> host(bytes);
    EXPECT_EQ(cudaMemcpy(host.data(), data, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
    return host;
  }
};

std::shared_ptr<CudaDeviceMemory> device_memory() {
  auto memory = CudaDeviceMemory::create();
  EXPECT_TRUE(memory.is_ok()) << memory.status().to_string();
  return memory.is_ok() ? *memory : nullptr;
}

uint64_t gpu_sum64(CudaDeviceMemory& memory, std::span<const std::span<const std::byte>> spans) {
  auto ticket = memory.begin_checksum(spans);
  EXPECT_TRUE(ticket.is_ok()) << ticket.status().to_string();
  if (!ticket.is_ok()) return 0;
  for (;;) {
    auto value = memory.poll_checksum(*ticket);
    if (!value) continue;
    EXPECT_TRUE(value->is_ok()) << value->status().to_string();
    return value->is_ok() ? **value : 0;
  }
}

TEST(Sum64Gpu, EqualsTheCpuFunctionForLengthsAlignmentsAndSplits) {
  auto memory = device_memory();
  ASSERT_TRUE(memory);
  const size_t largest = (8u << 20) + 40;
  const auto host = random_bytes(largest, 5);
  DeviceBuffer buffer(largest);
  buffer.upload(host);
  EXPECT_TRUE(memory->is_device(buffer.data));
  EXPECT_FALSE(memory->is_device(host.data()));
  // Lengths around the word, the 16-byte pair and the unrolled stride; starts 16- and 8-aligned.
  for (size_t start : {0ul, 8ul}) {
    for (size_t n : {1ul, 7ul, 8ul, 9ul, 15ul, 16ul, 17ul, 24ul, 1000ul, 4096ul, 65544ul, (1ul << 20) + 3, 8ul << 20}) {
      const std::span<const std::byte> span(buffer.data + start, n);
      const uint64_t expected = sum64(std::span(host).subspan(start, n));
      ASSERT_EQ(gpu_sum64(*memory, std::span(&span, 1)), expected) << "start " << start << " bytes " << n;
    }
  }
  // Many spans (more than one launch takes), out of memory order, the last one with a partial word.
  std::vector<std::span<const std::byte>> spans;
  Sum64 cpu;
  for (int k = 0; k < 70; ++k) {
    const size_t offset = static_cast<size_t>((k * 37) % 70) * 65536 + (k % 2) * 8;
    const size_t n = k == 69 ? 1234567 : 8 * (1000 + 13 * k);
    spans.emplace_back(buffer.data + offset, n);
    cpu.update(std::span(host).subspan(offset, n));
  }
  EXPECT_EQ(gpu_sum64(*memory, spans), cpu.finish());
  // The word rule is enforced.
  const std::span<const std::byte> odd[] = {{buffer.data, 12}, {buffer.data + 16, 8}};
  EXPECT_EQ(memory->begin_checksum(odd).status().code(), StatusCode::kInvalidArgument);
  const std::span<const std::byte> misaligned(buffer.data + 4, 64);
  EXPECT_EQ(memory->begin_checksum(std::span(&misaligned, 1)).status().code(), StatusCode::kInvalidArgument);
}

constexpr uint64_t kPiece = 4 << 20;
constexpr uint32_t kPieces = 5;

// A receiver whose pieces land in GPU memory (each piece in two segments, second half first) and a sender
// whose sources are GPU memory, both engines in this process.
struct GpuPair {
  std::shared_ptr<CudaDeviceMemory> memory = device_memory();
  std::unique_ptr<TransferEngine> receiver, sender;
  DeviceBuffer destination{kPieces * kPiece};
  DeviceBuffer source{kPieces * kPiece};
  std::vector<std::byte> payload = random_bytes(kPieces * kPiece, 17);
  RegionId destination_region = 0, source_region = 0;
  ExpectedTransfer expected;
  TransferId send_id = 0;

  std::unique_ptr<TransferEngine> engine(const std::string& faults, EngineConfig::PieceCarrier carrier) {
    EngineConfig config;
    config.tls = "sm,self,cuda_copy,cuda_ipc";
    config.device = memory;
    config.faults = faults;
    config.carrier = carrier;
    config.finish_grace = 200ms;
    auto e = TransferEngine::create(config);
    EXPECT_TRUE(e.is_ok()) << e.status().to_string();
    return e.is_ok() ? std::move(e).value() : nullptr;
  }

  explicit GpuPair(const std::string& sender_faults = "",
                   EngineConfig::PieceCarrier carrier = EngineConfig::PieceCarrier::kPut,
                   std::chrono::milliseconds deadline = 10s) {
    receiver = engine("", EngineConfig::PieceCarrier::kPut);
    sender = engine(sender_faults, carrier);
    if (!receiver || !sender) return;
    EXPECT_TRUE(receiver->memory_info().cuda) << "this UCX cannot register CUDA memory (ucx_info -d)";
    source.upload(payload);
    EXPECT_EQ(cudaMemset(destination.data, 0, destination.bytes), cudaSuccess);
    auto registered_destination = receiver->register_device_region(destination.data, destination.bytes);
    auto registered_source = sender->register_device_region(source.data, source.bytes);
    EXPECT_TRUE(registered_destination.is_ok()) << registered_destination.status().to_string();
    EXPECT_TRUE(registered_source.is_ok()) << registered_source.status().to_string();
    if (!registered_destination.is_ok() || !registered_source.is_ok()) {
      receiver.reset();
      sender.reset();
      return;
    }
    destination_region = *registered_destination;
    source_region = *registered_source;
    ReceiveSpec spec;
    spec.deadline = deadline;
    for (uint32_t p = 0; p < kPieces; ++p) {
      const uint64_t base = p * kPiece;
      spec.pieces.push_back(
          {{destination_region, base + kPiece / 2, kPiece / 2}, {destination_region, base, kPiece / 2}});
    }
    expected = receiver->expect(std::move(spec)).value();
    send_id = sender->start_send(expected.descriptor).value();
    EXPECT_EQ(sender->checksum_kind(send_id), ChecksumKind::kSum64);
  }

  Status send_all(bool finish = true) {
    for (uint32_t p = 0; p < kPieces; ++p) {
      const std::byte* base = source.data + p * kPiece;
      const std::span<const std::byte> sources[] = {{base + kPiece / 2, kPiece / 2}, {base, kPiece / 2}};
      if (Status s = sender->send_piece(send_id, p, sources); !s.is_ok()) return s;
    }
    return finish ? sender->finish_send(send_id) : Status::ok();
  }

  std::pair<Status, Status> run(std::chrono::milliseconds limit = 30s) {
    std::optional<Status> r, s;
    const auto until = Clock::now() + limit;
    while ((!r || !s) && Clock::now() < until) {
      receiver->progress();
      sender->progress();
      if (!r) r = receiver->try_take(expected.id);
      if (!s) s = sender->try_take(send_id);
    }
    return {r.value_or(Status(StatusCode::kInternal, "test timeout")),
            s.value_or(Status(StatusCode::kInternal, "test timeout"))};
  }

  void expect_released() {
    for (TransferEngine* e : {receiver.get(), sender.get()}) {
      const EngineStats s = e->stats();
      EXPECT_EQ(s.region_uses, 0);
      EXPECT_EQ(s.requests_in_flight, 0);
      EXPECT_EQ(s.rkey_uses, 0);
      EXPECT_EQ(s.transfers, 0);
    }
    EXPECT_TRUE(receiver->release_region(destination_region).is_ok());
    EXPECT_TRUE(sender->release_region(source_region).is_ok());
  }
};

TEST(TransferEngineGpu, PiecesLandInGpuMemoryVerifiedOnTheGpu) {
  for (auto carrier : {EngineConfig::PieceCarrier::kPut, EngineConfig::PieceCarrier::kMessage}) {
    GpuPair pair("", carrier);
    ASSERT_TRUE(pair.receiver && pair.sender);
    ASSERT_TRUE(pair.send_all().is_ok());
    auto [r, s] = pair.run();
    EXPECT_TRUE(r.is_ok()) << r.to_string();
    EXPECT_TRUE(s.is_ok()) << s.to_string();
    EXPECT_EQ(pair.destination.download(), pair.payload) << "carrier " << static_cast<int>(carrier);
    EXPECT_EQ(pair.receiver->stats().bytes_received, kPieces * kPiece);
    pair.expect_released();
  }
}

TEST(TransferEngineGpu, EverySenderFaultEndsInACleanError) {
  struct Case {
    std::string faults;
    StatusCode receiver;
  };
  for (const Case& c :
       {Case{"send.corrupt_byte:2", StatusCode::kDataLoss}, Case{"send.drop_piece:4", StatusCode::kDataLoss},
        Case{"send.kill_endpoint:1", StatusCode::kUnavailable}}) {
    GpuPair pair(c.faults, EngineConfig::PieceCarrier::kPut, 3s);
    ASSERT_TRUE(pair.receiver && pair.sender);
    // A fault may already fail send_piece (kill_endpoint); the transfers' statuses below are what counts.
    (void)pair.send_all();
    auto [r, s] = pair.run();
    // A killed endpoint over shared memory is noticed at the deadline (no peer-failure detection there).
    if (c.receiver == StatusCode::kUnavailable) {
      EXPECT_TRUE(r.code() == StatusCode::kUnavailable || r.code() == StatusCode::kDeadlineExceeded) << r.to_string();
    } else {
      EXPECT_EQ(r.code(), c.receiver) << c.faults << ": " << r.to_string();
    }
    EXPECT_FALSE(s.is_ok()) << c.faults;
    pair.expect_released();
  }
}

TEST(TransferEngineGpu, SenderThatNeverFinishesHitsTheDeadline) {
  GpuPair pair("", EngineConfig::PieceCarrier::kPut, 500ms);
  ASSERT_TRUE(pair.receiver && pair.sender);
  ASSERT_TRUE(pair.send_all(/*finish=*/false).is_ok());
  auto [r, s] = pair.run();
  EXPECT_EQ(r.code(), StatusCode::kDeadlineExceeded) << r.to_string();
  EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded) << s.to_string();
  pair.expect_released();
}

TEST(TransferEngineGpu, GpuSourcesIntoHostMemoryAndRefusals) {
  auto memory = device_memory();
  ASSERT_TRUE(memory);
  EngineConfig config;
  config.tls = "sm,self,cuda_copy,cuda_ipc";
  config.device = memory;
  auto receiver = TransferEngine::create(config).value();
  auto sender = TransferEngine::create(config).value();
  // Host destination: kStripe64, and the sender stages its GPU bytes to checksum them.
  const uint64_t bytes = 1 << 20;
  const auto payload = random_bytes(bytes, 23);
  DeviceBuffer source(bytes);
  source.upload(payload);
  ASSERT_TRUE(sender->register_device_region(source.data, bytes).is_ok());
  const RegionId host = receiver->allocate_region(bytes).value();
  ReceiveSpec spec;
  spec.pieces = {{{host, 0, bytes}}};
  auto expected = receiver->expect(std::move(spec)).value();
  const TransferId id = sender->start_send(expected.descriptor).value();
  EXPECT_EQ(sender->checksum_kind(id), ChecksumKind::kStripe64);
  const std::span<const std::byte> sources[] = {{source.data, bytes}};
  ASSERT_TRUE(sender->send_piece(id, 0, sources).is_ok());
  ASSERT_TRUE(sender->finish_send(id).is_ok());
  std::optional<Status> r, s;
  const auto until = Clock::now() + 30s;
  while ((!r || !s) && Clock::now() < until) {
    receiver->progress();
    sender->progress();
    if (!r) r = receiver->try_take(expected.id);
    if (!s) s = sender->try_take(id);
  }
  ASSERT_TRUE(r && s);
  EXPECT_TRUE(r->is_ok()) << r->to_string();
  auto landed = receiver->region_data(host);
  EXPECT_EQ(std::memcmp(landed.data(), payload.data(), bytes), 0);
  // Refusals: GPU memory through register_region, host memory through register_device_region, a piece that
  // mixes both, and a GPU segment that breaks the word rule.
  EXPECT_EQ(receiver->register_region(source.data, bytes).status().code(), StatusCode::kInvalidArgument);
  std::vector<std::byte> host_bytes(64);
  EXPECT_EQ(receiver->register_device_region(host_bytes.data(), 64).status().code(), StatusCode::kInvalidArgument);
  DeviceBuffer gpu(4096);
  const RegionId device = receiver->register_device_region(gpu.data, 4096).value();
  ReceiveSpec mixed;
  mixed.pieces = {{{device, 0, 64}, {host, 0, 64}}};
  EXPECT_EQ(receiver->expect(std::move(mixed)).status().code(), StatusCode::kInvalidArgument);
  ReceiveSpec odd;
  odd.pieces = {{{device, 0, 12}, {device, 16, 8}}};
  EXPECT_EQ(receiver->expect(std::move(odd)).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace deltaserve::kvstore::transfer::cuda

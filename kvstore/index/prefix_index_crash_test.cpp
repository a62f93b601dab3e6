// Crash test: a writer process (prefix_index_stress) is SIGKILLed under write load again and again; after
// each kill the index must reopen, every entry must decode and be one the writer could have produced
// (hash, namespace, worker, depth), no lookup may cross tenants, and no batch may be half applied.
#include <chrono>
#include <cstring>
#include <map>
#include <random>
#include <set>
#include <thread>
#include <unordered_map>

#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <rocksdb/db.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/temp_dir.hpp"
#include "kvstore/index/prefix_index.hpp"
#include "kvstore/index/prefix_index_codec.hpp"
#include "kvstore/index/prefix_index_stress_workload.hpp"

namespace deltaserve::kvstore {
namespace {

namespace codec = index_format;

constexpr int kCycles = 24;
constexpr auto kCycleBudget = std::chrono::seconds(30);  // the whole test stops starting cycles after this
constexpr uint64_t kContentSeed = 20261201;

struct HashKey {
  size_t operator()(const BlockHash& h) const {
    uint64_t v;
    std::memcpy(&v, h.bytes.data(), sizeof v);
    return v;
  }
};

struct Origin {
  int tenant;
  int chain;
  int64_t depth;
};

// A started writer; killed (SIGKILL) and reaped when it goes away, whatever the test did.
class StressProcess {
 public:
  StressProcess(const std::filesystem::path& dir, uint64_t action_seed, uint64_t epoch_base, bool sync) {
    int fds[2];
    if (::pipe2(fds, O_CLOEXEC) != 0) return;
    const std::string args[] = {DELTASERVE_PREFIX_INDEX_STRESS, dir.string(),
                                std::to_string(kContentSeed),   std::to_string(action_seed),
                                std::to_string(epoch_base),     sync ? "1" : "0"};
    std::vector<char*> argv;  // built before fork: RocksDB's background threads may hold the allocator
    for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    pid_ = ::fork();
    if (pid_ == 0) {
      ::dup2(fds[1], STDOUT_FILENO);  // the duplicate does not close on exec
      ::execv(argv[0], argv.data());
      ::_exit(127);
    }
    ::close(fds[1]);
    stdout_ = fds[0];
  }
  ~StressProcess() {
    kill_and_wait();
    if (stdout_ >= 0) ::close(stdout_);
  }

  // Waits until the writer printed "open" (it is then writing); false on timeout or early exit.
  bool wait_open(std::chrono::milliseconds timeout) {
    if (pid_ <= 0 || stdout_ < 0) return false;
    pollfd fd{.fd = stdout_, .events = POLLIN, .revents = 0};
    if (::poll(&fd, 1, static_cast<int>(timeout.count())) != 1) return false;
    char buffer[8] = {};
    return ::read(stdout_, buffer, sizeof buffer) >= 4 && std::string_view(buffer, 4) == "open";
  }

  // SIGKILLs the writer; returns its wait status (-1 if there was none).
  int kill_and_wait() {
    if (pid_ <= 0) return -1;
    ::kill(pid_, SIGKILL);
    int status = 0;
    ::waitpid(pid_, &status, 0);
    pid_ = -1;
    return status;
  }

 private:
  pid_t pid_ = -1;
  int stdout_ = -1;
};

struct EntrySeen {
  std::string worker;
  Origin origin;
  bool has_checkpoint;
  uint64_t epoch;
};

// Reads every key with plain RocksDB, checks the invariants and fills `entries`.
void scan_and_check(const std::filesystem::path& dir, const std::unordered_map<BlockHash, Origin, HashKey>& origins,
                    uint64_t max_epoch, std::vector<EntrySeen>& entries) {
  rocksdb::DB* raw = nullptr;
  const rocksdb::Status opened = rocksdb::DB::OpenForReadOnly(rocksdb::Options(), dir.string(), &raw);
  EXPECT_TRUE(opened.ok()) << opened.ToString();
  if (!opened.ok()) return;
  std::unique_ptr<rocksdb::DB> db(raw);
  std::set<std::string> entry_keys, worker_keys;
  std::map<std::string, uint64_t> epochs;
  std::unique_ptr<rocksdb::Iterator> it(db->NewIterator(rocksdb::ReadOptions()));
  for (it->SeekToFirst(); it->Valid(); it->Next()) {
    const std::string key = it->key().ToString();
    const std::string_view value(it->value().data(), it->value().size());
    SCOPED_TRACE(codec::describe_key(key));
    if (key[0] == codec::kEntryTag) {
      auto k = codec::decode_entry_key(key);
      ASSERT_TRUE(k.is_ok()) << k.status().to_string();
      auto v = codec::decode_entry_value(key, value);
      ASSERT_TRUE(v.is_ok()) << v.status().to_string();
      const auto origin = origins.find(k->hash);
      ASSERT_NE(origin, origins.end()) << "a hash the writer never produced";
      EXPECT_EQ(v->cache_namespace, stress::kNamespaces[static_cast<size_t>(origin->second.tenant)]);
      EXPECT_EQ(v->block_index, origin->second.depth);
      EXPECT_LE(v->epoch, max_epoch);
      bool known_worker = false;
      for (int w = 0; w < stress::kWorkers; ++w) known_worker = known_worker || k->worker == stress::worker_name(w);
      EXPECT_TRUE(known_worker) << "an entry of a worker the writer never named";
      entries.push_back({std::string(k->worker), origin->second, v->has_checkpoint, v->epoch});
      entry_keys.insert(codec::worker_key(k->worker, k->hash));
    } else if (key[0] == codec::kWorkerTag) {
      ASSERT_TRUE(codec::decode_worker_key(key).is_ok());
      EXPECT_TRUE(value.empty());
      worker_keys.insert(key);
    } else if (key[0] == codec::kEpochTag) {
      auto worker = codec::decode_epoch_key(key);
      ASSERT_TRUE(worker.is_ok());
      auto epoch = codec::decode_epoch_value(key, value);
      ASSERT_TRUE(epoch.is_ok()) << epoch.status().to_string();
      epochs[std::string(*worker)] = *epoch;
    } else {
      ADD_FAILURE() << "unexpected key";
    }
  }
  EXPECT_TRUE(it->status().ok()) << it->status().ToString();
  // Entry and by-worker keys come and go together.
  EXPECT_EQ(entry_keys, worker_keys);
  for (const EntrySeen& entry : entries) {
    const auto epoch = epochs.find(entry.worker);
    ASSERT_NE(epoch, epochs.end()) << entry.worker << " has entries but no epoch";
    EXPECT_EQ(entry.epoch, epoch->second) << entry.worker << " holds entries of an old incarnation";
  }
}

TEST(PrefixIndexCrash, SurvivesRepeatedKillsUnderWriteLoad) {
  TempDir dir("prefix_index_crash");
  const auto path = dir.path() / "index";
  const std::vector<stress::Chain> chains = stress::make_chains(kContentSeed);
  std::unordered_map<BlockHash, Origin, HashKey> origins;
  for (const auto& chain : chains) {
    for (size_t i = 0; i < chain.hashes.size(); ++i) {
      ASSERT_TRUE(origins.emplace(chain.hashes[i], Origin{chain.tenant, chain.chain, int64_t(i) + 1}).second);
    }
  }

  const uint32_t seed = std::random_device{}();
  std::printf("prefix index crash test: kill schedule seed %u\n", seed);
  std::mt19937 rng(seed);
  const auto deadline = std::chrono::steady_clock::now() + kCycleBudget;
  int cycles = 0;
  size_t max_entries = 0;
  for (; cycles < kCycles && std::chrono::steady_clock::now() < deadline; ++cycles) {
    SCOPED_TRACE("cycle " + std::to_string(cycles));
    const uint64_t epoch_base = uint64_t(cycles + 1) * 1000000;
    {
      StressProcess writer(path, rng(), epoch_base, cycles % 4 == 3);
      ASSERT_TRUE(writer.wait_open(std::chrono::seconds(20))) << "the writer did not open the index";
      std::this_thread::sleep_for(std::chrono::milliseconds(5 + rng() % 200));
      const int status = writer.kill_and_wait();
      ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL)
          << "the writer stopped on its own (status " << status << "): it hit an index error";
    }

    // It opens, and every lookup agrees with the entries; no lookup crosses tenants.
    std::map<std::pair<std::string, int>, std::vector<WorkerPrefixMatch>> lookups;  // (ns, chain index)
    {
      auto index = PrefixIndex::open(path);
      ASSERT_TRUE(index.is_ok()) << index.status().to_string();
      for (size_t c = 0; c < chains.size(); ++c) {
        for (std::string_view ns : stress::kNamespaces) {
          auto got = (*index)->lookup(chains[c].hashes, ns);
          ASSERT_TRUE(got.is_ok()) << got.status().to_string();
          if (ns != stress::kNamespaces[static_cast<size_t>(chains[c].tenant)]) {
            EXPECT_TRUE(got->empty()) << "cross-tenant hit: chain " << c << " under " << ns;
          } else {
            lookups[{std::string(ns), static_cast<int>(c)}] = *got;
          }
        }
      }
    }

    std::vector<EntrySeen> entries;
    scan_and_check(path, origins, epoch_base + 1000, entries);
    if (::testing::Test::HasFatalFailure()) return;
    max_entries = std::max(max_entries, entries.size());

    // Per (worker, chain): the held depths are exactly 1..m (a torn batch would leave a gap).
    std::map<std::pair<std::string, int>, std::map<int64_t, bool>> held;  // → depth → has_checkpoint
    for (const EntrySeen& e : entries) {
      held[{e.worker, e.origin.tenant * stress::kChainsPerTenant + e.origin.chain}][e.origin.depth] = e.has_checkpoint;
    }
    for (const auto& [who, depths] : held) {
      EXPECT_EQ(depths.rbegin()->first, static_cast<int64_t>(depths.size()))
          << who.first << " chain " << who.second << " holds a run with a gap";
    }
    // The lookups report exactly that run and its deepest checkpoint.
    for (size_t c = 0; c < chains.size(); ++c) {
      const std::string ns(stress::kNamespaces[static_cast<size_t>(chains[c].tenant)]);
      std::map<std::string, std::pair<int64_t, int64_t>> want;  // worker → (pages, checkpoint)
      for (const auto& [who, depths] : held) {
        if (who.second != static_cast<int>(c)) continue;
        int64_t checkpoint = 0;
        for (const auto& [depth, has_checkpoint] : depths) {
          if (has_checkpoint) checkpoint = depth;
        }
        want[who.first] = {static_cast<int64_t>(depths.size()), checkpoint};
      }
      std::map<std::string, std::pair<int64_t, int64_t>> got;
      for (const auto& match : lookups[{ns, static_cast<int>(c)}]) {
        got[match.worker] = {match.pages_blocks, match.checkpoint_blocks};
      }
      EXPECT_EQ(got, want) << "chain " << c;
    }
  }
  std::printf("prefix index crash test: %d kill cycles, up to %zu entries after a kill\n", cycles, max_entries);
  EXPECT_GE(cycles, 20);
  EXPECT_GT(max_entries, 0u) << "the writer never got a batch in before being killed";
}

}  // namespace
}  // namespace deltaserve::kvstore

#include "kvstore/index/prefix_index_codec.hpp"

#include <array>
#include <cstring>

namespace deltaserve::kvstore::index_format {
namespace {

constexpr uint8_t kEntryVersion = 1;
constexpr uint8_t kEpochVersion = 1;
constexpr size_t kEntryFixedBytes = 1 + 1 + 8 + 8 + 8 + 2 + 4;
constexpr size_t kEpochValueBytes = 1 + 8 + 4;

constexpr std::array<uint32_t, 256> make_crc_table() {
  std::array<uint32_t, 256> table{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int bit = 0; bit < 8; ++bit) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
    table[i] = c;
  }
  return table;
}
constexpr std::array<uint32_t, 256> kCrcTable = make_crc_table();

void put_u64(std::string& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>(v >> (8 * i)));
}
void put_u32(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>(v >> (8 * i)));
}
uint64_t get_u64(const char* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= uint64_t{static_cast<uint8_t>(p[i])} << (8 * i);
  return v;
}
uint32_t get_u32(const char* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= uint32_t{static_cast<uint8_t>(p[i])} << (8 * i);
  return v;
}

void append_hash(std::string& out, const BlockHash& hash) {
  out.append(reinterpret_cast<const char*>(hash.bytes.data()), kHashBytes);
}
BlockHash read_hash(const char* p) {
  BlockHash hash;
  std::memcpy(hash.bytes.data(), p, kHashBytes);
  return hash;
}

uint32_t checksum(std::string_view key, std::string_view value_without_crc) {
  return crc32c(value_without_crc, crc32c(key));
}

std::string printable(std::string_view s) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out;
  for (char c : s) {
    const auto u = static_cast<uint8_t>(c);
    if (u >= 0x20 && u < 0x7f && c != '\\') {
      out += c;
    } else {
      out += "\\x";
      out += kDigits[u >> 4];
      out += kDigits[u & 15];
    }
  }
  return out;
}

}  // namespace

uint32_t crc32c(std::string_view bytes, uint32_t crc) {
  crc = ~crc;
  for (char c : bytes) crc = kCrcTable[(crc ^ static_cast<uint8_t>(c)) & 0xff] ^ (crc >> 8);
  return ~crc;
}

std::string entry_prefix(const BlockHash& hash) {
  std::string key;
  key.reserve(kEntryPrefixBytes);
  key.push_back(kEntryTag);
  append_hash(key, hash);
  return key;
}

std::string entry_key(const BlockHash& hash, std::string_view worker) {
  std::string key = entry_prefix(hash);
  key.append(worker);
  return key;
}

std::string worker_prefix(std::string_view worker) {
  std::string key;
  key.reserve(3 + worker.size() + kHashBytes);
  key.push_back(kWorkerTag);
  key.push_back(static_cast<char>(worker.size() >> 8));
  key.push_back(static_cast<char>(worker.size() & 0xff));
  key.append(worker);
  return key;
}

std::string worker_key(std::string_view worker, const BlockHash& hash) {
  std::string key = worker_prefix(worker);
  append_hash(key, hash);
  return key;
}

std::string epoch_key(std::string_view worker) {
  std::string key(1, kEpochTag);
  key.append(worker);
  return key;
}

std::string prefix_successor(std::string_view prefix) {
  std::string next(prefix);
  while (!next.empty() && static_cast<uint8_t>(next.back()) == 0xff) next.pop_back();
  if (!next.empty()) next.back() = static_cast<char>(static_cast<uint8_t>(next.back()) + 1);
  return next;
}

Result<EntryKey> decode_entry_key(std::string_view key) {
  if (key.size() <= kEntryPrefixBytes || key[0] != kEntryTag) {
    return data_loss("malformed entry key (" + std::to_string(key.size()) + " bytes)");
  }
  const std::string_view worker = key.substr(kEntryPrefixBytes);
  if (worker.size() > kMaxWorkerNameBytes) return data_loss("entry key: worker name too long");
  return EntryKey{read_hash(key.data() + 1), worker};
}

Result<WorkerKey> decode_worker_key(std::string_view key) {
  if (key.size() < 3 + kHashBytes || key[0] != kWorkerTag) {
    return data_loss("malformed by-worker key (" + std::to_string(key.size()) + " bytes)");
  }
  const size_t length = (size_t{static_cast<uint8_t>(key[1])} << 8) | static_cast<uint8_t>(key[2]);
  if (length == 0 || length > kMaxWorkerNameBytes || key.size() != 3 + length + kHashBytes) {
    return data_loss("by-worker key: worker length " + std::to_string(length) + " does not fit a key of " +
                     std::to_string(key.size()) + " bytes");
  }
  return WorkerKey{key.substr(3, length), read_hash(key.data() + 3 + length)};
}

Result<std::string_view> decode_epoch_key(std::string_view key) {
  if (key.size() < 2 || key.size() > 1 + kMaxWorkerNameBytes || key[0] != kEpochTag) {
    return data_loss("malformed epoch key (" + std::to_string(key.size()) + " bytes)");
  }
  return key.substr(1);
}

std::string encode_entry_value(std::string_view key, const EntryValue& value) {
  std::string out;
  out.reserve(kEntryFixedBytes + value.cache_namespace.size());
  out.push_back(static_cast<char>(kEntryVersion));
  out.push_back(static_cast<char>(value.has_checkpoint ? 1 : 0));
  put_u64(out, value.epoch);
  put_u64(out, static_cast<uint64_t>(value.block_index));
  put_u64(out, static_cast<uint64_t>(value.last_use_ms));
  out.push_back(static_cast<char>(value.cache_namespace.size() & 0xff));
  out.push_back(static_cast<char>(value.cache_namespace.size() >> 8));
  out.append(value.cache_namespace);
  put_u32(out, checksum(key, out));
  return out;
}

Result<EntryValue> decode_entry_value(std::string_view key, std::string_view value) {
  if (value.size() < kEntryFixedBytes) {
    return data_loss("entry value too short (" + std::to_string(value.size()) + " bytes)");
  }
  const std::string_view body = value.substr(0, value.size() - 4);
  if (get_u32(value.data() + body.size()) != checksum(key, body)) return data_loss("entry value checksum mismatch");
  if (static_cast<uint8_t>(value[0]) != kEntryVersion) {
    return data_loss("entry value version " + std::to_string(static_cast<uint8_t>(value[0])) + " (expected 1)");
  }
  const auto flags = static_cast<uint8_t>(value[1]);
  if (flags > 1) return data_loss("entry value has unknown flags " + std::to_string(flags));
  EntryValue out;
  out.has_checkpoint = flags == 1;
  out.epoch = get_u64(value.data() + 2);
  const uint64_t block_index = get_u64(value.data() + 10);
  if (block_index < 1 || block_index > static_cast<uint64_t>(kMaxBlockIndex)) {
    return data_loss("entry value block index " + std::to_string(block_index) + " out of range");
  }
  out.block_index = static_cast<int64_t>(block_index);
  out.last_use_ms = static_cast<int64_t>(get_u64(value.data() + 18));
  const size_t ns_length = size_t{static_cast<uint8_t>(value[26])} | (size_t{static_cast<uint8_t>(value[27])} << 8);
  if (ns_length > kMaxNamespaceBytes || kEntryFixedBytes + ns_length != value.size()) {
    return data_loss("entry value namespace length " + std::to_string(ns_length) + " does not fit a value of " +
                     std::to_string(value.size()) + " bytes");
  }
  out.cache_namespace = value.substr(28, ns_length);
  return out;
}

std::string encode_epoch_value(std::string_view key, uint64_t epoch) {
  std::string out;
  out.reserve(kEpochValueBytes);
  out.push_back(static_cast<char>(kEpochVersion));
  put_u64(out, epoch);
  put_u32(out, checksum(key, out));
  return out;
}

Result<uint64_t> decode_epoch_value(std::string_view key, std::string_view value) {
  if (value.size() != kEpochValueBytes) {
    return data_loss("epoch value has " + std::to_string(value.size()) + " bytes (expected 13)");
  }
  if (get_u32(value.data() + 9) != checksum(key, value.substr(0, 9))) return data_loss("epoch value checksum mismatch");
  if (static_cast<uint8_t>(value[0]) != kEpochVersion) {
    return data_loss("epoch value version " + std::to_string(static_cast<uint8_t>(value[0])) + " (expected 1)");
  }
  return get_u64(value.data() + 1);
}

std::string describe_key(std::string_view key) {
  if (auto entry = decode_entry_key(key); entry.is_ok()) {
    return "b:" + entry->hash.hex() + "/" + printable(entry->worker);
  }
  if (auto by_worker = decode_worker_key(key); by_worker.is_ok()) {
    return "w:" + printable(by_worker->worker) + "/" + by_worker->hash.hex();
  }
  if (auto epoch = decode_epoch_key(key); epoch.is_ok()) return "e:" + printable(*epoch);
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out = "0x";
  for (char c : key) {
    out += kDigits[static_cast<uint8_t>(c) >> 4];
    out += kDigits[static_cast<uint8_t>(c) & 15];
  }
  return out;
}

}  // namespace deltaserve::kvstore::index_format

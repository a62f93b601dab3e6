#include "router/api_keys.hpp"

#include <cmath>
#include <fstream>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

namespace deltaserve::router {
namespace {

using nlohmann::json;

Status field_error(std::string_view file_label, const std::string& field, const std::string& what) {
  return invalid_argument(std::string(file_label) + ": " + field + ": " + what);
}

std::optional<Sha256Digest> parse_hex_digest(std::string_view hex) {
  if (hex.size() != 64) return std::nullopt;
  Sha256Digest digest;
  auto nibble = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  for (size_t i = 0; i < 32; ++i) {
    const int hi = nibble(hex[2 * i]);
    const int lo = nibble(hex[2 * i + 1]);
    if (hi < 0 || lo < 0) return std::nullopt;
    digest[i] = static_cast<uint8_t>(hi * 16 + lo);
  }
  return digest;
}

// A "limits" object (api_keys.hpp); `at` is its field path for errors.
Result<TenantLimits> parse_limits(std::string_view file_label, const std::string& at, const json& value) {
  if (!value.is_object()) return field_error(file_label, at, "must be an object");
  TenantLimits limits;
  for (const auto& [key, field] : value.items()) {
    const std::string where = at + "." + key;
    if (key == "requests_per_second") {
      if (!field.is_number() || !(field.get<double>() > 0) || !std::isfinite(field.get<double>())) {
        return field_error(file_label, where, "must be a number > 0");
      }
      limits.requests_per_second = field.get<double>();
    } else if (key == "tokens_per_minute" || key == "max_concurrent") {
      if (!field.is_number_integer() || field.get<int64_t>() <= 0) {
        return field_error(file_label, where, "must be an integer > 0");
      }
      (key == "tokens_per_minute" ? limits.tokens_per_minute : limits.max_concurrent) = field.get<int64_t>();
    } else if (key == "priority") {
      const std::string name = field.is_string() ? field.get<std::string>() : "";
      if (name == "high") {
        limits.priority = Priority::kHigh;
      } else if (name == "normal") {
        limits.priority = Priority::kNormal;
      } else if (name == "low") {
        limits.priority = Priority::kLow;
      } else {
        return field_error(file_label, where, "must be \"high\", \"normal\" or \"low\"");
      }
    } else {
      return field_error(file_label, where,
                         "unknown limit (known: requests_per_second, tokens_per_minute, max_concurrent, priority)");
    }
  }
  return limits;
}

}  // namespace

ApiKeys ApiKeys::open() {
  return ApiKeys();
}

Result<ApiKeys> ApiKeys::load(const std::filesystem::path& file) {
  std::ifstream in(file, std::ios::binary);
  if (!in) return io_error(file.string() + ": cannot open the API keys file");
  std::ostringstream content;
  content << in.rdbuf();
  if (in.bad()) return io_error(file.string() + ": read failed");
  return parse(content.str(), file.string());
}

Result<ApiKeys> ApiKeys::parse(std::string_view json_text, std::string_view file_label) {
  const json doc = json::parse(json_text, nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded()) return invalid_argument(std::string(file_label) + ": not valid JSON");
  if (!doc.is_object() || !doc.contains("tenants")) return field_error(file_label, "tenants", "missing");
  const json& tenants = doc["tenants"];
  if (!tenants.is_array()) return field_error(file_label, "tenants", "must be a list");
  if (tenants.empty()) return field_error(file_label, "tenants", "is empty (omit the keys file to disable keys)");
  ApiKeys keys;
  keys.enabled_ = true;
  std::set<Sha256Digest> seen;
  for (size_t i = 0; i < tenants.size(); ++i) {
    const std::string at = "tenants[" + std::to_string(i) + "]";
    const json& entry = tenants[i];
    if (!entry.is_object()) return field_error(file_label, at, "must be an object");
    const auto name = entry.find("name");
    if (name == entry.end() || !name->is_string() || name->get_ref<const std::string&>().empty()) {
      return field_error(file_label, at + ".name", "must be a non-empty string");
    }
    const auto hash = entry.find("api_key_sha256");
    if (hash == entry.end() || !hash->is_string()) {
      return field_error(file_label, at + ".api_key_sha256", "must be a string of 64 hex digits");
    }
    const auto digest = parse_hex_digest(hash->get_ref<const std::string&>());
    if (!digest) return field_error(file_label, at + ".api_key_sha256", "must be 64 hex digits (a SHA-256)");
    if (!seen.insert(*digest).second) return field_error(file_label, at + ".api_key_sha256", "duplicate key");
    std::string cache_namespace = name->get<std::string>();
    if (const auto ns = entry.find("cache_namespace"); ns != entry.end()) {
      if (!ns->is_string() || ns->get_ref<const std::string&>().empty()) {
        return field_error(file_label, at + ".cache_namespace", "must be a non-empty string");
      }
      cache_namespace = ns->get<std::string>();
    }
    TenantLimits limits;
    const auto limits_field = entry.find("limits");
    const bool has_limits = limits_field != entry.end();
    if (has_limits) {
      auto parsed = parse_limits(file_label, at + ".limits", *limits_field);
      if (!parsed.is_ok()) return parsed.status();
      limits = *parsed;
    }
    for (const Entry& other : keys.entries_) {
      if (other.tenant != name->get_ref<const std::string&>()) continue;
      if (other.cache_namespace != cache_namespace) {
        return field_error(file_label, at + ".cache_namespace",
                           "differs from an earlier entry of tenant '" + other.tenant + "'");
      }
      if (other.has_limits != has_limits || !(other.limits == limits)) {
        return field_error(file_label, at + ".limits",
                           "differs from an earlier entry of tenant '" + other.tenant + "'");
      }
    }
    keys.entries_.push_back({*digest, name->get<std::string>(), std::move(cache_namespace), limits, has_limits});
  }
  return keys;
}

std::optional<std::string> ApiKeys::tenant_for(std::string_view bearer_key) const {
  if (!enabled_) return std::string(kDefaultTenant);
  const Sha256Digest digest = sha256(bearer_key);
  const std::string_view given(reinterpret_cast<const char*>(digest.data()), digest.size());
  const Entry* match = nullptr;
  for (const Entry& entry : entries_) {  // no early exit: every entry is compared
    const std::string_view stored(reinterpret_cast<const char*>(entry.digest.data()), entry.digest.size());
    if (constant_time_equal(given, stored)) match = &entry;
  }
  if (match == nullptr || bearer_key.empty()) return std::nullopt;
  return match->tenant;
}

std::string ApiKeys::cache_namespace_of(std::string_view tenant) const {
  for (const Entry& entry : entries_) {
    if (entry.tenant == tenant) return entry.cache_namespace;
  }
  return std::string(tenant);
}

std::map<std::string, TenantLimits, std::less<>> ApiKeys::limits() const {
  std::map<std::string, TenantLimits, std::less<>> out;
  for (const Entry& entry : entries_) {
    if (entry.has_limits) out.emplace(entry.tenant, entry.limits);
  }
  return out;
}

std::optional<std::string_view> parse_bearer(std::string_view authorization) {
  constexpr std::string_view kScheme = "bearer";
  while (!authorization.empty() && authorization.front() == ' ') authorization.remove_prefix(1);
  if (authorization.size() <= kScheme.size() || authorization[kScheme.size()] != ' ') return std::nullopt;
  for (size_t i = 0; i < kScheme.size(); ++i) {
    const char c = authorization[i];
    if ((c >= 'A' && c <= 'Z' ? static_cast<char>(c - 'A' + 'a') : c) != kScheme[i]) return std::nullopt;
  }
  std::string_view key = authorization.substr(kScheme.size());
  while (!key.empty() && key.front() == ' ') key.remove_prefix(1);
  while (!key.empty() && (key.back() == ' ' || key.back() == '\t')) key.remove_suffix(1);
  if (key.empty()) return std::nullopt;
  return key;
}

}  // namespace deltaserve::router

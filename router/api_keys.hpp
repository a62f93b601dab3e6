// Bearer API keys mapped to tenants. Keys are stored only as SHA-256 digests (hex in the file),
// compared in constant time against every configured key, and never logged.
//
// Keys file (JSON):
//   {"tenants": [{"name": "acme", "api_key_sha256": "<64 hex digits>"}, ...]}
// `name` is the tenant: non-empty. Optional "cache_namespace": the prefix-cache namespace of the tenant
// (default: the tenant's name); tenants that name the same namespace share cached prompts, all others
// are isolated. A tenant's entries must agree on it. Several keys may map to one tenant (repeat the
// entry); the same digest twice is an error. Make a digest with `printf %s "$KEY" | sha256sum`.
// Optional "limits" (admission.hpp says how each is applied; every field optional, absent = unlimited):
//   "limits": {"requests_per_second": R (number > 0), "tokens_per_minute": T (integer > 0),
//              "max_concurrent": C (integer > 0), "priority": "high" | "normal" | "low" (default "normal")}
// A tenant's entries must agree on its limits (an entry without "limits" means none).
#pragma once

#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.hpp"
#include "router/admission.hpp"
#include "router/sha256.hpp"

namespace deltaserve::router {

inline constexpr std::string_view kDefaultTenant = "default";

class ApiKeys {
 public:
  // No keys: authentication is off and every caller is tenant "default".
  static ApiKeys open();

  // Reads the keys file. InvalidArgument/IoError naming the file and the offending field
  // ("keys.json: tenants[2].api_key_sha256: ...").
  static Result<ApiKeys> load(const std::filesystem::path& file);

  // Parses the file's content; `file_label` prefixes errors.
  static Result<ApiKeys> parse(std::string_view json_text, std::string_view file_label);

  // The tenant whose key this is; nullopt = reject (401). With keys disabled: always "default".
  // Time depends on the number of keys only, not on which byte differs.
  std::optional<std::string> tenant_for(std::string_view bearer_key) const;

  // The prefix-cache namespace of an authenticated tenant: its configured one, else the tenant name.
  std::string cache_namespace_of(std::string_view tenant) const;

  // The limits of every tenant that has a "limits" object, by tenant name (for Admission).
  std::map<std::string, TenantLimits, std::less<>> limits() const;

  bool enabled() const { return enabled_; }
  size_t size() const { return entries_.size(); }

 private:
  struct Entry {
    Sha256Digest digest;
    std::string tenant;
    std::string cache_namespace;
    TenantLimits limits;
    bool has_limits = false;
  };

  bool enabled_ = false;
  std::vector<Entry> entries_;
};

// The key of an `Authorization: Bearer <key>` header value; nullopt when the scheme is not Bearer
// (case-insensitive) or the key is empty.
std::optional<std::string_view> parse_bearer(std::string_view authorization);

}  // namespace deltaserve::router

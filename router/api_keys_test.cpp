#include "router/api_keys.hpp"

#include <filesystem>
#include <fstream>

#include <gtest/gtest.h>

namespace deltaserve::router {
namespace {

std::string keys_json() {
  return R"({"tenants": [{"name": "acme", "api_key_sha256": ")" + sha256_hex("sk-acme") +
         R"("}, {"name": "globex", "api_key_sha256": ")" + sha256_hex("sk-globex") + R"("}]})";
}

TEST(ApiKeysTest, OpenAcceptsEveryoneAsDefault) {
  const ApiKeys keys = ApiKeys::open();
  EXPECT_FALSE(keys.enabled());
  EXPECT_EQ(keys.tenant_for(""), "default");
  EXPECT_EQ(keys.tenant_for("anything"), "default");
}

TEST(ApiKeysTest, MapsKeysToTenantsAndRejectsOthers) {
  auto keys = ApiKeys::parse(keys_json(), "keys.json");
  ASSERT_TRUE(keys.is_ok()) << keys.status().to_string();
  EXPECT_TRUE(keys->enabled());
  EXPECT_EQ(keys->tenant_for("sk-acme"), "acme");
  EXPECT_EQ(keys->tenant_for("sk-globex"), "globex");
  EXPECT_EQ(keys->tenant_for("sk-acme "), std::nullopt);
  EXPECT_EQ(keys->tenant_for(""), std::nullopt);
  EXPECT_EQ(keys->tenant_for(sha256_hex("sk-acme")), std::nullopt);  // the digest is not the key
}

TEST(ApiKeysTest, CacheNamespacesDefaultToTheTenantAndCanBeShared) {
  const std::string text = R"({"tenants": [{"name": "acme", "api_key_sha256": ")" + sha256_hex("sk-acme") +
                           R"(", "cache_namespace": "shared"}, {"name": "initech", "api_key_sha256": ")" +
                           sha256_hex("sk-initech") + R"(", "cache_namespace": "shared"}, {"name": "globex", )" +
                           R"("api_key_sha256": ")" + sha256_hex("sk-globex") + R"("}]})";
  auto keys = ApiKeys::parse(text, "keys.json");
  ASSERT_TRUE(keys.is_ok()) << keys.status().to_string();
  EXPECT_EQ(keys->cache_namespace_of("acme"), "shared");
  EXPECT_EQ(keys->cache_namespace_of("initech"), "shared");
  EXPECT_EQ(keys->cache_namespace_of("globex"), "globex");
  EXPECT_EQ(ApiKeys::open().cache_namespace_of("default"), "default");

  const std::string conflicting = R"({"tenants": [{"name": "a", "api_key_sha256": ")" + sha256_hex("k1") +
                                  R"(", "cache_namespace": "x"}, {"name": "a", "api_key_sha256": ")" +
                                  sha256_hex("k2") + R"(", "cache_namespace": "y"}]})";
  auto bad = ApiKeys::parse(conflicting, "keys.json");
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.status().message().find("tenants[1].cache_namespace"), std::string::npos);
  auto empty = ApiKeys::parse(
      R"({"tenants": [{"name": "a", "api_key_sha256": ")" + sha256_hex("k1") + R"(", "cache_namespace": ""}]})",
      "keys.json");
  ASSERT_FALSE(empty.is_ok());
  EXPECT_NE(empty.status().message().find("tenants[0].cache_namespace"), std::string::npos);
}

TEST(ApiKeysTest, LoadReadsFileAndErrorsNameFileAndField) {
  const auto dir = std::filesystem::temp_directory_path() / ("ds_keys_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const auto file = dir / "keys.json";
  std::ofstream(file) << keys_json();
  auto loaded = ApiKeys::load(file);
  ASSERT_TRUE(loaded.is_ok()) << loaded.status().to_string();
  EXPECT_EQ(loaded->size(), 2u);

  struct Case {
    std::string text;
    std::string field;
  };
  const Case cases[] = {
      {"not json", "not valid JSON"},
      {"{}", "tenants"},
      {R"({"tenants": 3})", "tenants"},
      {R"({"tenants": []})", "tenants"},
      {R"({"tenants": [{"api_key_sha256": "00"}]})", "tenants[0].name"},
      {R"({"tenants": [{"name": "a", "api_key_sha256": "zz"}]})", "tenants[0].api_key_sha256"},
      {R"({"tenants": [{"name": "a", "api_key_sha256": ")" + sha256_hex("k") +
           R"("}, {"name": "b", "api_key_sha256": ")" + sha256_hex("k") + R"("}]})",
       "tenants[1].api_key_sha256"},
  };
  for (const Case& c : cases) {
    std::ofstream(file, std::ios::trunc) << c.text;
    auto bad = ApiKeys::load(file);
    ASSERT_FALSE(bad.is_ok()) << c.text;
    EXPECT_NE(bad.status().message().find(file.string()), std::string::npos) << bad.status().message();
    EXPECT_NE(bad.status().message().find(c.field), std::string::npos) << bad.status().message();
  }
  EXPECT_EQ(ApiKeys::load(dir / "missing.json").status().code(), StatusCode::kIoError);
  std::filesystem::remove_all(dir);
}

std::string with_limits(const std::string& limits, const std::string& second_limits = "") {
  std::string text =
      R"({"tenants": [{"name": "acme", "api_key_sha256": ")" + sha256_hex("k1") + R"(", "limits": )" + limits + "}";
  if (!second_limits.empty()) {
    text += R"(, {"name": "acme", "api_key_sha256": ")" + sha256_hex("k2") + R"(", "limits": )" + second_limits + "}";
  }
  return text + "]}";
}

TEST(ApiKeysTest, LimitsPerTenant) {
  auto keys = ApiKeys::parse(
      with_limits(
          R"({"requests_per_second": 2.5, "tokens_per_minute": 6000, "max_concurrent": 4, "priority": "high"})"),
      "keys.json");
  ASSERT_TRUE(keys.is_ok()) << keys.status().to_string();
  const auto limits = keys->limits();
  ASSERT_EQ(limits.size(), 1u);
  EXPECT_EQ(limits.at("acme"), (TenantLimits{2.5, 6000, 4, Priority::kHigh}));
  // Every field is optional; a tenant without "limits" has none.
  auto partial = ApiKeys::parse(with_limits(R"({"priority": "low"})"), "keys.json");
  ASSERT_TRUE(partial.is_ok()) << partial.status().to_string();
  EXPECT_EQ(partial->limits().at("acme"), (TenantLimits{0, 0, 0, Priority::kLow}));
  EXPECT_TRUE(ApiKeys::parse(keys_json(), "keys.json")->limits().empty());
  // A tenant's entries agree.
  EXPECT_TRUE(ApiKeys::parse(with_limits(R"({"max_concurrent": 1})", R"({"max_concurrent": 1})"), "k").is_ok());

  struct Case {
    std::string text;
    std::string field;
  };
  const Case cases[] = {
      {with_limits("3"), "tenants[0].limits: must be an object"},
      {with_limits(R"({"requests_per_second": 0})"), "tenants[0].limits.requests_per_second"},
      {with_limits(R"({"requests_per_second": "5"})"), "tenants[0].limits.requests_per_second"},
      {with_limits(R"({"tokens_per_minute": 1.5})"), "tenants[0].limits.tokens_per_minute"},
      {with_limits(R"({"tokens_per_minute": -1})"), "tenants[0].limits.tokens_per_minute"},
      {with_limits(R"({"max_concurrent": 0})"), "tenants[0].limits.max_concurrent"},
      {with_limits(R"({"priority": "urgent"})"), "tenants[0].limits.priority"},
      {with_limits(R"({"rpm": 5})"), "tenants[0].limits.rpm: unknown limit"},
      {with_limits(R"({"max_concurrent": 1})", R"({"max_concurrent": 2})"), "tenants[1].limits: differs"},
  };
  for (const Case& c : cases) {
    auto bad = ApiKeys::parse(c.text, "keys.json");
    ASSERT_FALSE(bad.is_ok()) << c.text;
    EXPECT_EQ(bad.status().message().rfind("keys.json: ", 0), 0u) << bad.status().message();
    EXPECT_NE(bad.status().message().find(c.field), std::string::npos) << bad.status().message();
  }
}

TEST(ApiKeysTest, ParseBearer) {
  EXPECT_EQ(parse_bearer("Bearer sk-1"), "sk-1");
  EXPECT_EQ(parse_bearer("bearer   sk-1  "), "sk-1");
  EXPECT_EQ(parse_bearer("Basic abc"), std::nullopt);
  EXPECT_EQ(parse_bearer("Bearer "), std::nullopt);
  EXPECT_EQ(parse_bearer("Bearer"), std::nullopt);
  EXPECT_EQ(parse_bearer(""), std::nullopt);
}

}  // namespace
}  // namespace deltaserve::router

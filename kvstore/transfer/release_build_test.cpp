// Links the release library (ds_kvstore_transfer): fault injection must be compiled out there.
#include <gtest/gtest.h>

#include "kvstore/transfer/fault_injection.hpp"
#include "kvstore/transfer/transfer_engine.hpp"

namespace deltaserve::kvstore::transfer {
namespace {

TEST(TransferReleaseBuild, FaultInjectionIsCompiledOut) {
  EXPECT_FALSE(kFaultInjectionCompiled);
  EXPECT_FALSE(parse_faults("send.drop_piece:1").is_ok());
  EngineConfig config;
  config.tls = "posix,self";
  config.faults = "send.drop_piece:1";
  auto engine = TransferEngine::create(config);
  ASSERT_FALSE(engine.is_ok());
  EXPECT_EQ(engine.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(engine.status().message().find("compiled out"), std::string::npos);
  config.faults.clear();
  EXPECT_TRUE(TransferEngine::create(config).is_ok());
}

}  // namespace
}  // namespace deltaserve::kvstore::transfer

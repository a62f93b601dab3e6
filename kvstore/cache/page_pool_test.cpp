#include "kvstore/cache/page_pool.hpp"

#include <random>

#include <gtest/gtest.h>

namespace deltaserve::kvstore {
namespace {

constexpr int64_t kWidth = 3;

// The reference: a request's rows kept contiguously.
struct Reference {
  std::vector<float> rows;
  int64_t tokens() const { return static_cast<int64_t>(rows.size()) / kWidth; }
};

std::vector<float> random_rows(int64_t n, std::mt19937& rng) {
  std::vector<float> r(static_cast<size_t>(n * kWidth));
  for (float& x : r) x = static_cast<float>(rng() % 100000) * 0.5f;
  return r;
}

void expect_same(const PagePool& pool, const PageTable& table, const Reference& ref, const char* what) {
  ASSERT_EQ(table.num_tokens(), ref.tokens()) << what;
  for (int64_t t = 0; t < ref.tokens(); ++t) {
    const auto row = table.row(pool, t);
    for (int64_t v = 0; v < kWidth; ++v) {
      ASSERT_EQ(row[static_cast<size_t>(v)], ref.rows[static_cast<size_t>(t * kWidth + v)]) << what << " token " << t;
    }
  }
}

PagePoolConfig config(int64_t pages) {
  return {1024, pages, kWidth};
}

TEST(PagePool, AppendsInAnyPiecesEqualContiguousRows) {
  PagePool pool(config(8));
  std::mt19937 rng(1);
  PageTable table;
  Reference ref;
  for (int64_t piece : {1, 1023, 1, 500, 2000, 7, 1024}) {
    const auto rows = random_rows(piece, rng);
    ASSERT_TRUE(table.append(pool, rows).is_ok());
    ref.rows.insert(ref.rows.end(), rows.begin(), rows.end());
    EXPECT_EQ(static_cast<int64_t>(table.pages().size()), (ref.tokens() + 1023) / 1024);
    EXPECT_EQ(pool.free_pages(), 8 - static_cast<int64_t>(table.pages().size()));
  }
  expect_same(pool, table, ref, "append");
  table.release(pool);
  EXPECT_EQ(pool.free_pages(), 8);
}

TEST(PagePool, SharedPrefixesAreCopiedBeforeWrites) {
  PagePool pool(config(10));
  std::mt19937 rng(2);
  PageTable source;
  Reference source_ref;
  source_ref.rows = random_rows(2500, rng);  // pages: 1024 + 1024 + 452
  ASSERT_TRUE(source.append(pool, source_ref.rows).is_ok());

  for (int64_t shared : {int64_t{0}, int64_t{1024}, int64_t{1500}, int64_t{2048}, int64_t{2500}}) {
    const int64_t free_before = pool.free_pages();
    PageTable reader = PageTable::share_prefix(pool, source, shared);
    EXPECT_EQ(pool.free_pages(), free_before) << "sharing allocates nothing";
    Reference reader_ref;
    reader_ref.rows.assign(source_ref.rows.begin(), source_ref.rows.begin() + shared * kWidth);
    const auto more = random_rows(700, rng);
    ASSERT_TRUE(reader.append(pool, more).is_ok());
    reader_ref.rows.insert(reader_ref.rows.end(), more.begin(), more.end());
    expect_same(pool, reader, reader_ref, "reader");
    expect_same(pool, source, source_ref, "source after the reader wrote");  // copy on write held
    // Full pages before the shared boundary are still the source's own pages.
    for (int64_t p = 0; p < shared / 1024; ++p) {
      EXPECT_EQ(reader.pages()[static_cast<size_t>(p)], source.pages()[static_cast<size_t>(p)]);
      EXPECT_EQ(pool.refcount(source.pages()[static_cast<size_t>(p)]), 2);
    }
    reader.release(pool);
    EXPECT_EQ(pool.free_pages(), free_before);
    for (PageId page : source.pages()) EXPECT_EQ(pool.refcount(page), 1);
  }
  source.release(pool);
  EXPECT_EQ(pool.free_pages(), 10);
}

TEST(PagePool, ExhaustionLeavesTheTableUnchanged) {
  PagePool pool(config(2));
  std::mt19937 rng(3);
  PageTable table;
  Reference ref;
  ref.rows = random_rows(1500, rng);
  ASSERT_TRUE(table.append(pool, ref.rows).is_ok());
  const Status full = table.append(pool, random_rows(1000, rng));  // needs a third page
  EXPECT_EQ(full.code(), StatusCode::kResourceExhausted);
  expect_same(pool, table, ref, "after a failed append");
  EXPECT_EQ(pool.free_pages(), 0);

  PageTable reader = PageTable::share_prefix(pool, table, 1200);
  EXPECT_EQ(reader.append(pool, random_rows(1, rng)).code(), StatusCode::kResourceExhausted);  // no page to copy to
  EXPECT_EQ(reader.num_tokens(), 1200);
  reader.release(pool);
  table.release(pool);
  EXPECT_EQ(pool.free_pages(), 2);
}

TEST(PagePool, ConfigValidationNamesTheField) {
  EXPECT_TRUE(validate({2048, 4, 576}).is_ok());
  EXPECT_NE(validate({1000, 4, 576}).message().find("page_tokens"), std::string::npos);
  EXPECT_NE(validate({8192, 4, 576}).message().find("page_tokens"), std::string::npos);
  EXPECT_NE(validate({2048, 0, 576}).message().find("num_pages"), std::string::npos);
  EXPECT_NE(validate({2048, 4, 0}).message().find("row_values"), std::string::npos);
}

}  // namespace
}  // namespace deltaserve::kvstore

// MLA latent pages for the prefix cache. Memory is allocated in page groups of `page_tokens` tokens
// (1024–6144, a multiple of the 512-token hash block, so page tables stay short and transfers large);
// a page holds `row_values` floats per token (all MLA layers' [latent ‖ k_rot] rows side by side).
// Pages are reference-counted: requests with the same prefix share them read-only; a request that
// writes into a shared, partly filled page first gets its own copy (copy on write).
//
// Not thread-safe: one pool per worker, used from that worker's actor.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "common/status.hpp"

namespace deltaserve::kvstore {

using PageId = int32_t;

struct PagePoolConfig {
  int64_t page_tokens = 2048;  // tokens per page group: multiple of 512, in [1024, 6144]
  int64_t num_pages = 0;       // pool size in pages (the memory budget for MLA pages)
  int64_t row_values = 0;      // floats per token per page
};

Status validate(const PagePoolConfig& config);

class PagePool {
 public:
  explicit PagePool(const PagePoolConfig& config);  // config must pass validate()

  // A page with reference count 1; kResourceExhausted when none is free.
  Result<PageId> allocate();
  void retain(PageId page);
  void release(PageId page);  // at 0 the page returns to the free list

  int32_t refcount(PageId page) const { return refcounts_[static_cast<size_t>(page)]; }
  int64_t free_pages() const { return static_cast<int64_t>(free_.size()); }
  int64_t num_pages() const { return config_.num_pages; }
  const PagePoolConfig& config() const { return config_; }

  // [page_tokens, row_values] floats of `page`.
  std::span<float> data(PageId page);
  std::span<const float> data(PageId page) const;

 private:
  PagePoolConfig config_;
  std::vector<float> storage_;
  std::vector<int32_t> refcounts_;
  std::vector<PageId> free_;  // LIFO: recently freed pages are reused first (warm in cache)
};

// One request's pages: token t lives in pages[t / page_tokens] at row t % page_tokens.
class PageTable {
 public:
  PageTable() = default;
  PageTable(const PageTable&) = delete;
  PageTable& operator=(const PageTable&) = delete;
  PageTable(PageTable&&) noexcept = default;
  PageTable& operator=(PageTable&&) noexcept = default;
  ~PageTable();  // the table must have been released (assert): pages are counted, not leaked

  // A table reading the first `tokens` tokens of `source` (shared pages, retained). tokens <= source's.
  static PageTable share_prefix(PagePool& pool, const PageTable& source, int64_t tokens);

  // Appends rows ([n, row_values] floats); allocates pages as needed and copies a shared last page
  // before writing into it. On kResourceExhausted nothing was appended.
  Status append(PagePool& pool, std::span<const float> rows);

  // Row of token `t` (t < num_tokens()).
  std::span<const float> row(const PagePool& pool, int64_t t) const;

  void release(PagePool& pool);  // drops every page reference; the table is empty afterwards

  int64_t num_tokens() const { return num_tokens_; }
  const std::vector<PageId>& pages() const { return pages_; }

 private:
  std::vector<PageId> pages_;
  int64_t num_tokens_ = 0;
};

}  // namespace deltaserve::kvstore

#include "kvstore/cache/page_pool.hpp"

#include <algorithm>
#include <cassert>
#include <cstring>

namespace deltaserve::kvstore {

Status validate(const PagePoolConfig& config) {
  if (config.page_tokens < 1024 || config.page_tokens > 6144 || config.page_tokens % 512 != 0) {
    return invalid_argument("page_tokens: " + std::to_string(config.page_tokens) +
                            " is not a multiple of 512 in [1024, 6144]");
  }
  if (config.num_pages <= 0 || config.num_pages > INT32_MAX) {
    return invalid_argument("num_pages: " + std::to_string(config.num_pages) + " is not in [1, 2^31)");
  }
  if (config.row_values <= 0) return invalid_argument("row_values: must be positive");
  return Status::ok();
}

PagePool::PagePool(const PagePoolConfig& config)
    : config_(config),
      storage_(static_cast<size_t>(config.num_pages * config.page_tokens * config.row_values)),
      refcounts_(static_cast<size_t>(config.num_pages), 0) {
  assert(validate(config).is_ok());
  free_.reserve(static_cast<size_t>(config.num_pages));
  for (int64_t p = config.num_pages - 1; p >= 0; --p) free_.push_back(static_cast<PageId>(p));
}

Result<PageId> PagePool::allocate() {
  if (free_.empty()) {
    return Status(StatusCode::kResourceExhausted,
                  "MLA page pool: all " + std::to_string(config_.num_pages) + " pages in use");
  }
  const PageId page = free_.back();
  free_.pop_back();
  refcounts_[static_cast<size_t>(page)] = 1;
  return page;
}

void PagePool::retain(PageId page) {
  assert(refcounts_[static_cast<size_t>(page)] > 0);
  ++refcounts_[static_cast<size_t>(page)];
}

void PagePool::release(PageId page) {
  int32_t& count = refcounts_[static_cast<size_t>(page)];
  assert(count > 0);
  if (--count == 0) free_.push_back(page);
}

std::span<float> PagePool::data(PageId page) {
  const auto size = static_cast<size_t>(config_.page_tokens * config_.row_values);
  return {storage_.data() + static_cast<size_t>(page) * size, size};
}

std::span<const float> PagePool::data(PageId page) const {
  const auto size = static_cast<size_t>(config_.page_tokens * config_.row_values);
  return {storage_.data() + static_cast<size_t>(page) * size, size};
}

PageTable::~PageTable() {
  assert(pages_.empty() && "PageTable destroyed without release()");
}

PageTable PageTable::share_prefix(PagePool& pool, const PageTable& source, int64_t tokens) {
  assert(tokens >= 0 && tokens <= source.num_tokens_);
  const int64_t page_tokens = pool.config().page_tokens;
  PageTable table;
  const int64_t pages = (tokens + page_tokens - 1) / page_tokens;
  for (int64_t p = 0; p < pages; ++p) {
    const PageId page = source.pages_[static_cast<size_t>(p)];
    pool.retain(page);
    table.pages_.push_back(page);
  }
  table.num_tokens_ = tokens;
  return table;
}

Status PageTable::append(PagePool& pool, std::span<const float> rows) {
  const int64_t width = pool.config().row_values, page_tokens = pool.config().page_tokens;
  assert(static_cast<int64_t>(rows.size()) % width == 0);
  const int64_t n = static_cast<int64_t>(rows.size()) / width;
  if (n == 0) return Status::ok();

  // Reserve everything first so a failure leaves the table as it was.
  const int64_t offset = num_tokens_ % page_tokens;
  const bool into_last = offset != 0;
  const bool copy_last = into_last && pool.refcount(pages_.back()) > 1;
  const int64_t room_in_last = into_last ? page_tokens - offset : 0;
  const int64_t new_pages = std::max<int64_t>(0, (n - room_in_last + page_tokens - 1) / page_tokens);
  std::vector<PageId> fresh;
  for (int64_t i = 0; i < new_pages + (copy_last ? 1 : 0); ++i) {
    auto page = pool.allocate();
    if (!page.is_ok()) {
      for (PageId p : fresh) pool.release(p);
      return page.status();
    }
    fresh.push_back(*page);
  }
  size_t next_fresh = 0;
  if (copy_last) {  // copy on write: this request's rows must not show up in the other readers' page
    const PageId copy = fresh[next_fresh++];
    const auto src = pool.data(pages_.back());
    std::memcpy(pool.data(copy).data(), src.data(), sizeof(float) * static_cast<size_t>(offset * width));
    pool.release(pages_.back());
    pages_.back() = copy;
  }
  for (int64_t t = 0; t < n; ++t) {
    const int64_t position = num_tokens_ + t, in_page = position % page_tokens;
    if (in_page == 0) pages_.push_back(fresh[next_fresh++]);
    std::memcpy(pool.data(pages_.back()).data() + in_page * width, rows.data() + t * width,
                sizeof(float) * static_cast<size_t>(width));
  }
  num_tokens_ += n;
  return Status::ok();
}

std::span<const float> PageTable::row(const PagePool& pool, int64_t t) const {
  assert(t >= 0 && t < num_tokens_);
  const int64_t page_tokens = pool.config().page_tokens, width = pool.config().row_values;
  return pool.data(pages_[static_cast<size_t>(t / page_tokens)])
      .subspan(static_cast<size_t>((t % page_tokens) * width), static_cast<size_t>(width));
}

void PageTable::release(PagePool& pool) {
  for (PageId page : pages_) pool.release(page);
  pages_.clear();
  num_tokens_ = 0;
}

}  // namespace deltaserve::kvstore

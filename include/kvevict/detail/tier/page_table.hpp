#pragma once
// The page table of one row's host tier: tier tokens are grouped into pages by position (page =
// position / page_size), each page holds a page slot, and each slot keeps its page's digest (a
// Digest block, quest_digest.hpp for the interface), kept current as tokens come and go. The
// table knows which tokens are in which page; the digest type knows what a block holds.
//
// Each page's members are an intrusive list over the tier's token indices, so a token leaving
// costs O(its page's members x width), not a scan of the tier. The host path's; the tensor
// path keeps its digests by page id in its TierStore (tier/store.hpp).

#include <kvevict/detail/reduction.hpp>

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace kvevict {
namespace detail {

/// The pages of one row's tier: per page slot, its Digest block and the member list.
template <class Digest>
class PageTable {
 public:
  PageTable() = default;
  /// Pages of `page_size` positions over keys of `groups` vectors of `width` floats.
  PageTable(int64_t page_size, int64_t groups, int64_t width)
      : page_(page_size), digest_(groups, width), F_(digest_.floats()), key_(static_cast<size_t>(groups * width)) {}

  int64_t page_size() const noexcept { return page_; }
  /// Page slots in use or freed (the width P of score()).
  int64_t slots() const noexcept { return static_cast<int64_t>(page_of_.size()); }
  /// Pages with at least one member.
  int64_t pages() const noexcept { return slots() - static_cast<int64_t>(free_.size()); }
  int64_t page_of_slot(int64_t s) const { return page_of_[s]; }
  int64_t members(int64_t s) const { return count_[s]; }
  int64_t head(int64_t s) const { return head_[s]; }
  /// Slot s's digest: Digest::floats() fp32 values laid out as Digest::page_shape().
  const float* block(int64_t s) const { return blocks_.data() + s * F_; }
  int64_t next(int64_t token) const { return next_[token]; }
  /// The digest bytes held.
  int64_t bytes() const noexcept { return slots() * digest_.bytes(); }

  /// Makes room for `tokens` tier tokens and a position up to `max_position`, so that insert(),
  /// erase(), moved() and refresh() allocate nothing until then. Changes nothing.
  void reserve(int64_t tokens, int64_t max_position) {
    const auto grow = [](auto& v, size_t n) {
      if (v.capacity() < n) v.reserve(std::max(n, 2 * v.capacity()));
    };
    const auto t = static_cast<size_t>(tokens);
    const auto pages = static_cast<size_t>(max_position / page_ + 1);
    const auto slots = std::min(t, pages);  // a page slot holds at least one token
    grow(next_, t);
    grow(prev_, t);
    grow(page_of_, slots);
    grow(count_, slots);
    grow(head_, slots);
    grow(free_, slots);
    grow(dirty_, t);
    grow(blocks_, slots * static_cast<size_t>(F_));
    if (slot_of_page_.size() < pages) {
      grow(slot_of_page_, pages);
      slot_of_page_.resize(pages, -1);
    }
  }

  /// Adds tier token `token` at `position` with keys `key` [groups, width] to its page.
  void insert(int64_t token, int64_t position, const float* key) {
    if (static_cast<int64_t>(next_.size()) <= token) {
      next_.resize(static_cast<size_t>(token) + 1, -1);
      prev_.resize(static_cast<size_t>(token) + 1, -1);
    }
    const int64_t page = position / page_;
    int64_t s = slot_of_page_[page];
    if (s < 0) {
      if (!free_.empty()) {
        s = free_.back();
        free_.pop_back();
      } else {
        s = slots();
        page_of_.push_back(-1);
        count_.push_back(0);
        head_.push_back(-1);
        blocks_.resize(blocks_.size() + static_cast<size_t>(F_));
      }
      slot_of_page_[page] = s;
      page_of_[s] = page;
      digest_.start(blocks_.data() + s * F_, key);
    } else {
      digest_.insert(blocks_.data() + s * F_, key);
    }
    prev_[token] = -1;
    next_[token] = head_[s];
    if (head_[s] >= 0) prev_[head_[s]] = token;
    head_[s] = token;
    ++count_[s];
  }

  /// Takes tier token `token` at `position` out of its page; a page left empty frees its slot,
  /// one left with members is rebuilt by the next refresh().
  void erase(int64_t token, int64_t position) {
    const int64_t page = position / page_, s = slot_of_page_[page];
    const int64_t p = prev_[token], x = next_[token];
    if (p >= 0) next_[p] = x; else head_[s] = x;
    if (x >= 0) prev_[x] = p;
    if (--count_[s] == 0) {
      slot_of_page_[page] = -1;
      page_of_[s] = -1;
      head_[s] = -1;
      free_.push_back(s);
    } else {
      dirty_.push_back(s);
    }
  }

  /// Tier token `from` (at `position`) is now token `to` (the tier moved it).
  void moved(int64_t from, int64_t to, int64_t position) {
    const int64_t s = slot_of_page_[position / page_];
    const int64_t p = prev_[from], x = next_[from];
    prev_[to] = p;
    next_[to] = x;
    if (p >= 0) next_[p] = to; else head_[s] = to;
    if (x >= 0) prev_[x] = to;
  }

  /// Rebuilds the digests of the pages that lost members from their members' keys: key_of(token,
  /// out) writes a member's keys [groups, width]. Allocates nothing.
  template <class KeyOf>
  void refresh(KeyOf&& key_of) {
    for (const int64_t s : dirty_) {
      if (count_[s] == 0) continue;  // freed after it was marked
      digest_.rebuild(blocks_.data() + s * F_, [&](auto&& add) {
        for (int64_t t = head_[s]; t >= 0; t = next_[t]) {
          key_of(t, key_.data());
          add(static_cast<const float*>(key_.data()));
        }
      });
    }
    dirty_.clear();
    compact();
  }

  /// Moves the last page slots into the freed ones until no slot is free, so that slots() (what
  /// score() reads and bytes() counts) is the pages in use. Allocates nothing.
  void compact() {
    std::sort(free_.begin(), free_.end());
    size_t next = 0;  // free_[0, next) are filled already
    while (next < free_.size()) {
      const int64_t last = slots() - 1;
      if (free_.back() == last) {  // the last slot is free: drop it
        free_.pop_back();
      } else {  // the last slot is in use: it takes the lowest free slot not yet filled
        const int64_t f = free_[next++];
        page_of_[f] = page_of_[last];
        count_[f] = count_[last];
        head_[f] = head_[last];
        std::copy(blocks_.begin() + last * F_, blocks_.begin() + (last + 1) * F_, blocks_.begin() + f * F_);
        slot_of_page_[page_of_[f]] = f;
      }
      page_of_.pop_back();
      count_.pop_back();
      head_.pop_back();
      blocks_.resize(blocks_.size() - static_cast<size_t>(F_));
    }
    free_.clear();
  }

  /// scale * (the digest's bound) of queries q [groups, M, width] (fp32, CPU) on every slot's
  /// page: [groups, M, P] fp32 (P = slots()). For the latent layout M is every head's query; for
  /// the expanded layout head g's queries meet key group g. Allocates (tensor ops).
  at::Tensor bound(const at::Tensor& q, double scale) const {
    std::vector<int64_t> shape{slots()};  // [P, page_shape()]
    const auto page = digest_.page_shape();
    shape.insert(shape.end(), page.begin(), page.end());
    const auto blocks = at::from_blob(const_cast<float*>(blocks_.data()), shape, at::TensorOptions().dtype(at::kFloat));
    return Digest::bound(blocks, q, scale);
  }

  /// Page scores from `bound` [..., M, P] fp32 (bound(), or a mean of bounds over heads): per
  /// query, a softmax over the pages, summed over everything but the pages as fixed-point terms
  /// (detail::fixed_terms, exact in fp64 in any order) into out[slot]. Allocates (tensor ops).
  void score_bounds(const at::Tensor& bound, double* out) const {
    const int64_t P = slots();
    if (P == 0) return;
    std::vector<int64_t> dims(static_cast<size_t>(bound.dim() - 1));
    for (size_t i = 0; i < dims.size(); ++i) dims[i] = static_cast<int64_t>(i);
    // Every slot holds a page here: each removal ends in refresh(), which compacts the slots.
    const auto sums = at::sum(fixed_terms(at::softmax(bound, -1)), dims, false, at::kDouble);
    std::copy(sums.template data_ptr<double>(), sums.template data_ptr<double>() + P, out);
  }

  /// Page scores for queries q [groups, M, width] (as bound()): per query a softmax over the
  /// pages of scale * (the digest's bound), summed over the queries (score_bounds()).
  void score(const at::Tensor& q, double scale, double* out) const {
    if (slots() > 0) score_bounds(bound(q, scale), out);
  }

  /// Empties the table and gives its memory back.
  void release() {
    std::vector<int64_t>().swap(next_);
    std::vector<int64_t>().swap(prev_);
    std::vector<int64_t>().swap(page_of_);
    std::vector<int64_t>().swap(count_);
    std::vector<int64_t>().swap(head_);
    std::vector<int64_t>().swap(free_);
    std::vector<int64_t>().swap(dirty_);
    std::vector<int64_t>().swap(slot_of_page_);
    std::vector<float>().swap(blocks_);
  }

 private:
  int64_t page_ = 16;
  Digest digest_;
  int64_t F_ = Digest().floats();                    // floats in one slot's block
  std::vector<int64_t> next_, prev_;                 // per tier token: its page's list
  std::vector<int64_t> page_of_, count_, head_;      // per page slot (page -1: free)
  std::vector<int64_t> free_, dirty_;                // free slots; slots to rebuild
  std::vector<int64_t> slot_of_page_;                // per page id: its slot, -1 none
  std::vector<float> blocks_;                        // [slot, Digest::page_shape()]
  std::vector<float> key_;                           // refresh() scratch
};

}  // namespace detail
}  // namespace kvevict

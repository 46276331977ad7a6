#pragma once
// The bodies of the tier's compiled kernels (src/kernels/): plain functions over raw pointers,
// C10_HOST_DEVICE, so that the CPU kernel (a loop over rows) and the CUDA kernel (a thread per
// row) run the same code, and the CPU tests exercise the logic the GPU runs. Each body has an
// ATen reference form in tier/ops/reference.hpp, the test oracle; tier/ops/ops.hpp is the
// boundary the tier calls. Includes nothing from ATen: nvcc compiles it without LibTorch's
// headers.

#include <c10/macros/Macros.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace kvevict {
namespace detail {
namespace kernels {

/// pick_pages()'s arguments for every row: pointers with their strides in elements (row,
/// column), sizes, and the outputs (contiguous) and per-row scratch.
struct PickPagesArgs {
  const double* scores;  // [B, P] fp64: each page id's score
  int64_t scores_row, scores_col;
  const int64_t* members;  // [B, >= P] int64: each page id's tokens (0: none)
  int64_t members_row, members_col;
  const int64_t* position;  // [B, N + 1] int64: each store slot's position (-1: free; slot N the trash)
  int64_t position_row, position_col;
  const int64_t* seq;  // [B, N + 1] int64: each store slot's insertion number
  int64_t seq_row, seq_col;
  const int64_t* limit;  // [B] int64: tokens a row may take
  int64_t limit_row;
  int64_t P, N, K, page_size;
  int64_t* slots;    // out [B, K] int64, contiguous
  int64_t* count;    // out [B] int64
  int64_t* scratch;  // [B, 3 P + N] int64, contiguous
};

/// (score a, page a) before (score b, page b): higher score first, equal scores the smaller
/// page id. A strict total order on distinct page ids.
C10_HOST_DEVICE inline bool page_first(double sa, int64_t a, double sb, int64_t b) {
  return sa > sb || (sa == sb && a < b);
}

/// Restores the heap property below `i` of the max-heap `heap` [n] of page ids, ordered by
/// page_first() of their scores.
C10_HOST_DEVICE inline void sift_down(int64_t* heap, int64_t n, int64_t i, const double* scores, int64_t col) {
  for (;;) {
    int64_t best = i;
    const int64_t l = 2 * i + 1, r = l + 1;
    if (l < n && page_first(scores[heap[l] * col], heap[l], scores[heap[best] * col], heap[best])) best = l;
    if (r < n && page_first(scores[heap[r] * col], heap[r], scores[heap[best] * col], heap[best])) best = r;
    if (best == i) return;
    const int64_t t = heap[i];
    heap[i] = heap[best];
    heap[best] = t;
    i = best;
  }
}

/// Row b of pick_pages() (tier/ops/ops.hpp has the contract): the pages with members and a
/// score > 0 in pick order (a heap, popped only as far as the fill reaches), each whole page
/// that still fits in the row's limit taken; then the taken pages' tokens in recall order (page
/// by page in pick order, a page's tokens newest first by insertion number), counted per page,
/// placed by a prefix sum and an insertion sort within each page. O(P + pops log P + N +
/// taken x page_size).
C10_HOST_DEVICE inline void pick_pages_row(const PickPagesArgs& a, int64_t b) {
  int64_t* slots = a.slots + b * a.K;
  for (int64_t k = 0; k < a.K; ++k) slots[k] = a.N;
  a.count[b] = 0;
  if (a.N == 0 || a.P == 0 || a.K == 0) return;
  int64_t* heap = a.scratch + b * (3 * a.P + a.N);  // then each taken page's fill cursor
  int64_t* place = heap + a.P;                      // page id -> its place among the taken (-1: not taken)
  int64_t* begin = place + a.P;                     // each taken page's first column
  int64_t* order = begin + a.P;                     // the taken tokens in recall order
  const double* scores = a.scores + b * a.scores_row;
  const int64_t* members = a.members + b * a.members_row;
  const int64_t* position = a.position + b * a.position_row;
  const int64_t* seq = a.seq + b * a.seq_row;
  int64_t n = 0;
  for (int64_t p = 0; p < a.P; ++p) {
    place[p] = -1;
    if (members[p * a.members_col] > 0 && scores[p * a.scores_col] > 0) heap[n++] = p;
  }
  for (int64_t i = n / 2 - 1; i >= 0; --i) sift_down(heap, n, i, scores, a.scores_col);
  // The greedy fill with skips: a page that does not fit is passed over.
  int64_t left = a.limit[b * a.limit_row], taken = 0;
  while (n > 0 && left > 0) {
    const int64_t p = heap[0];
    heap[0] = heap[--n];
    sift_down(heap, n, 0, scores, a.scores_col);
    const int64_t m = members[p * a.members_col];
    if (m <= left) {
      place[p] = taken++;
      left -= m;
    }
  }
  // Each taken page's columns: counted, a prefix sum, then filled (heap's first `taken`
  // entries are the fill cursors).
  int64_t* cursor = heap;
  for (int64_t t = 0; t < taken; ++t) begin[t] = 0;
  for (int64_t s = 0; s < a.N; ++s) {
    const int64_t pos = position[s * a.position_col];
    if (pos < 0 || pos / a.page_size >= a.P) continue;
    const int64_t t = place[pos / a.page_size];
    if (t >= 0) ++begin[t];
  }
  int64_t total = 0;
  for (int64_t t = 0; t < taken; ++t) {
    const int64_t c = begin[t];
    cursor[t] = begin[t] = total;
    total += c;
  }
  for (int64_t s = 0; s < a.N; ++s) {
    const int64_t pos = position[s * a.position_col];
    if (pos < 0 || pos / a.page_size >= a.P) continue;
    const int64_t t = place[pos / a.page_size];
    if (t < 0) continue;
    // Into page t's columns [begin[t], cursor[t]), newest (larger insertion number) first.
    const int64_t mine = seq[s * a.seq_col];
    int64_t j = cursor[t]++;
    while (j > begin[t] && seq[order[j - 1] * a.seq_col] < mine) {
      order[j] = order[j - 1];
      --j;
    }
    order[j] = s;
  }
  for (int64_t k = 0; k < total && k < a.K; ++k) slots[k] = order[k];
  a.count[b] = total;
}

/// Element types of the rows a kernel reads as keys (a key's channels become fp32, exactly).
enum class RowType : int { kFloat = 0, kHalf = 1, kBFloat16 = 2 };

/// fp16 bits to fp32, exactly (subnormals, infinities and NaNs included).
C10_HOST_DEVICE inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
  uint32_t bits;
  if (exponent == 0x1fu) {
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal: normalize
    exponent = 113;
    while ((mantissa & 0x400u) == 0) {
      mantissa <<= 1;
      --exponent;
    }
    bits = sign | (exponent << 23) | ((mantissa & 0x3ffu) << 13);
  }
  float out;
  memcpy(&out, &bits, sizeof out);
  return out;
}

/// A [B, outer..., slots, inner] tensor of one buffer's rows (a cache buffer, or the tier's
/// rows through their view), as raw memory: strides in elements, the outer dims flattened.
constexpr int kMaxRowDims = 6;
constexpr int kMaxRowBuffers = 4;
struct RowBuffer {
  char* data = nullptr;
  int64_t element = 0;  // bytes per element
  RowType type = RowType::kFloat;
  int outer_dims = 0;
  int64_t outer_size[kMaxRowDims] = {};
  int64_t outer_stride[kMaxRowDims] = {};
  int64_t outer = 1;  // product of outer_size
  int64_t batch_stride = 0, slot_stride = 0, inner = 0, inner_stride = 0;

  /// Element (b, outer index o flattened, slot s, inner j).
  C10_HOST_DEVICE char* at(int64_t b, int64_t o, int64_t s, int64_t j) const {
    int64_t offset = b * batch_stride + s * slot_stride + j * inner_stride;
    for (int d = outer_dims - 1; d >= 0; --d) {
      offset += (o % outer_size[d]) * outer_stride[d];
      o /= outer_size[d];
    }
    return data + offset * element;
  }
  /// Element (b, o, s, j) as fp32.
  C10_HOST_DEVICE float value(int64_t b, int64_t o, int64_t s, int64_t j) const {
    const char* p = at(b, o, s, j);
    if (type == RowType::kFloat) {
      float v;
      memcpy(&v, p, sizeof v);
      return v;
    }
    uint16_t h;
    memcpy(&h, p, sizeof h);
    if (type == RowType::kHalf) return half_to_float(h);
    const uint32_t bits = static_cast<uint32_t>(h) << 16;
    float v;
    memcpy(&v, &bits, sizeof v);
    return v;
  }
};

/// recall_swap()'s arguments for every row (tier/ops/ops.hpp has the contract). Every tensor
/// but the RowBuffers is contiguous.
struct RecallSwapArgs {
  const int64_t* picked;      // [B, K] store slots to recall (N: none)
  const int64_t* count;       // [B] how many a row recalls
  const int64_t* victims;     // [B, K] cache slots they replace
  const float* top;           // [B, W] the state the recalled tokens get
  const float* slot_ranks;    // [B, S] each cache slot's rank
  int64_t K = 0, S = 0, N = 0, W = 0, P = 0, page_size = 1, groups = 1, width = 0;
  bool whole_pages = true;
  int64_t* position;          // [B, S] the policy's positions
  float* state;               // [B, S, W] the policy's scorer states
  RowBuffer buffers[kMaxRowBuffers];  // the cache's buffers, [B, outer..., S, inner]
  RowBuffer views[kMaxRowBuffers];    // the tier's rows, [B, outer..., N + 1, inner]
  int n_buffers = 0;
  int key_buffers[kMaxRowBuffers] = {};  // which buffers hold the keys, their channels side by side
  int n_keys = 0;
  int64_t* store_position;    // [B, N + 1]
  float* store_rank;          // [B, N + 1]
  float* store_state;         // [B, N + 1, W]
  int64_t* store_seq;         // [B, N + 1]
  int64_t* seq_next;          // [1]
  float* digest;              // [B, P + 1, groups, 2 width]: per group the channels' max, then min
  int64_t* members;           // [B, P + 1]
  int64_t* recalled;          // [1]
  int64_t* scratch;           // [B, K]
};

/// The flat page of position `pos` in [0, P], P (the trash page) for none.
C10_HOST_DEVICE inline int64_t page_or_trash(int64_t pos, int64_t page_size, int64_t P) {
  if (pos < 0) return P;
  const int64_t p = pos / page_size;
  return p < P ? p : P;
}

/// Folds the key of tier slot `slot` of row b (the key buffers' rows, through the views) into
/// the digest block `d` [groups, 2 width]: per channel the max and the min, a NaN left out.
C10_HOST_DEVICE inline void fold_key(const RecallSwapArgs& a, int64_t b, int64_t slot, float* d) {
  int64_t channel = 0;
  for (int i = 0; i < a.n_keys; ++i) {
    const RowBuffer& v = a.views[a.key_buffers[i]];
    for (int64_t g = 0; g < a.groups; ++g) {
      float* hi = d + g * 2 * a.width + channel;
      float* lo = hi + a.width;
      for (int64_t j = 0; j < v.inner; ++j) {
        const float k = v.value(b, g, slot, j);
        if (k != k) continue;  // NaN
        if (k > hi[j]) hi[j] = k;
        if (k < lo[j]) lo[j] = k;
      }
    }
    channel += v.inner;
  }
}

/// The digest block `d` [groups, 2 width] of no key: max -inf, min +inf.
C10_HOST_DEVICE inline void empty_digest(const RecallSwapArgs& a, float* d) {
  for (int64_t g = 0; g < a.groups; ++g) {
    for (int64_t c = 0; c < a.width; ++c) {
      d[g * 2 * a.width + c] = -INFINITY;
      d[g * 2 * a.width + a.width + c] = INFINITY;
    }
  }
}

/// Row b of recall_swap(): the picked tier tokens and the victims exchange places (rows,
/// positions, states; the victims get the tier slots with their ranks and fresh insertion
/// numbers), then the pages: the recalled tokens' pages emptied (whole pages), the victims join
/// theirs (max and min, from none where a page had no members), and the pages the recalled
/// tokens left rebuilt from their members (some pages in part). Columns past the row's count
/// write the trash slots (cache S - 1, store N, page P) with what TierStore's reference writes.
/// seq_next and recalled are left to the caller (every row reads seq_next first).
C10_HOST_DEVICE inline void recall_swap_row(const RecallSwapArgs& a, int64_t b) {
  const int64_t K = a.K, S = a.S, N1 = a.N + 1, W = a.W, cnt = a.count[b], first_seq = a.seq_next[0];
  const int64_t block = a.groups * 2 * a.width;
  int64_t* was_empty = a.scratch + b * K;
  for (int64_t k = 0; k < K; ++k) {
    const bool pad = k >= cnt;
    // Slots outside the cache or the store (never from the tier's own calls) go to the trash.
    const int64_t victim = a.victims[b * K + k], given = a.picked[b * K + k];
    const int64_t ix = pad || victim < 0 || victim >= S ? S - 1 : victim;
    const int64_t ts = given >= 0 && given <= a.N ? given : a.N;
    const int64_t out_pos = a.position[b * S + ix];
    const int64_t in_pos = pad ? out_pos : a.store_position[b * N1 + ts];
    for (int i = 0; i < a.n_buffers; ++i) {
      const RowBuffer& buf = a.buffers[i];
      const RowBuffer& view = a.views[i];
      for (int64_t o = 0; o < buf.outer; ++o) {
        for (int64_t j = 0; j < buf.inner; ++j) {
          char* out = buf.at(b, o, ix, j);
          char* tier = view.at(b, o, ts, j);
          for (int64_t e = 0; e < buf.element; ++e) {
            const char was = out[e];
            if (!pad) out[e] = tier[e];
            tier[e] = was;
          }
        }
      }
    }
    a.store_position[b * N1 + ts] = pad ? -1 : out_pos;
    a.store_rank[b * N1 + ts] = a.slot_ranks[b * S + ix];
    a.store_seq[b * N1 + ts] = first_seq + k;
    for (int64_t w = 0; w < W; ++w) {
      const float out_state = a.state[(b * S + ix) * W + w];
      a.store_state[(b * N1 + ts) * W + w] = out_state;
      if (!pad) a.state[(b * S + ix) * W + w] = a.top[b * W + w];
    }
    a.position[b * S + ix] = in_pos;
  }
  // The pages. The store's positions now hold the victims; in_pos of column k is what the
  // policy's slot holds.
  const int64_t P1 = a.P + 1;
  const auto victim_slot = [&](int64_t k) {
    const int64_t v = a.victims[b * K + k];
    return v >= 0 && v < S ? v : S - 1;
  };
  const auto store_slot = [&](int64_t k) {
    const int64_t t = a.picked[b * K + k];
    return t >= 0 && t <= a.N ? t : a.N;
  };
  const auto left = [&](int64_t k) {
    return k >= cnt ? a.P : page_or_trash(a.position[b * S + victim_slot(k)], a.page_size, a.P);
  };
  const auto joined = [&](int64_t k) {
    return k >= cnt ? a.P : page_or_trash(a.store_position[b * N1 + store_slot(k)], a.page_size, a.P);
  };
  if (a.whole_pages) {
    for (int64_t k = 0; k < K; ++k) a.members[b * P1 + left(k)] = 0;
  }
  for (int64_t k = 0; k < K; ++k) was_empty[k] = a.members[b * P1 + joined(k)] == 0;
  for (int64_t k = 0; k < K; ++k) {
    if (was_empty[k]) empty_digest(a, a.digest + (b * P1 + joined(k)) * block);
  }
  for (int64_t k = 0; k < K; ++k) {
    // A pad's key: the cache's trash slot's, which the store's trash slot now holds.
    fold_key(a, b, store_slot(k), a.digest + (b * P1 + joined(k)) * block);
    if (k < cnt) ++a.members[b * P1 + joined(k)];
  }
  if (a.whole_pages) return;
  for (int64_t k = 0; k < K; ++k) {
    const int64_t p = left(k);
    float* d = a.digest + (b * P1 + p) * block;
    empty_digest(a, d);
    int64_t m = 0;
    for (int64_t s = 0; s < a.N && p < a.P; ++s) {
      const int64_t pos = a.store_position[b * N1 + s];
      if (pos < 0 || pos / a.page_size != p) continue;
      fold_key(a, b, s, d);
      ++m;
    }
    a.members[b * P1 + p] = m;
  }
}

/// recall_victims()'s arguments for every row. Every tensor contiguous but `counters`.
struct RecallVictimsArgs {
  const float* slot_ranks;  // [B, S] each cache slot's rank
  const int64_t* position;  // [B, S] (-1: dead)
  const float* state;       // [B, S, W]
  const int64_t* counters;  // [B, 3] the policy's device counters; column 2: seen - n_recent
  int64_t counters_row = 0, counters_col = 0;
  const int64_t* latest;  // [B] each row's latest append (-1: a free row)
  int64_t S = 0, W = 0, K = 0, n_sink = 0;
  int64_t* victims;  // out [B, K]
  int64_t* count;    // out [B]
  float* top;        // out [B, W]
};

/// rank_key(): a non-finite rank as -inf, -0 as +0.
C10_HOST_DEVICE inline float victim_key(float rank) {
  return (rank - rank == 0.0f) ? rank + 0.0f : -INFINITY;
}
/// Slot a (key ka, position pa) is evicted before slot b: a lower key, equal keys the older.
C10_HOST_DEVICE inline bool evicted_first(float ka, int64_t pa, float kb, int64_t pb) {
  return ka < kb || (ka == kb && pa < pb);
}

/// Row b of recall_victims(): the candidates (n_sink <= position < recent_from, the recent
/// window as it was before the latest append), their number, the K lowest in eviction order
/// (an insertion into a sorted list; columns past the candidates: the cache's last slot S - 1)
/// and the best candidate's state (slot 0's for a row without).
C10_HOST_DEVICE inline void recall_victims_row(const RecallVictimsArgs& a, int64_t b) {
  const int64_t latest = a.latest[b];
  const int64_t recent_from = latest >= 0 ? a.counters[b * a.counters_row + 2 * a.counters_col] - latest : a.n_sink;
  int64_t* victims = a.victims + b * a.K;
  int64_t n = 0, kept = 0, best = -1;
  float best_key = 0;
  for (int64_t s = 0; s < a.S; ++s) {
    const int64_t pos = a.position[b * a.S + s];
    if (pos < a.n_sink || pos >= recent_from) continue;
    ++n;
    const float key = victim_key(a.slot_ranks[b * a.S + s]);
    if (best < 0 || evicted_first(best_key, a.position[b * a.S + best], key, pos)) {
      best = s;
      best_key = key;
    }
    // Into the sorted list of the K lowest.
    int64_t j = kept < a.K ? kept++ : a.K;
    while (j > 0) {
      const int64_t prev = victims[j - 1];
      if (!evicted_first(key, pos, victim_key(a.slot_ranks[b * a.S + prev]), a.position[b * a.S + prev])) break;
      if (j < a.K) victims[j] = prev;
      --j;
    }
    if (j < a.K) victims[j] = s;
  }
  for (int64_t k = kept; k < a.K; ++k) victims[k] = a.S - 1;
  a.count[b] = n;
  const int64_t from = best < 0 ? 0 : best;
  for (int64_t w = 0; w < a.W; ++w) a.top[b * a.W + w] = a.S > 0 ? a.state[(b * a.S + from) * a.W + w] : 0.0f;
}

/// pool_gather()'s arguments for every row. Every tensor but the views contiguous.
struct PoolGatherArgs {
  const int64_t* slots;           // [B, R] the pool's store slots (N past the count)
  const int64_t* count;           // [B]
  const int64_t* store_position;  // [B, N + 1]
  RowBuffer views[kMaxRowBuffers];
  int key_buffers[kMaxRowBuffers] = {};
  int n_keys = 0;
  int64_t R = 0, N = 0, groups = 1, width = 0;
  int64_t* by_position;  // out [B, R]: the pool by ascending position, N past the count
  float* keys;           // out [B, R, groups, width]
  bool* valid;           // out [B, R]
};

/// Row b of pool_gather(): the pool's slots sorted by position (an insertion sort), and each
/// column's key (the trash slot's past the count) as fp32.
C10_HOST_DEVICE inline void pool_gather_row(const PoolGatherArgs& a, int64_t b) {
  const int64_t N1 = a.N + 1, n = a.count[b] < a.R ? a.count[b] : a.R;
  int64_t* out = a.by_position + b * a.R;
  for (int64_t r = 0; r < n; ++r) {
    // A slot outside the store (never from the tier's own calls) reads the trash slot.
    const int64_t given = a.slots[b * a.R + r], slot = given >= 0 && given <= a.N ? given : a.N;
    const int64_t pos = a.store_position[b * N1 + slot];
    int64_t j = r;
    while (j > 0 && a.store_position[b * N1 + out[j - 1]] > pos) {
      out[j] = out[j - 1];
      --j;
    }
    out[j] = slot;
  }
  for (int64_t r = n; r < a.R; ++r) out[r] = a.N;
  for (int64_t r = 0; r < a.R; ++r) {
    a.valid[b * a.R + r] = r < n;
    float* key = a.keys + (b * a.R + r) * a.groups * a.width;
    int64_t channel = 0;
    for (int i = 0; i < a.n_keys; ++i) {
      const RowBuffer& v = a.views[a.key_buffers[i]];
      for (int64_t g = 0; g < a.groups; ++g) {
        for (int64_t j = 0; j < v.inner; ++j) key[g * a.width + channel + j] = v.value(b, g, out[r], j);
      }
      channel += v.inner;
    }
  }
}

/// pick_tokens()'s arguments for every row. Every tensor contiguous.
struct PickTokensArgs {
  const double* exact;        // [B, R] the pool's exact scores
  const bool* valid;          // [B, R]
  const int64_t* by_position; // [B, R]
  const int64_t* limit;       // [B]
  int64_t R = 0, K = 0, N = 0;
  int64_t* slots;    // out [B, K]
  int64_t* count;    // out [B]
  int64_t* scratch;  // [B, R]: taken
};

/// Score a before score b in a stable descending order (NaN before everything, as ATen's sort).
C10_HOST_DEVICE inline bool score_first(double a, double b) {
  if (a != a) return b == b;
  return a > b;
}

/// Row b of pick_tokens(): the pool's scores with a score <= 0 or an invalid column as -1, the
/// first min(K, R) in a stable descending order (repeated selection, equal scores the lower
/// column: the older position), of which the first `count` are kept: the tokens with a score >
/// 0, at most the limit; the rest of the K columns the trash slot N.
C10_HOST_DEVICE inline void pick_tokens_row(const PickTokensArgs& a, int64_t b) {
  const double* exact = a.exact + b * a.R;
  const bool* valid = a.valid + b * a.R;
  int64_t* taken = a.scratch + b * a.R;
  int64_t* slots = a.slots + b * a.K;
  int64_t positive = 0;
  for (int64_t r = 0; r < a.R; ++r) {
    taken[r] = 0;
    if (valid[r] && exact[r] > 0) ++positive;
  }
  const int64_t limit = a.limit[b], count = positive < limit ? positive : limit;
  for (int64_t k = 0; k < a.K; ++k) slots[k] = a.N;
  for (int64_t k = 0; k < count && k < a.R && k < a.K; ++k) {
    int64_t best = -1;
    double best_score = 0;
    for (int64_t r = 0; r < a.R; ++r) {
      if (taken[r]) continue;
      const double score = (!valid[r] || exact[r] <= 0) ? -1.0 : exact[r];
      if (best < 0 || score_first(score, best_score)) {
        best = r;
        best_score = score;
      }
    }
    taken[best] = 1;
    slots[k] = a.by_position[b * a.R + best];
  }
  a.count[b] = count;
}

}  // namespace kernels
}  // namespace detail
}  // namespace kvevict

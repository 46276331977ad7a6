// Training rows and evaluation documents for the quality model, generated deterministically
// from a seed: English text (Brown), multi-query associative recall, passkey retrieval and
// copying, with needles far back in the context. Filler is Brown text or, where no corpus is
// at hand (the CI test), synthetic pseudo-words.
#pragma once

#include "model.hpp"

#include <cstdint>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace kvq {

// splitmix64: the same numbers with every compiler and standard library.
struct Rng {
  uint64_t s;
  // The seed is mixed first: a plain `seed * constant` start would make Rng(x + 1) the
  // sequence of Rng(x) shifted by one draw (consecutive training steps would repeat rows).
  explicit Rng(uint64_t seed) : s(mix(seed ^ 0x5DEECE66Dull)) {}
  static uint64_t mix(uint64_t z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  uint64_t next() { return mix(s += 0x9E3779B97F4A7C15ull); }
  int64_t uniform(int64_t n) { return static_cast<int64_t>(next() % static_cast<uint64_t>(n)); }  // [0, n)
  double unit() { return static_cast<double>(next() >> 11) * (1.0 / 9007199254740992.0); }
};

inline std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error("cannot read " + path + " (run scripts/fetch_corpus.sh)");
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// Target categories (what the token at t is, predicted from t-1).
enum Cat : int8_t { kNone = 0, kText = 1, kMqar = 2, kPasskey = 3, kCopyAns = 4 };
constexpr int kNumCats = 5;

struct Row {
  std::vector<int64_t> tok;
  std::vector<int8_t> cat;  // cat[t]: category of tok[t] as a target; kNone = no loss
};

// Filler: `n` bytes of Brown text from a random offset, or pseudo-words when text is empty.
inline void filler(Rng& r, const std::string& text, int64_t n, Row& row) {
  if (!text.empty()) {
    const int64_t off = r.uniform(static_cast<int64_t>(text.size()) - n - 1);
    for (int64_t i = 0; i < n; ++i) {
      row.tok.push_back(static_cast<unsigned char>(text[off + i]));
      row.cat.push_back(kText);
    }
    return;
  }
  static const char* syl[] = {"ka", "lo", "mi", "ne", "ru", "ta", "so", "vi", "de", "po", "an", "el", "or", "th", "st"};
  int64_t i = 0;
  while (i < n) {
    const int64_t nsyl = 1 + r.uniform(3);
    std::string w;
    for (int64_t k = 0; k < nsyl; ++k) w += syl[r.uniform(15)];
    w += r.uniform(8) == 0 ? ". " : " ";
    for (char ch : w) {
      if (i == n) break;
      row.tok.push_back(static_cast<unsigned char>(ch));
      row.cat.push_back(kText);
      ++i;
    }
  }
}

inline void push(Row& row, int64_t t, Cat c) {
  row.tok.push_back(t);
  row.cat.push_back(c);
}

// BOS + T-1 bytes of text.
inline Row text_row(Rng& r, const std::string& text, int64_t T) {
  Row row;
  push(row, kBos, kNone);
  filler(r, text, T - 1, row);
  return row;
}

// Inserts `needles` (each a token sequence, loss-free) into `fill` at the given sorted offsets.
inline Row weave(const Row& fill, const std::vector<std::vector<int64_t>>& needles, const std::vector<int64_t>& at) {
  Row row;
  size_t k = 0;
  for (size_t i = 0; i <= fill.tok.size(); ++i) {
    while (k < needles.size() && at[k] == static_cast<int64_t>(i)) {
      for (auto t : needles[k]) push(row, t, kNone);
      ++k;
    }
    if (i < fill.tok.size()) {
      // the byte right after a needle is predicted from text two tokens back: keep its loss anyway
      row.tok.push_back(fill.tok[i]);
      row.cat.push_back(fill.cat[i]);
    }
  }
  return row;
}

inline std::vector<int64_t> sorted_offsets(Rng& r, int64_t n, int64_t lo, int64_t hi) {
  std::vector<int64_t> v;
  for (int64_t i = 0; i < n; ++i) v.push_back(lo + r.uniform(hi - lo));
  std::sort(v.begin(), v.end());
  return v;
}

// n distinct key symbols and n value symbols (any), drawn in this order.
inline void key_values(Rng& r, int64_t n, std::vector<int64_t>& keys, std::vector<int64_t>& vals) {
  while (static_cast<int64_t>(keys.size()) < n) {
    const int64_t k = r.uniform(kNumSym);
    if (std::find(keys.begin(), keys.end(), k) == keys.end()) keys.push_back(k);
  }
  for (int64_t i = 0; i < n; ++i) vals.push_back(r.uniform(kNumSym));
}

// Multi-query associative recall: `pairs` (key, value) needles scattered through filler, then
// `queries` of them asked at the end: QRY key -> value. Length exactly T.
inline Row mqar_row(Rng& r, const std::string& text, int64_t T, int64_t pairs, int64_t queries) {
  std::vector<int64_t> keys, vals;
  key_values(r, pairs, keys, vals);
  const int64_t nfill = T - 1 - 2 * pairs - 3 * queries;
  Row fill;
  push(fill, kBos, kNone);
  filler(r, text, nfill, fill);
  std::vector<std::vector<int64_t>> needles;
  for (int64_t i = 0; i < pairs; ++i) needles.push_back({kKey0 + keys[i], kVal0 + vals[i]});
  Row row = weave(fill, needles, sorted_offsets(r, pairs, 1, nfill + 1));
  for (int64_t q = 0; q < queries; ++q) {
    const int64_t i = r.uniform(pairs);
    push(row, kQuery, kNone);
    push(row, kKey0 + keys[i], kNone);
    push(row, kVal0 + vals[i], kMqar);
  }
  return row;
}

constexpr int64_t kPassLen = 4;

// Passkey: PASS v1..v4 at `depth` (fraction of the filler, < 0: random), filler around it,
// then QRY PASS v1..v4 with the four values as targets. Context (everything before the
// answer) is T - kPassLen tokens; length exactly T.
inline Row passkey_row(Rng& r, const std::string& text, int64_t T, double depth, std::vector<int64_t>* key = nullptr) {
  std::vector<int64_t> needle{kPass};
  for (int64_t i = 0; i < kPassLen; ++i) needle.push_back(kVal0 + r.uniform(kNumSym));
  const int64_t nfill = T - 1 - (kPassLen + 1) - 2 - kPassLen;
  Row fill;
  push(fill, kBos, kNone);
  filler(r, text, nfill, fill);
  const int64_t at = 1 + (depth < 0 ? r.uniform(nfill + 1) : static_cast<int64_t>(std::llround(depth * nfill)));
  Row row = weave(fill, {needle}, {at});
  push(row, kQuery, kNone);
  push(row, kPass, kNone);
  for (int64_t i = 1; i <= kPassLen; ++i) push(row, needle[i], kPasskey);
  if (key) key->assign(needle.begin() + 1, needle.end());
  return row;
}

// Questions in turn: n (key, value) needles KEY_k VAL_v at depths (i + 0.5) / n of the filler,
// then each asked once, in random order, as QRY KEY_k -> VAL_v (the value the target).
// Context before the first question: T - 3n tokens; length exactly T.
inline Row questions_row(Rng& r, const std::string& text, int64_t T, int64_t n) {
  std::vector<int64_t> keys, vals;
  key_values(r, n, keys, vals);
  const int64_t nfill = T - 1 - 2 * n - 3 * n;
  Row fill;
  push(fill, kBos, kNone);
  filler(r, text, nfill, fill);
  std::vector<std::vector<int64_t>> needles;
  std::vector<int64_t> at;
  for (int64_t i = 0; i < n; ++i) {
    needles.push_back({kKey0 + keys[i], kVal0 + vals[i]});
    at.push_back(1 + static_cast<int64_t>(std::llround((i + 0.5) / n * nfill)));
  }
  Row row = weave(fill, needles, at);
  std::vector<int64_t> order(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) order[i] = i;
  for (int64_t i = n - 1; i > 0; --i) std::swap(order[i], order[r.uniform(i + 1)]);  // Fisher-Yates
  for (const int64_t i : order) {
    push(row, kQuery, kNone);
    push(row, kKey0 + keys[i], kNone);
    push(row, kVal0 + vals[i], kMqar);
  }
  return row;
}

// Copy: filler, then CPY x1..xn CPY x1..xn with random symbols; length exactly T.
inline Row copy_row(Rng& r, const std::string& text, int64_t T, int64_t n) {
  Row row;
  push(row, kBos, kNone);
  filler(r, text, T - 3 - 2 * n, row);
  std::vector<int64_t> xs;
  for (int64_t i = 0; i < n; ++i) xs.push_back(kKey0 + r.uniform(2 * kNumSym));
  push(row, kCopy, kNone);
  for (auto x : xs) push(row, x, kNone);
  push(row, kCopy, kNone);
  for (auto x : xs) push(row, x, kCopyAns);
  return row;
}

}  // namespace kvq

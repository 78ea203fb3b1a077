// pdserve CPU paged attention: the kernels the model runner calls for every layer of every
// step when it runs on CPU (through pdserve.kernels.attention).
//
// KV cache layout: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim], K at
// index 0 of dim 2, V at 1. `paged_attention` attends straight from the blocks (nothing is
// gathered into contiguous tensors): the queries are scored against every key of the context
// (pass 1), soft-maxed in float32, then used to weight the values (pass 2).
//
// Prefill (a chunk of q_len rows that are the last q_len positions of a context whose K/V are
// all already written): one work item is (sequence, kv head, a tile of query rows), the G
// query heads of that kv head for those rows.
//
// Decode (one row per sequence; bound by reading K/V from DRAM): one work item is a
// sequence, all its heads, so that each block's K tile and V tile (block_size x KVH x D,
// contiguous: 6 KB at SmolLM2 shapes) are read whole, in turn, with software prefetching
// ahead; a batch smaller than the thread count is split by kv head instead.
//
// Batch and chunk invariance: a query row's output is the same bits in a decode step and
// in a prefill chunk, whatever else is in the batch. Both walk the row's context block by
// block in order with the same score kernel (a key's score does not depend on how many keys
// one call scores), the same two-pass softmax over exactly the row's context, and the same
// value kernel (keys past the row's context add exact zeros). The context is never split
// across threads (no split-K: its merge would round differently from the unsplit sum).
//
// Sliding-window layers (`window` > 0): a row at position p attends to keys (p - window, p].
// Its softmax runs over exactly that range (the same lanes in decode and prefill), blocks
// wholly before it are not read, and keys of a block read for the row's neighbours that lie
// before it weigh an exact zero, so the invariance above holds for windowed rows too.
// The SIMD kernels live in paged_attention_simd.h.

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "entry_points.h"
#include "paged_attention_simd.h"

namespace {

using namespace pdserve_attention;

// ------------------------------------------------------------------------ work items
struct Geometry {
  int64_t num_heads, num_kv_heads, group, head_dim, block_size, num_blocks;
  int64_t block_stride, layer_offset, value_offset, token_stride, table_stride;
  int64_t window;  // 0: full causal attention; else each row's last `window` positions
  float scale;

  // The first key a row with `ctx` positions of context attends to.
  int first_key(int ctx) const {
    return window > 0 && ctx > window ? ctx - static_cast<int>(window) : 0;
  }
};

struct Item {
  int32_t seq, kv_head, row0, rows;
  int64_t cost;
};

// Per-thread buffers, reused across items.
template <typename T>
struct Scratch {
  std::vector<float> qf, scores, acc, inv;
  std::vector<T> qraw, pb;
};

// Row r of the output: acc[r] * inv (the softmax normaliser), rounded to T.
template <typename T>
inline void store_scaled_row(T* dst, const float* acc, float inv, int D) {
  int d = 0;
#if defined(__AVX512F__)
  for (; d + 16 <= D; d += 16)
    store16(dst + d, _mm512_mul_ps(_mm512_loadu_ps(acc + d), _mm512_set1_ps(inv)));
#endif
  for (; d < D; ++d) dst[d] = static_cast<T>(acc[d] * inv);
}

// The bf16-dot value pass reads the probabilities as bf16 pairs: convert R rows of n scores.
// Rows land at offset `at` of sc.pb (the same place as their scores in sc.scores).
template <typename T>
inline void probs_to_bf16(const Kernels<T>& kern, Scratch<T>& sc, const float* scores, int R,
                          int64_t ld, int n, int64_t at = 0) {
#if defined(__AVX512BF16__)
  if constexpr (Kernels<T>::kDot)
    if (kern.bf16_dot) {
      sc.pb.resize(std::max(sc.pb.size(), static_cast<size_t>(at + R * ld + 32)));
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < n; j += 32) to_bf16_32(scores + r * ld + j, &sc.pb[at + r * ld + j]);
    }
#else
  (void)kern, (void)sc, (void)scores, (void)R, (void)ld, (void)n, (void)at;
#endif
}

// One (sequence, kv head, query rows [row0, row0 + rows)) item. Query r = i * G + g is row
// i's head kv_head * G + g; it attends to its first prefix + row0 + i + 1 positions.
// Returns false on a block id outside the cache.
template <typename T>
bool run_item(const Geometry& geo, const Kernels<T>& kern, const T* cache, const T* query, T* out,
              const int32_t* table, int64_t q_start, int64_t prefix, const Item& it,
              Scratch<T>& sc) {
  const int D = static_cast<int>(geo.head_dim), G = static_cast<int>(geo.group);
  const int BS = static_cast<int>(geo.block_size);
  const int R = it.rows * G;
  const int base_ctx = static_cast<int>(prefix) + it.row0 + 1;  // context of query row 0
  const int ctx_max = base_ctx + it.rows - 1;
  const int64_t ld = (ctx_max + 31) & ~int64_t{31};
  auto ctx_of = [&](int r) { return base_ctx + r / G; };
  // Rows' first keys grow with r: a group of rows starts reading at its first row's block.
  auto lo_of = [&](int r) { return geo.first_key(ctx_of(r)); };
  const int b_first = lo_of(0) / BS;

  const size_t qsize = static_cast<size_t>(R) * D;
  sc.qraw.resize(qsize);
  sc.qf.resize(qsize);
  sc.acc.assign(qsize, 0.f);
  sc.scores.resize(static_cast<size_t>(R) * ld);
  sc.inv.resize(R);
  for (int i = 0; i < it.rows; ++i) {
    const T* src = query + ((q_start + it.row0 + i) * geo.num_heads + it.kv_head * G) * D;
    std::memcpy(sc.qraw.data() + static_cast<size_t>(i) * G * D, src, sizeof(T) * G * D);
  }
  if (!kern.bf16_dot)
    for (size_t e = 0; e < qsize; ++e) sc.qf[e] = static_cast<float>(sc.qraw[e]);

  const int nblocks = (ctx_max + BS - 1) / BS;
  for (int b = b_first; b < nblocks; ++b)
    if (table[b] < 0 || table[b] >= geo.num_blocks) return false;
  const T* head_base = cache + geo.layer_offset + it.kv_head * D;
  float* scores = sc.scores.data();

  // Pass 0 scores the keys block by block, pass 1 sums the values. (No software prefetch:
  // an item reuses each key and value for many query rows, and prefetching block b + 2's
  // rows measured no better at prefill shapes; decode, bound by DRAM, does prefetch.)
  for (int pass = 0; pass < 2; ++pass) {
    const int64_t kv_off = pass == 0 ? 0 : geo.value_offset;
    for (int b = b_first; b < nblocks; ++b) {
      const int j0 = b * BS;
      const int n = std::min(BS, ctx_max - j0);
      const T* rows = head_base + table[b] * geo.block_stride + kv_off;
      for (int q0 = 0; q0 < R; q0 += 4) {
        const int nq = std::min(4, R - q0);
        const int nn = std::min(n, ctx_of(q0 + nq - 1) - j0);  // causal: the group's last row
        if (nn <= 0 || j0 + nn <= lo_of(q0)) continue;  // window: before the group's reach
        if (pass == 0)
          kern.qk(sc.qf.data() + q0 * D, sc.qraw.data() + q0 * D, nq, D, rows, geo.token_stride,
                  nn, scores + q0 * ld + j0, ld);
        else
          kern.pv(scores + q0 * ld + j0, sc.pb.data() + q0 * ld + j0, ld, nq, D, rows,
                  geo.token_stride, nn, sc.acc.data() + q0 * D);
      }
    }
    if (pass == 1) break;
    const int jb = (b_first * BS) & ~31;  // scores from here on are read (32-aligned)
    for (int r = 0; r < R; ++r) {
      const int lo = lo_of(r);
      float* row = scores + r * ld;
      std::fill(row + jb, row + lo, 0.f);
      sc.inv[r] = softmax_row(row + lo, ctx_of(r) - lo, ctx_max - lo, geo.scale);
    }
    probs_to_bf16(kern, sc, scores + jb, R, ld, ctx_max - jb, jb);
  }
#if defined(__AVX512BF16__)
  if (kern.bf16_dot) unpermute_bf16(sc.acc.data(), static_cast<int>(qsize));
#endif

  for (int r = 0; r < R; ++r) {
    const int i = r / G, g = r % G;
    T* dst = out + ((q_start + it.row0 + i) * geo.num_heads + it.kv_head * G + g) * D;
    store_scaled_row(dst, sc.acc.data() + static_cast<size_t>(r) * D, sc.inv[r], D);
  }
  return true;
}

// ------------------------------------------------------------------------ decode
// Decode item: the whole context of sequence `seq` for its kv heads [h0, h1).
struct DecodeItem {
  int32_t seq, len, h0, h1;
};

// Lines [l0, l1) (64 bytes each) from p on, prefetched into L2.
inline void prefetch_lines(const void* p, int64_t l0, int64_t l1) {
  const char* c = static_cast<const char*>(p);
  for (int64_t l = l0; l < l1; ++l) {
    __builtin_prefetch(c + l * 64, 0, 2);  // 2: into L2 (prefetcht1)
    // Without this, GCC (12) finds a helper that only prefetches side-effect free and
    // deletes the calls: the prefetches silently compile to nothing.
    asm volatile("" : : "r"(c + l * 64));
  }
}

// How many tiles ahead of the one in use are prefetched. Measured at SmolLM2 decode shapes
// (batch 64, random blocks, DRAM-cold): every line of the tile into L2 (prefetcht1), spread
// over the kv heads' kernel calls, takes ~0.55x the time of no prefetching. A whole tile
// issued at once: ~0.75x; prefetcht0 or every other line: no better than none; K and V
// together: worse; distances 1-16: all about the same. The AVX2 kernels go further: each
// takes its head's share and issues it a line or two per inner step (Spread in
// paged_attention_avx2.h), which overlaps the DRAM reads with the arithmetic (float32, 2
// threads, 200-token contexts, all 30 layers: batch 64 37.5 -> 29.9 ms, batch 16 9.5 -> 8.2,
// batch 4 2.2 -> 2.0; distances 1-3 the same).
constexpr int kPrefetchTiles = 2;

// One decode item. Walks the context's blocks in table order; inside a block, every kv
// head's G queries score (pass 0) or weight (pass 1) that head's rows, so each block's K
// tile, then its V tile, is consumed whole (block_size x KVH x D, contiguous), while the
// tile kPrefetchTiles ahead is prefetched a kv head's share at a time (by the AVX2 kernels
// over their work, else before the call). Returns false on a block id outside the cache.
template <typename T>
bool run_decode(const Geometry& geo, const Kernels<T>& kern, const T* cache, const T* query,
                T* out, const int32_t* table, const DecodeItem& it, Scratch<T>& sc) {
  const int D = static_cast<int>(geo.head_dim), G = static_cast<int>(geo.group);
  const int BS = static_cast<int>(geo.block_size);
  const int R = static_cast<int>(geo.num_heads);
  const int n_tok = it.len;
  const int lo = geo.first_key(n_tok), b_first = lo / BS;
  const int r_begin = it.h0 * G, r_end = it.h1 * G;
  const int64_t ld = (n_tok + 31) & ~int64_t{31};
  const size_t qsize = static_cast<size_t>(R) * D;
  sc.qraw.resize(qsize);
  sc.qf.resize(qsize);
  sc.acc.assign(qsize, 0.f);
  sc.scores.resize(static_cast<size_t>(R) * ld);
  sc.inv.resize(R);
  std::memcpy(sc.qraw.data(), query + static_cast<int64_t>(it.seq) * R * D, sizeof(T) * qsize);
  if (!kern.bf16_dot)
    for (size_t e = 0; e < qsize; ++e) sc.qf[e] = static_cast<float>(sc.qraw[e]);

  const int nb = (n_tok + BS - 1) / BS;
  for (int b = b_first; b < nb; ++b)
    if (table[b] < 0 || table[b] >= geo.num_blocks) return false;
  const T* layer_base = cache + geo.layer_offset;
  float* scores = sc.scores.data();

  // Tile i of the item: the K tile of its i-th block read (from b_first on) for i < na, then
  // the V tile of block i - na.
  const int na = nb - b_first;
  const int64_t tile_lines = (geo.value_offset * static_cast<int64_t>(sizeof(T)) + 63) / 64;
  const int heads = it.h1 - it.h0;
  // Share `part` of `parts` of tile i: its first line and line count (none past the end).
  auto share = [&](int i, int part, int parts) -> std::pair<const char*, int64_t> {
    if (i >= 2 * na) return {nullptr, 0};
    const T* p = layer_base + table[b_first + i % na] * geo.block_stride +
                 (i < na ? 0 : geo.value_offset);
    const int64_t l0 = tile_lines * part / parts, l1 = tile_lines * (part + 1) / parts;
    return {reinterpret_cast<const char*>(p) + l0 * 64, l1 - l0};
  };
  for (int i = 0; i < kPrefetchTiles; ++i) {
    const auto [p, lines] = share(i, 0, 1);
    if (p) prefetch_lines(p, 0, lines);
  }
  const bool spread = kern.avx2;

  for (int pass = 0; pass < 2; ++pass) {
    const int64_t kv_off = pass == 0 ? 0 : geo.value_offset;
    for (int b = b_first; b < nb; ++b) {
      const int jt = b * BS;
      const int n = std::min(BS, n_tok - jt);
      const T* blk = layer_base + table[b] * geo.block_stride + kv_off;
      for (int h = it.h0; h < it.h1; ++h) {
        // The kernels that can spread this head's share of the tile kPrefetchTiles ahead over
        // their work get it; for the others it is prefetched here.
        auto [pf, pf_lines] = share(pass * na + b - b_first + kPrefetchTiles, h - it.h0, heads);
        if (!spread) {
          if (pf) prefetch_lines(pf, 0, pf_lines);
          pf = nullptr;
        }
        const T* rows = blk + h * D;
        const int r0 = h * G;
        if (pass == 0) {
          for (int g0 = 0; g0 < G; g0 += 4) {
            const int r = r0 + g0;
            kern.qk(sc.qf.data() + r * D, sc.qraw.data() + r * D, std::min(4, G - g0), D, rows,
                    geo.token_stride, n, scores + r * ld + jt, ld, g0 == 0 ? pf : nullptr,
                    pf_lines);
          }
        } else {
          kern.pv(scores + r0 * ld + jt, sc.pb.data() + r0 * ld + jt, ld, G, D, rows,
                  geo.token_stride, n, sc.acc.data() + r0 * D, pf, pf_lines);
        }
      }
    }
    if (pass == 1) break;
    const int jb = (b_first * BS) & ~31;  // scores from here on are read (32-aligned)
    for (int r = r_begin; r < r_end; ++r) {
      float* row = scores + r * ld;
      std::fill(row + jb, row + lo, 0.f);
      sc.inv[r] = softmax_row(row + lo, n_tok - lo, n_tok - lo, geo.scale);
    }
    probs_to_bf16(kern, sc, scores + r_begin * ld + jb, r_end - r_begin, ld, n_tok - jb,
                  r_begin * ld + jb);
  }
#if defined(__AVX512BF16__)
  if (kern.bf16_dot)
    unpermute_bf16(sc.acc.data() + static_cast<size_t>(r_begin) * D, (r_end - r_begin) * D);
#endif

  T* dst = out + static_cast<int64_t>(it.seq) * R * D;
  for (int r = r_begin; r < r_end; ++r)
    store_scaled_row(dst + r * D, sc.acc.data() + static_cast<size_t>(r) * D, sc.inv[r], D);
  return true;
}

// Decode: one item per sequence (all its heads), longest first; a batch smaller than the
// thread count is split by kv head so every thread has work (heads are independent, so
// this changes no bit of the result).
template <typename T>
void decode_impl(const Geometry& geo, const torch::Tensor& query, const torch::Tensor& kv_cache,
                 torch::Tensor& out, const int32_t* tables, const int32_t* seq_lens,
                 int64_t num_seqs) {
  const Kernels<T> kern(geo.head_dim);
  const int64_t threads = std::max(1, at::get_num_threads());
  const int32_t kvh = static_cast<int32_t>(geo.num_kv_heads);
  const bool by_head = num_seqs < threads && kvh > 1;
  std::vector<DecodeItem> items;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const auto seq = static_cast<int32_t>(s);
    if (!by_head) {
      items.push_back({seq, seq_lens[s], 0, kvh});
      continue;
    }
    for (int32_t h = 0; h < kvh; ++h) items.push_back({seq, seq_lens[s], h, h + 1});
  }
  // Longest first, then handed out one at a time: balances ragged batches across threads.
  std::stable_sort(items.begin(), items.end(), [](const DecodeItem& a, const DecodeItem& b) {
    return a.len * (a.h1 - a.h0) > b.len * (b.h1 - b.h0);
  });
  const int64_t num_items = static_cast<int64_t>(items.size());
  const T* cache = kv_cache.data_ptr<T>();
  const T* q = query.data_ptr<T>();
  T* o = out.data_ptr<T>();
  std::atomic<int64_t> next{0};
  std::atomic<bool> bad{false};
  const int64_t workers = std::max<int64_t>(1, std::min(threads, num_items));
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    static thread_local Scratch<T> sc;  // kept across calls: no allocation per step
    for (int64_t i = next.fetch_add(1); i < num_items; i = next.fetch_add(1)) {
      const DecodeItem& it = items[i];
      if (!run_decode<T>(geo, kern, cache, q, o, tables + it.seq * geo.table_stride, it, sc))
        bad = true;
    }
  });
  TORCH_CHECK(!bad, "paged_attention: block table entry outside the cache");
}

template <typename T>
void attention_impl(const Geometry& geo, const torch::Tensor& query, const torch::Tensor& kv_cache,
                    torch::Tensor& out, const int32_t* tables, const int32_t* seq_lens,
                    const int32_t* qsl, int64_t num_seqs) {
  const Kernels<T> kern(geo.head_dim);
  const int32_t rows_per_item =
      qsl ? static_cast<int32_t>(4 * ((8 + geo.group - 1) / geo.group)) : 1;
  std::vector<Item> items;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t q_len = qsl ? qsl[s + 1] - qsl[s] : 1;
    const int64_t prefix = seq_lens[s] - q_len;
    for (int32_t r0 = 0; r0 < q_len; r0 += rows_per_item) {
      const int32_t rows = static_cast<int32_t>(std::min<int64_t>(rows_per_item, q_len - r0));
      for (int32_t h = 0; h < geo.num_kv_heads; ++h)
        items.push_back({static_cast<int32_t>(s), h, r0, rows, rows * (prefix + r0 + rows)});
    }
  }
  // Longest first, then handed out one at a time: balances ragged batches across threads.
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& b) { return a.cost > b.cost; });
  const int64_t num_items = static_cast<int64_t>(items.size());
  const T* cache = kv_cache.data_ptr<T>();
  const T* q = query.data_ptr<T>();
  T* o = out.data_ptr<T>();
  std::atomic<int64_t> next{0};
  std::atomic<bool> bad{false};
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_items));
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    Scratch<T> sc;
    for (int64_t i = next.fetch_add(1); i < num_items; i = next.fetch_add(1)) {
      const Item& it = items[i];
      const int64_t q_start = qsl ? qsl[it.seq] : it.seq;
      const int64_t q_len = qsl ? qsl[it.seq + 1] - qsl[it.seq] : 1;
      if (!run_item<T>(geo, kern, cache, q, o, tables + it.seq * geo.table_stride, q_start,
                       seq_lens[it.seq] - q_len, it, sc))
        bad = true;
    }
  });
  TORCH_CHECK(!bad, "paged_attention: block table entry outside the cache");
}

}  // namespace

// query [T, H, D]; kv_cache [num_blocks, num_layers, 2, block_size, KVH, D]; block_tables
// [S, max_blocks] int32; seq_lens [S] int32; query_start_loc [S + 1] int32 (None: decode,
// one query per sequence, T == S); window: 0, or each row attends to its context's last
// `window` positions. Returns [T, H, D] in query's dtype.
torch::Tensor windowed_attention(torch::Tensor query, const torch::Tensor& kv_cache,
                                 int64_t layer, torch::Tensor block_tables, torch::Tensor seq_lens,
                                 c10::optional<torch::Tensor> query_start_loc, double scale,
                                 int64_t window) {
  TORCH_CHECK(query.device().is_cpu() && kv_cache.device().is_cpu(), "cpu tensors expected");
  TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.is_contiguous() && kv_cache.size(2) == 2,
              "kv_cache must be contiguous [num_blocks, num_layers, 2, block_size, KVH, D]");
  TORCH_CHECK(query.dim() == 3 && query.scalar_type() == kv_cache.scalar_type(),
              "query must be [T, H, D] of the cache's dtype");
  TORCH_CHECK(layer >= 0 && layer < kv_cache.size(1), "layer out of range");
  TORCH_CHECK(window >= 0, "window must be >= 0");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 &&
                  seq_lens.scalar_type() == torch::kInt32,
              "block_tables and seq_lens must be int32");
  query = query.contiguous();
  block_tables = block_tables.contiguous();
  seq_lens = seq_lens.contiguous();
  Geometry geo;
  geo.num_heads = query.size(1);
  geo.num_kv_heads = kv_cache.size(4);
  geo.head_dim = kv_cache.size(5);
  TORCH_CHECK(query.size(2) == geo.head_dim && geo.num_heads % geo.num_kv_heads == 0,
              "query heads/head_dim do not match the cache");
  geo.group = geo.num_heads / geo.num_kv_heads;
  geo.block_size = kv_cache.size(3);
  geo.num_blocks = kv_cache.size(0);
  geo.token_stride = geo.num_kv_heads * geo.head_dim;
  geo.value_offset = geo.block_size * geo.token_stride;
  geo.layer_offset = layer * 2 * geo.value_offset;
  geo.block_stride = kv_cache.size(1) * 2 * geo.value_offset;
  geo.table_stride = block_tables.size(1);
  geo.scale = static_cast<float>(scale);
  geo.window = window;

  const int64_t num_seqs = seq_lens.size(0);
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* qsl = nullptr;
  torch::Tensor qsl_t;
  if (query_start_loc.has_value()) {
    qsl_t = query_start_loc->contiguous();
    TORCH_CHECK(qsl_t.scalar_type() == torch::kInt32 && qsl_t.numel() == num_seqs + 1,
                "query_start_loc must be int32 [S + 1]");
    qsl = qsl_t.data_ptr<int32_t>();
    TORCH_CHECK(qsl[0] == 0 && qsl[num_seqs] == query.size(0), "query_start_loc must span query");
  } else {
    TORCH_CHECK(query.size(0) == num_seqs, "decode: one query row per sequence");
  }
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) >= num_seqs, "block_tables [S, M]");
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t q_len = qsl ? qsl[s + 1] - qsl[s] : 1;
    TORCH_CHECK(q_len >= 0 && lens[s] >= q_len && (lens[s] >= 1 || q_len == 0),
                "sequence ", s, ": bad seq_len ", lens[s], " for ", q_len, " queries");
    TORCH_CHECK((lens[s] + geo.block_size - 1) / geo.block_size <= geo.table_stride,
                "sequence ", s, ": block table too short for ", lens[s], " tokens");
  }

  torch::Tensor out = torch::empty_like(query);
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  switch (query.scalar_type()) {
    case torch::kFloat:
      if (qsl)
        attention_impl<float>(geo, query, kv_cache, out, tables, lens, qsl, num_seqs);
      else
        decode_impl<float>(geo, query, kv_cache, out, tables, lens, num_seqs);
      break;
    case torch::kBFloat16:
      if (qsl)
        attention_impl<c10::BFloat16>(geo, query, kv_cache, out, tables, lens, qsl, num_seqs);
      else
        decode_impl<c10::BFloat16>(geo, query, kv_cache, out, tables, lens, num_seqs);
      break;
    case torch::kHalf:
      if (qsl)
        attention_impl<c10::Half>(geo, query, kv_cache, out, tables, lens, qsl, num_seqs);
      else
        decode_impl<c10::Half>(geo, query, kv_cache, out, tables, lens, num_seqs);
      break;
    default:
      TORCH_CHECK(false, "paged_attention: unsupported dtype ", query.scalar_type());
  }
  return out;
}

// Full causal attention: the entry point other extensions call (entry_points.h).
torch::Tensor paged_attention(torch::Tensor query, const torch::Tensor& kv_cache, int64_t layer,
                              torch::Tensor block_tables, torch::Tensor seq_lens,
                              c10::optional<torch::Tensor> query_start_loc, double scale) {
  return windowed_attention(std::move(query), kv_cache, layer, std::move(block_tables),
                            std::move(seq_lens), std::move(query_start_loc), scale, 0);
}

// Copies key/value [T, KVH, D] into slot slot_mapping[t] (int64) of `layer`.
void write_kv(torch::Tensor kv_cache, int64_t layer, torch::Tensor key, torch::Tensor value,
              torch::Tensor slot_mapping) {
  TORCH_CHECK(kv_cache.device().is_cpu() && kv_cache.dim() == 6 && kv_cache.is_contiguous(),
              "kv_cache must be a contiguous cpu [num_blocks, num_layers, 2, block_size, KVH, D]");
  TORCH_CHECK(layer >= 0 && layer < kv_cache.size(1), "layer out of range");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64, "slot_mapping must be int64");
  const int64_t bs = kv_cache.size(3), kvh = kv_cache.size(4), d = kv_cache.size(5);
  const int64_t tokens = slot_mapping.numel();
  auto rows = [&](torch::Tensor t) {
    TORCH_CHECK(t.scalar_type() == kv_cache.scalar_type() && t.dim() == 3 && t.size(0) == tokens &&
                    t.size(1) == kvh && t.size(2) == d,
                "key/value must be [T, KVH, D] of the cache's dtype");
    return (t.stride(2) == 1 && t.stride(1) == d) ? t : t.contiguous();
  };
  key = rows(key);
  value = rows(value);
  slot_mapping = slot_mapping.contiguous();
  const int64_t elem = kv_cache.element_size();
  const int64_t row_bytes = kvh * d * elem;
  const int64_t block_bytes = kv_cache.stride(0) * elem;
  const int64_t layer_bytes = kv_cache.stride(1) * elem;
  const int64_t value_bytes = kv_cache.stride(2) * elem;
  const int64_t num_slots = kv_cache.size(0) * bs;
  char* base = static_cast<char*>(kv_cache.data_ptr()) + layer * layer_bytes;
  const char* k = static_cast<const char*>(key.data_ptr());
  const char* v = static_cast<const char*>(value.data_ptr());
  const int64_t ks = key.stride(0) * elem, vs = value.stride(0) * elem;
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  std::atomic<bool> bad{false};
  const int64_t grain = std::max<int64_t>(64, (1 << 20) / (2 * row_bytes));
  at::parallel_for(0, tokens, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = slots[t];
      if (slot < 0 || slot >= num_slots) {
        bad = true;
        continue;
      }
      char* dst = base + (slot / bs) * block_bytes + (slot % bs) * row_bytes;
      std::memcpy(dst, k + t * ks, row_bytes);
      std::memcpy(dst + value_bytes, v + t * vs, row_bytes);
    }
  });
  TORCH_CHECK(!bad, "write_kv: slot outside the cache");
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "pdserve CPU paged attention kernels";
  // The kernels touch no Python object: other Python threads run meanwhile.
  m.def("paged_attention", &windowed_attention, "Attention straight from the paged KV cache",
        py::arg("query"), py::arg("kv_cache"), py::arg("layer"), py::arg("block_tables"),
        py::arg("seq_lens"), py::arg("query_start_loc"), py::arg("scale"), py::arg("window") = 0,
        py::call_guard<py::gil_scoped_release>());
  m.def("write_kv", &write_kv, "Store key/value rows into their cache slots", py::arg("kv_cache"),
        py::arg("layer"), py::arg("key"), py::arg("value"), py::arg("slot_mapping"),
        py::call_guard<py::gil_scoped_release>());
  static_assert(std::is_same_v<decltype(&paged_attention), pdserve_entry::AttentionFn>);
  static_assert(std::is_same_v<decltype(&write_kv), pdserve_entry::WriteKvFn>);
  m.attr("paged_attention_entry") =
      pdserve_entry::capsule(&paged_attention, pdserve_entry::kAttention);
  m.attr("write_kv_entry") = pdserve_entry::capsule(&write_kv, pdserve_entry::kWriteKv);
}

#include "attention_plan.h"

#include <algorithm>

#include <c10/util/Exception.h>

namespace splitserve {
namespace {

void check_sequence(const PlanInputs& in, int64_t s) {
  const int64_t start = in.query_start_loc[s];
  const int64_t q_len = in.query_start_loc[s + 1] - start;
  const int64_t seq_len = in.seq_lens[s];
  const int64_t max_ctx = in.max_blocks * in.block_size;
  TORCH_CHECK_VALUE(
      0 <= q_len && q_len <= seq_len && seq_len <= max_ctx, "sequence ", s, ": need 0 <= q_len (",
      q_len, ") <= seq_len (", seq_len, ") <= max_blocks * block_size (", max_ctx, ")");
  const int64_t num_pages = (seq_len + in.block_size - 1) / in.block_size;
  const int64_t* pages = in.block_tables + s * in.max_blocks;
  for (int64_t p = 0; p < num_pages; ++p) {
    TORCH_CHECK_VALUE(
        0 <= pages[p] && pages[p] < in.num_blocks, "sequence ", s, ": block_tables[", s, ", ", p,
        "] = ", pages[p], " is not a block id in [0, ", in.num_blocks, ")");
  }
}

int64_t tile_tokens(const PlanInputs& in) {
  return in.one_token_items ? 1 : std::max<int64_t>(1, kMaxRows / in.group);
}

// (query row x key) pairs of the whole call, over every KV head.
int64_t total_cost(const PlanInputs& in) {
  int64_t total = 0;
  const int64_t step = tile_tokens(in);
  for (int64_t s = 0; s < in.num_seqs; ++s) {
    const int64_t q_len = in.query_start_loc[s + 1] - in.query_start_loc[s];
    const int64_t prefix = in.seq_lens[s] - q_len;
    for (int64_t t0 = 0; t0 < q_len; t0 += step) {
      const int64_t n = std::min(step, q_len - t0);
      total += n * in.group * (prefix + t0 + n);
    }
  }
  return total * in.num_kv_heads;
}

// target: the largest cost one item should have, a share of the whole call that leaves
// every thread several items, so dynamic scheduling can balance them.
void add_tile(const PlanInputs& in, int64_t s, int64_t t0, int64_t n, int64_t target,
              AttentionPlan& plan) {
  const int64_t q_len = in.query_start_loc[s + 1] - in.query_start_loc[s];
  const int64_t pos_begin = in.seq_lens[s] - q_len + t0;
  const int64_t key_end = pos_begin + n;  // the tile's last token sees keys 0 .. pos_begin + n - 1
  const int64_t rows = n * in.group;
  int64_t num_splits = 1;
  if (!in.one_token_items && plan.num_threads > 1 && rows * key_end > target) {
    num_splits = std::min((rows * key_end + target - 1) / target, key_end / kMinSplitKeys);
    num_splits = std::max<int64_t>(num_splits, 1);
  }
  // Split boundaries on multiples of 16 keys (whole key chunks of the kernel).
  const int64_t split_len = ((key_end + num_splits - 1) / num_splits + 15) / 16 * 16;
  num_splits = (key_end + split_len - 1) / split_len;
  // One item over every KV head: a decode tile left whole that stays within the share.
  if (in.whole_decode && n == 1 && num_splits == 1 && in.num_kv_heads > 1 &&
      (plan.num_threads == 1 || rows * key_end * in.num_kv_heads <= target)) {
    plan.items.push_back(WorkItem{static_cast<int32_t>(s), 0, static_cast<int32_t>(in.num_kv_heads),
                                  static_cast<int32_t>(in.query_start_loc[s] + t0), 1,
                                  static_cast<int32_t>(pos_begin), 0, static_cast<int32_t>(key_end), -1,
                                  rows * key_end * in.num_kv_heads});
    return;
  }
  for (int64_t h = 0; h < in.num_kv_heads; ++h) {
    WorkItem item{static_cast<int32_t>(s), static_cast<int32_t>(h), 1,
                  static_cast<int32_t>(in.query_start_loc[s] + t0), static_cast<int32_t>(n),
                  static_cast<int32_t>(pos_begin), 0, static_cast<int32_t>(key_end), -1, 0};
    if (num_splits == 1) {
      item.cost = rows * key_end;
      plan.items.push_back(item);
      continue;
    }
    plan.splits.push_back(SplitTile{item.kv_head, item.tok_begin, item.num_tokens,
                                    plan.num_partials, static_cast<int32_t>(num_splits)});
    for (int64_t k0 = 0; k0 < key_end; k0 += split_len) {
      item.key_begin = static_cast<int32_t>(k0);
      item.key_end = static_cast<int32_t>(std::min(key_end, k0 + split_len));
      item.partial = plan.num_partials++;
      item.cost = rows * (item.key_end - item.key_begin);
      plan.items.push_back(item);
    }
  }
}

}  // namespace

AttentionPlan make_attention_plan(const PlanInputs& in) {
  TORCH_CHECK_VALUE(
      in.query_start_loc[0] == 0 && in.query_start_loc[in.num_seqs] == in.num_tokens,
      "query_start_loc must run from 0 to num_tokens=", in.num_tokens);
  for (int64_t s = 0; s < in.num_seqs; ++s) {
    check_sequence(in, s);
  }
  AttentionPlan plan;
  const int64_t total = total_cost(in);
  plan.num_threads = total < kMinParallelCost ? 1 : in.num_threads;
  const int64_t target = std::max<int64_t>(1, total / (plan.num_threads * kItemsPerThread));
  const int64_t step = tile_tokens(in);
  for (int64_t s = 0; s < in.num_seqs; ++s) {
    const int64_t q_len = in.query_start_loc[s + 1] - in.query_start_loc[s];
    for (int64_t t0 = 0; t0 < q_len; t0 += step) {
      add_tile(in, s, t0, std::min(step, q_len - t0), target, plan);
    }
  }
  // Largest first: with dynamic scheduling, the long items start early (LPT).
  std::stable_sort(plan.items.begin(), plan.items.end(),
                   [](const WorkItem& a, const WorkItem& b) { return a.cost > b.cost; });
  return plan;
}

}  // namespace splitserve

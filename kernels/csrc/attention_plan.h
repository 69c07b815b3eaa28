// How one paged-attention call is cut into work items (host side, no vector code).
//
// A sequence's query tokens are cut into tiles of up to kMaxRows rows, a row being one
// (token, query head of a GQA group) pair; a tile times one KV head is a work item. Its keys
// are the positions 0 .. (position of its last token). When a tile's share of the work is
// too large for the thread count (one long decode, or a batch smaller than the threads), its
// keys are split into ranges, each its own item writing a partial softmax state (running
// max, sum and unnormalised output) that a combine pass merges (flash-decoding).
//
// A decode tile (one query token) whose keys are not split may instead be one item over every
// KV head (`whole_decode`, when the caller's decode kernel takes such items): its pages' K (and
// V) tiles of all heads lie side by side, so the item reads each page's K as one contiguous run
// instead of one head's 4 KB of it, and the hardware keeps more of those reads in flight.
#pragma once

#include <cstdint>
#include <vector>

namespace splitserve {

constexpr int kMaxRows = 32;        // query rows per work item
constexpr int kMinSplitKeys = 128;  // never split a tile's keys into ranges shorter than this
constexpr int kItemsPerThread = 4;  // a split aims at this many items per thread in all
// Below this many (query row x key) pairs in all, one thread runs the call: forking the
// team costs more than the work (a batch-1 decode step's attention is a few microseconds).
constexpr int64_t kMinParallelCost = 32768;

struct WorkItem {
  int32_t seq;
  int32_t kv_head;    // the first KV head of the item
  int32_t num_kv;     // KV heads [kv_head, kv_head + num_kv): 1, or all of them (whole_decode)
  int32_t tok_begin;  // first query token of the tile (row of `query`)
  int32_t num_tokens;
  int32_t pos_begin;  // position of tok_begin in its sequence
  int32_t key_begin;  // key positions [key_begin, key_end)
  int32_t key_end;
  int64_t partial;    // partial-state slot, or -1: the item writes the output itself
  int64_t cost;       // rows x keys
};

struct SplitTile {  // a tile x KV head whose keys were split over `num_splits` items
  int32_t kv_head;
  int32_t tok_begin;
  int32_t num_tokens;
  int64_t first_partial;
  int32_t num_splits;
};

struct AttentionPlan {
  std::vector<WorkItem> items;  // sorted by cost, largest first
  std::vector<SplitTile> splits;
  int64_t num_partials = 0;
  int64_t num_threads = 1;  // threads to run the items on
};

struct PlanInputs {
  const int64_t* seq_lens;         // [num_seqs]
  const int64_t* query_start_loc;  // [num_seqs + 1]
  const int64_t* block_tables;     // [num_seqs, max_blocks]
  int64_t num_seqs;
  int64_t num_tokens;
  int64_t max_blocks;
  int64_t block_size;
  int64_t num_blocks;  // pages in the cache (block ids must be below)
  int64_t num_kv_heads;
  int64_t group;  // query heads per KV head
  int64_t num_threads;
  bool whole_decode = false;  // decode tiles may be one item over every KV head (module comment)
  // Batch invariance (EngineConfig.batch_invariant): every item one token, its keys never split,
  // so each row is attended by the same code on the same keys whatever the call holds: a
  // prompt's row as a decode row, in any batch and any chunk of its prompt.
  bool one_token_items = false;
};

// Validates the batch (raises ValueError naming the sequence) and cuts it into items.
AttentionPlan make_attention_plan(const PlanInputs& in);

}  // namespace splitserve

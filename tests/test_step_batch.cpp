// Host logic of the CUDA model runner that needs no GPU: the KV block allocator, the flattening
// of a batch of sequences into one step (positions, slots, cu_seqlens, block tables, logit rows),
// the padding of a decode step to a graph bucket, and the named model geometries.
#include <gtest/gtest.h>

#include <vector>

#include "model/block_allocator.h"
#include "model/qwen3_moe_config.h"
#include "model/step_batch.h"

namespace moebius::model {
namespace {

TEST(BlockAllocator, GrowsTablesAndReusesReleasedBlocks) {
  BlockAllocator a(5);
  EXPECT_EQ(a.num_blocks(), 5);
  std::vector<int32_t> s0, s1;
  ASSERT_TRUE(a.ensure(s0, 17, 16).ok());  // 2 blocks
  EXPECT_EQ(s0, (std::vector<int32_t>{0, 1}));
  ASSERT_TRUE(a.ensure(s0, 32, 16).ok());  // still 2
  EXPECT_EQ(s0.size(), 2u);
  ASSERT_TRUE(a.ensure(s1, 1, 16).ok());
  EXPECT_EQ(s1, (std::vector<int32_t>{2}));
  ASSERT_TRUE(a.ensure(s0, 33, 16).ok());  // grows by one, after s1's block
  EXPECT_EQ(s0, (std::vector<int32_t>{0, 1, 3}));
  EXPECT_EQ(a.num_free(), 1);
  // Too many: an error naming the shortage, and the table is unchanged.
  auto st = a.ensure(s1, 16 * 3, 16);
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.error().what().find("full"), std::string::npos) << st.error().what();
  EXPECT_EQ(s1, (std::vector<int32_t>{2}));
  EXPECT_EQ(a.num_free(), 1);
  a.release(s0);
  EXPECT_TRUE(s0.empty());
  EXPECT_EQ(a.num_free(), 4);
  ASSERT_TRUE(a.ensure(s0, 48, 16).ok());  // the released blocks come back in their order
  EXPECT_EQ(s0, (std::vector<int32_t>{0, 1, 3}));
  ASSERT_TRUE(a.ensure(s1, 0, 16).ok());
  EXPECT_EQ(s1.size(), 1u);
}

TEST(StepBatch, FlattensSequencesWithPositionsSlotsAndTables) {
  // Sequence 0: 3 new tokens after 14 cached (positions 14..16, crossing block 0 -> 1).
  // Sequence 1: a fresh prompt of 2 tokens.
  const std::vector<int32_t> t0{10, 11, 12}, t1{20, 21}, b0{7, 2}, b1{5};
  const SequenceStep seqs[] = {{t0, 14, b0}, {t1, 0, b1}};
  auto r = make_step_batch(seqs, 16, 4, 8);
  ASSERT_TRUE(r.ok()) << r.error().what();
  const StepBatch& b = *r;
  EXPECT_EQ(b.num_tokens, 5);
  EXPECT_EQ(b.num_seqs, 2);
  EXPECT_EQ(b.max_q_len, 3);
  EXPECT_EQ(b.max_seq_len, 17);
  EXPECT_FALSE(b.is_decode());
  EXPECT_EQ(b.ids, (std::vector<int32_t>{10, 11, 12, 20, 21}));
  EXPECT_EQ(b.positions, (std::vector<int32_t>{14, 15, 16, 0, 1}));
  EXPECT_EQ(b.slot_mapping, (std::vector<int32_t>{7 * 16 + 14, 7 * 16 + 15, 2 * 16 + 0, 5 * 16 + 0, 5 * 16 + 1}));
  EXPECT_EQ(b.cu_seqlens, (std::vector<int32_t>{0, 3, 5}));
  EXPECT_EQ(b.seq_lens, (std::vector<int32_t>{17, 2}));
  EXPECT_EQ(b.block_tables, (std::vector<int32_t>{7, 2, 0, 0, 5, 0, 0, 0}));
  EXPECT_EQ(b.logit_rows, (std::vector<int32_t>{2, 4}));
  auto all = make_step_batch(seqs, 16, 4, 8, /*all_logits=*/true);
  ASSERT_TRUE(all.ok());
  EXPECT_EQ(all->logit_rows, (std::vector<int32_t>{0, 1, 2, 3, 4}));
}

TEST(StepBatch, RefusesBadSequences) {
  const std::vector<int32_t> t{1, 2}, none, short_table{0}, table{0, 1}, bad_block{0, 9};
  auto fails = [](std::vector<SequenceStep> s, const std::string& what) {
    auto r = make_step_batch(s, 16, 2, 8);
    ASSERT_FALSE(r.ok()) << what;
    EXPECT_NE(r.error().what().find(what), std::string::npos) << r.error().what();
  };
  fails({}, "at least one");
  fails({{none, 0, table}}, "no new tokens");
  fails({{t, 15, short_table}}, "block table covers");  // 17 tokens, one block of 16
  fails({{t, 0, bad_block}}, "outside the cache");
  const std::vector<int32_t> long_table{0, 1, 2};
  fails({{t, 0, long_table}}, "at most 2");
  fails({{t, -1, table}}, "starts at");
}

TEST(StepBatch, PadsADecodeStepToAGraphBucket) {
  const std::vector<int32_t> a{3}, b{4}, ta{1}, tb{2, 6};
  const SequenceStep seqs[] = {{a, 5, ta}, {b, 20, tb}};
  auto r = make_step_batch(seqs, 16, 2, 8);
  ASSERT_TRUE(r.ok()) << r.error().what();
  StepBatch s = *r;
  EXPECT_TRUE(s.is_decode());
  s.pad_decode_to(4);
  EXPECT_EQ(s.num_tokens, 2);  // live counts unchanged
  EXPECT_EQ(s.num_seqs, 2);
  EXPECT_EQ(s.ids, (std::vector<int32_t>{3, 4, 0, 0}));
  EXPECT_EQ(s.positions, (std::vector<int32_t>{5, 20, 0, 0}));
  EXPECT_EQ(s.slot_mapping, (std::vector<int32_t>{16 + 5, 6 * 16 + 4, -1, -1}));
  EXPECT_EQ(s.cu_seqlens, (std::vector<int32_t>{0, 1, 2, 2, 2}));
  EXPECT_EQ(s.seq_lens, (std::vector<int32_t>{6, 21, 0, 0}));
  EXPECT_EQ(s.block_tables.size(), 8u);
  EXPECT_EQ(s.logit_rows, (std::vector<int32_t>{0, 1, -1, -1}));
}

TEST(StepBatch, PicksTheShortContextGraphWhileEverySequenceFitsIt) {
  // The runner's order ([TAG_ATTN_CLUSTER_MERGE]): batch 1 short (6.5k) then full (40k), batch 4
  // full only, batch 8 short then full.
  const DecodeGraphSlot g[] = {{1, 6528}, {1, 40960}, {4, 40960}, {8, 4096}, {8, 40960}};
  EXPECT_EQ(pick_decode_graph(g, 1, 1024), 0);
  EXPECT_EQ(pick_decode_graph(g, 1, 6528), 0);  // the plan's context is inclusive
  EXPECT_EQ(pick_decode_graph(g, 1, 6529), 1);
  EXPECT_EQ(pick_decode_graph(g, 2, 100), 2);   // the next batch size up
  EXPECT_EQ(pick_decode_graph(g, 5, 4000), 3);
  EXPECT_EQ(pick_decode_graph(g, 8, 4097), 4);
  EXPECT_EQ(pick_decode_graph(g, 9, 10), -1);        // more sequences than any graph: eager
  EXPECT_EQ(pick_decode_graph(g, 1, 50000), -1);     // longer than every plan: eager
  EXPECT_EQ(pick_decode_graph({}, 1, 1), -1);
}

TEST(Qwen3MoeConfig, NamedGeometries) {
  auto c = named_qwen3_moe_config("qwen3-30b-a3b");
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->hidden_size, 2048);
  EXPECT_EQ(c->num_hidden_layers, 48);
  EXPECT_EQ(c->num_attention_heads, 32);
  EXPECT_EQ(c->num_key_value_heads, 4);
  EXPECT_EQ(c->moe_intermediate_size, 768);
  EXPECT_EQ(c->vocab_size, 151936);
  EXPECT_TRUE(c->is_moe_layer(0) && c->is_moe_layer(47));
  auto big = named_qwen3_moe_config("qwen3-235b-a22b");
  ASSERT_TRUE(big.ok());
  EXPECT_EQ(big->num_hidden_layers, 94);
  EXPECT_EQ(big->num_attention_heads, 64);
  auto bad = named_qwen3_moe_config("llama");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.error().field(), "--geometry");
}

}  // namespace
}  // namespace moebius::model

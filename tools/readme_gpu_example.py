"""The README's GPU example, run by tools/device_check.sh (python step)."""

import torch

import kdtree

draft_logits = torch.randn(4, 15, 32000, device="cuda", dtype=torch.bfloat16)   # [B, L, V]
roots = torch.tensor([11, 12, 13, 14], dtype=torch.int32, device="cuda")   # int32 ids
trees = kdtree.build_trees_from_logits(draft_logits, 16, budget=64, root_tokens=roots)
prefix = torch.tensor([100, 7, 52, 9], device="cuda")          # int64: cached tokens per request
mask, _, positions = kdtree.tree_attention_mask(trees, prefix, kind="additive",
                                                dtype="bfloat16")   # [B, N+1, max(p)+N+1]
target_logits = torch.randn(4, 65, 32000, device="cuda", dtype=torch.bfloat16)  # [B, N+1, V]
acc = kdtree.verify_greedy_from_logits(trees, target_logits)
# or: kdtree.verify_sample_from_logits(trees, target_logits, 0.8, seed=1, offset=round_no)
# kdtree.compact_kv(k_layers, v_layers, prefix, acc)     # per-layer [B, H, S, D] tensors
# out, _, _ = kdtree.tree_attention(q, k_cache, v_cache, trees, prefix)
#   q [B, N+1, q_heads, D]; caches [B, kv_heads, S, D] holding the tree rows at p .. p+N

"""The top-k benchmark shape (B=64, L=16, V=151,936, bf16, K=64) called a few times, for
Nsight Compute on the device machine, e.g.:

    ncu -k regex:topk --launch-skip 4 --launch-count 2 --section SpeedOfLight \
        python3 tools/profile_topk.py
"""

import torch

import kdtree

x = (torch.randn(64, 16, 151936, device="cuda") * 1.5).to(torch.bfloat16)
for _ in range(3):
    kdtree.topk_logprobs(x, 64, errors="status")
torch.cuda.synchronize()

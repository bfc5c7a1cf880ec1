"""Where auto's host time goes on a call where it keeps SDPA (cProfile, 300 calls), beside mode "sdpa"."""
import cProfile
import pstats
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import sage_diffusers as sd  # noqa: E402

q = torch.randn(1, 16, 1023, 64, device="cuda", dtype=torch.bfloat16)
k = torch.randn(1, 16, 4608, 64, device="cuda", dtype=torch.bfloat16)
for mode in ("sdpa", "auto"):
    for _ in range(20):
        sd.attention(q, k, k, mode=mode)
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(300):
        sd.attention(q, k, k, mode=mode)
    prof.disable()
    torch.cuda.synchronize()
    print(f"== mode={mode}")
    pstats.Stats(prof).sort_stats("tottime").print_stats(14)

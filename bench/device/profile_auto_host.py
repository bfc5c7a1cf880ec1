"""Where auto's host time goes (cProfile, 300 calls each): a masked call it runs the kernel for,
beside mode "int8", and a cross-attention it keeps on SDPA, beside mode "sdpa"."""
import cProfile
import pstats
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import sage_diffusers as sd  # noqa: E402

g = torch.Generator(device="cuda").manual_seed(0)
kernel_call = [torch.randn(1, 24, 1024, 128, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3)]
mask = torch.rand(1, 1024, device="cuda", generator=g) > 0.1
q = torch.randn(1, 16, 1023, 64, device="cuda", dtype=torch.bfloat16)
k = torch.randn(1, 16, 4608, 64, device="cuda", dtype=torch.bfloat16)
for name, args, kwargs, modes in (("kernel call", kernel_call, dict(key_mask=mask), ("int8", "auto")),
                                  ("sdpa call", (q, k, k), {}, ("sdpa", "auto"))):
    for mode in modes:
        for _ in range(20):
            sd.attention(*args, **kwargs, mode=mode)
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(300):
            sd.attention(*args, **kwargs, mode=mode)
        prof.disable()
        torch.cuda.synchronize()
        print(f"== {name}, mode={mode}")
        pstats.Stats(prof).sort_stats("tottime").print_stats(12)

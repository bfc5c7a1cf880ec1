"""torch.compile(fullgraph=True) over the API where policies put it: inside torch.cond branches."""
import torch

import sage_diffusers as sd


def test_fallback_inside_torch_cond_branch_compiles():
    """Bug: a counted fallback inside a torch.cond branch (where step policies put their modes)
    failed under torch.compile(fullgraph=True): the counter's dict update is a side effect that
    higher-order ops refuse (UncapturedHigherOrderOpError)."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, 96, generator=g) for n in (16, 24, 24))  # head dim 96: counted fallback

    def fn(q, k, v, flag):
        return torch.cond(flag, lambda a, b, c: sd.attention(a, b, c, mode="int8"),
                          lambda a, b, c: sd.attention(a, b, c, mode="sdpa") * 2, (q, k, v))

    sd.reset_fallback_stats()
    compiled = torch.compile(fn, fullgraph=True, backend="eager")
    exact = sd.attention(q, k, v, mode="sdpa")
    torch.testing.assert_close(compiled(q, k, v, torch.tensor(True)), exact)
    torch.testing.assert_close(compiled(q, k, v, torch.tensor(False)), exact * 2)
    assert any("head dim 96" in r for r in sd.fallback_stats()), sd.fallback_stats()
    torch._dynamo.reset()

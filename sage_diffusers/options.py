"""Option enums shared by the API, the references and the kernels.

Every option that users pass as a string is parsed into one of these enums once, at the API
boundary; everything below the boundary compares enum members, never strings.
"""
from __future__ import annotations

import enum


class ParsedEnum(str, enum.Enum):
    """String-valued enum whose ``parse`` gives a clear error naming the accepted values."""

    @classmethod
    def parse(cls, value: "str | ParsedEnum"):
        if isinstance(value, cls):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            accepted = ", ".join(repr(m.value) for m in cls)
            raise ValueError(f"{cls.option_name()}: expected one of {accepted}, got {value!r}") from None

    @classmethod
    def option_name(cls) -> str:
        """How error messages name the option."""
        return cls.__name__

    def __str__(self) -> str:  # print as the plain value, e.g. "int8"
        return self.value


class Mode(ParsedEnum):
    """Which attention implementation to run.

    AUTO picks the fastest accurate path for the device (8-bit kernel on sm_90, FP4 on sm_120,
    SDPA elsewhere); FP4 and INT8 force a SageAttention algorithm (the torch reference where no
    kernel exists); SDPA always calls ``torch.nn.functional.scaled_dot_product_attention``.
    """

    AUTO = "auto"
    FP4 = "fp4"
    INT8 = "int8"
    SDPA = "sdpa"


class Int8Precision(ParsedEnum):
    """The 8-bit algorithm's P~.V product: what the 8-bit paths compute wherever they run (the Hopper
    kernel's two shipped policies, the Triton kernel of other GPUs, the torch reference).

    FAST (the default) multiplies P~ and V in FP8 E4M3, as SageAttention2's Hopper kernel does;
    ACCURATE multiplies them in the 16-bit input dtype with FP32 accumulation: about a third of the
    error against exact attention (rel-L1 0.012 against 0.038 on the benchmark inputs) for 0-20 %
    more time per call on an H100 (eval/results/kernels_h100.md). ``mode="auto"`` decides with the
    timings of the policy that would run (kernels/auto_table.py).
    """

    FAST = "fast"
    ACCURATE = "accurate"

    @classmethod
    def option_name(cls) -> str:
        return "int8_precision"


class Layout(ParsedEnum):
    """Memory order of the four attention dimensions: batch, heads, sequence, head dim."""

    BHSD = "bhsd"
    BSHD = "bshd"


class PQuant(ParsedEnum):
    """How the FP4 path quantizes the softmax probabilities P~."""

    TWO_LEVEL = "two_level"  # per-row FP32 factor s1 = rowmax/(448*6), then NVFP4 of P~/s1
    DIRECT = "direct"  # NVFP4 of P~ itself (the paper's ablation baseline)


class FP4Format(ParsedEnum):
    """Microscaling format of the FP4 path."""

    NVFP4 = "nvfp4"  # E2M1 values, one E4M3 scale per 16 elements
    MXFP4 = "mxfp4"  # E2M1 values, one power-of-two E8M0 scale per 32 elements

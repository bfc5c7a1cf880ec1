"""Readable torch references: the numerical specification every kernel is tested against."""
from .formats import E2M1_VALUES, e2m1_decode, e2m1_encode, e4m3_round, pack_nibbles, unpack_nibbles
from .metrics import cosine, relative_l1, rmse
from .online_softmax import BLOCK_KV
from .quant import (
    dequantize_mxfp4,
    dequantize_nvfp4,
    finite_abs,
    fp4_tensor_scale,
    quantize_fp8_per_channel,
    quantize_int8_per_block,
    quantize_int8_per_token,
    quantize_mxfp4,
    quantize_nvfp4,
)
from .sage3 import fp4_tensor_roundtrip, sage3_reference, smooth_q
from .sage8 import sage8_quantize, sage8_reference

__all__ = [
    "BLOCK_KV", "E2M1_VALUES", "cosine", "dequantize_mxfp4", "dequantize_nvfp4", "e2m1_decode",
    "e2m1_encode", "e4m3_round", "finite_abs", "fp4_tensor_roundtrip", "fp4_tensor_scale", "pack_nibbles",
    "quantize_fp8_per_channel", "quantize_int8_per_block", "quantize_int8_per_token", "quantize_mxfp4",
    "quantize_nvfp4", "relative_l1", "rmse",
    "sage3_reference", "sage8_quantize", "sage8_reference", "smooth_q", "unpack_nibbles",
]

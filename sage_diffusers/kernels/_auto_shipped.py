"""Measured "auto" tables shipped per GPU model (written by ``python -m eval.calibrate_auto --ship``).

{GPU model (``auto_table.gpu_model``): {call class: minimum B*Hq*Sq*Skv for the kernel, or None}};
the source of each is named in SOURCES. See ``auto_table`` for what the numbers mean.
"""
TABLES: dict[str, dict[str, object]] = {
    'NVIDIA H100 80GB HBM3 (132 SMs)': {
        'd64_full': 1966966532,
        'd64_full_ragged': 759897646,
        'd64_full_gqa': 997932479,
        'd64_full_gqa_ragged': 330707265,
        'd64_full_mask': 50331648,
        'd64_full_mask_ragged': 43502592,
        'd64_full_mask_gqa': 50331648,
        'd64_full_mask_gqa_ragged': 43502592,
        'd64_causal': 14687272570,
        'd64_causal_ragged': 19346637805,
        'd64_causal_gqa': 5793167346,
        'd64_causal_gqa_ragged': 9049277453,
        'd64_causal_mask': 50331648,
        'd64_causal_mask_ragged': 43502592,
        'd64_causal_mask_gqa': 50331648,
        'd64_causal_mask_gqa_ragged': 43502592,
        'd128_full': 3001584465,
        'd128_full_ragged': 1230658199,
        'd128_full_gqa': 1390362093,
        'd128_full_gqa_ragged': 512492087,
        'd128_full_mask': 25165824,
        'd128_full_mask_ragged': 21751296,
        'd128_full_mask_gqa': 25165824,
        'd128_full_mask_gqa_ragged': 21751296,
        'd128_causal': None,
        'd128_causal_ragged': None,
        'd128_causal_gqa': None,
        'd128_causal_gqa_ragged': 6013487068,
        'd128_causal_mask': 25165824,
        'd128_causal_mask_ragged': 21751296,
        'd128_causal_mask_gqa': 25165824,
        'd128_causal_mask_gqa_ragged': 21751296,
    },
}
SOURCES: dict[str, str] = {
    'NVIDIA H100 80GB HBM3 (132 SMs)': 'eval/results/auto_h100.json (2026-12-06 03:36, commit 0556977)',
}

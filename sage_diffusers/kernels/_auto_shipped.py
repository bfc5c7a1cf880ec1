"""Measured "auto" tables shipped per GPU model (written by ``python -m eval.calibrate_auto --ship``).

{GPU model (``auto_table.gpu_model``): {call class: minimum B*Hq*Sq*Skv for the kernel, or None}};
the source of each is named in SOURCES. See ``auto_table`` for what the numbers mean.
"""
TABLES: dict[str, dict[str, object]] = {
    'NVIDIA H100 80GB HBM3 (132 SMs)': {
        'd64_full': 2442898420,
        'd64_full_ragged': 701981558,
        'd64_full_gqa': 988874041,
        'd64_full_gqa_ragged': 311726113,
        'd64_full_mask': 50331648,
        'd64_full_mask_ragged': 43502592,
        'd64_full_mask_gqa': 50331648,
        'd64_full_mask_gqa_ragged': 43502592,
        'd64_causal': 12243099732,
        'd64_causal_ragged': 13277033427,
        'd64_causal_gqa': 6692901660,
        'd64_causal_gqa_ragged': 9477026245,
        'd64_causal_mask': 50331648,
        'd64_causal_mask_ragged': 43502592,
        'd64_causal_mask_gqa': 50331648,
        'd64_causal_mask_gqa_ragged': 43502592,
        'd128_full': 5545384405,
        'd128_full_ragged': 1218907559,
        'd128_full_gqa': 1483072034,
        'd128_full_gqa_ragged': 489925438,
        'd128_full_mask': 25165824,
        'd128_full_mask_ragged': 21751296,
        'd128_full_mask_gqa': 25165824,
        'd128_full_mask_gqa_ragged': 21751296,
        'd128_causal': None,
        'd128_causal_ragged': None,
        'd128_causal_gqa': None,
        'd128_causal_gqa_ragged': None,
        'd128_causal_mask': 25165824,
        'd128_causal_mask_ragged': 21751296,
        'd128_causal_mask_gqa': 25165824,
        'd128_causal_mask_gqa_ragged': 21751296,
    },
}
SOURCES: dict[str, str] = {
    'NVIDIA H100 80GB HBM3 (132 SMs)': 'eval/results/auto_h100.json (2026-12-06 06:29, commit 6da8948)',
}

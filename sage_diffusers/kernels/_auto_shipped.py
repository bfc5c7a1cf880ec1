"""Measured "auto" tables shipped per GPU model (written by ``python -m eval.calibrate_auto --ship``).

{GPU model (``auto_table.gpu_model``): {call class: minimum work for the kernel, or None}}; the
source of each is named in SOURCES. See ``auto_table`` for what the numbers mean.
"""
TABLES: dict[str, dict[str, object]] = {}
SOURCES: dict[str, str] = {}

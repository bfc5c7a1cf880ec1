"""GPU kernels of sage_diffusers, built just in time on first use.

Submodules (imported on demand; importing this package builds nothing):

- ``int8_sm90``: Hopper (sm_90a) 8-bit attention, sage8 numerics (INT8 QK^T, FP8 PV).
- ``fp4``: FP4 microscaling attention, native on sm_120a, emulated on sm_90a.
- ``sagebwd_triton``: SageBwd's Triton kernels (trainable INT8; its forward is the 8-bit inference
  kernel of sm_80 to sm_89).

Every kernel module exposes ``is_available() -> (bool, reason)``, ``build()`` and a backend
function under the one backend contract. Which kernel serves which mode, arch, head dims and
dtypes is declared in the registry, ``sage_diffusers.backends``, which the API, the self-check,
the doctor and ``python -m sage_diffusers build`` all read.
"""

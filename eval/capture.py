"""Capture the Q, K, V of every attention call of a diffusers model, for ``eval.accuracy --suite captured``.

    python -m eval.capture --tiny flux --out DIR                       # tiny random transformer, CPU
    python -m eval.capture --random-real cogvideox-5b --quick --out DIR   # real config, random weights (GPU)
    python -m eval.capture --pipeline PATH --pipeline-class FluxPipeline --prompt "..." --steps 28 --out DIR

Python::

    with Capture(pipe.transformer, "captures/", model="flux-dev", steps={0, 14, 27}):
        pipe(prompt)

How: a forward pre-hook on every attention module (any module with a ``processor``: diffusers'
``Attention`` and the ``AttentionModuleMixin`` classes) names the layer being run, a pre-hook on the
transformer counts denoising steps (a new ``timestep`` value starts the next step; CFG calls that
repeat it stay in the step), and ``torch.nn.functional.scaled_dot_product_attention`` is wrapped for
the duration, which both diffusers' processors and its dispatcher's native backend call. So the
capture needs diffusers' own processors (capture before ``sage_diffusers.enable``), and it sees
exactly what SDPA gets: (B, H, S, D) after projections, norms and RoPE.

Each call becomes one safetensors file ``{model}_s{step:03d}_l{layer:03d}_c{call}.safetensors`` with
tensors ``q``, ``k``, ``v`` (BHSD, in ``dtype``) and ``key_mask`` (bool (B, Skv)) when SDPA got a
key-padding mask (a general mask is stored as ``attn_mask``), and string metadata ``model``,
``layer`` (module name), ``layer_index``, ``step``, ``call``, ``shape``, ``scale``, ``is_causal``.
"""
from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path
from typing import Any, Iterable, Optional

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

try:
    from eval import _cli
except ImportError:  # run as a script: eval/ is sys.path[0]
    import _cli

ROOT = Path(__file__).resolve().parents[1]


def attention_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of every attention module of ``model``, in registration order."""
    return [(n, m) for n, m in model.named_modules() if hasattr(m, "processor") and n]


def _timestep_of(args: tuple, kwargs: dict) -> Optional[float]:
    t = kwargs.get("timestep")
    if t is None and len(args) > 2 and torch.is_tensor(args[2]):
        t = args[2]
    if not torch.is_tensor(t):
        return None if t is None else float(t)
    return float(t.flatten()[0])


def _key_mask_of(mask: torch.Tensor, b: int, skv: int) -> Optional[torch.Tensor]:
    """A bool SDPA mask that only varies over batch and keys, as (B, Skv); None otherwise."""
    if mask.dtype != torch.bool or mask.shape[-1] != skv:
        return None
    m = mask.reshape((1,) * (4 - mask.ndim) + tuple(mask.shape))  # (B' | 1, H' | 1, Sq' | 1, Skv)
    if not bool((m == m[:, :1, :1]).all()):
        return None  # varies over heads or queries: a general mask
    return m[:, 0, 0].expand(b, skv).contiguous()


class Capture(contextlib.AbstractContextManager):
    """Save the SDPA inputs of ``model``'s attention modules while the context is open.

    Parameters
    ----------
    model : the transformer (a pipeline's ``transformer``).
    out_dir : folder for the safetensors files (created).
    model_name : written to each file's metadata and name.
    steps : denoising steps to keep (0-based), None = all.
    layers : attention-module indices to keep (order of ``attention_modules``), None = all.
    dtype : storage dtype of q, k, v (default bfloat16, what the kernels take).
    """

    def __init__(self, model: torch.nn.Module, out_dir: "str | Path", model_name: str = "model",
                 steps: Optional[Iterable[int]] = None, layers: Optional[Iterable[int]] = None,
                 dtype: torch.dtype = torch.bfloat16):
        self.model, self.out_dir, self.model_name = model, Path(out_dir), model_name
        self.steps = None if steps is None else set(steps)
        self.layers = None if layers is None else set(layers)
        self.dtype = dtype
        self.files: list[Path] = []
        self._handles: list[Any] = []
        self._layer: Optional[tuple[int, str]] = None
        self._calls = 0
        self._step, self._last_t = -1, None
        self._sdpa = None

    # hooks -------------------------------------------------------------------------------
    def _on_transformer(self, module, args, kwargs):
        t = _timestep_of(args, kwargs)
        if self._step < 0 or t is None or t != self._last_t:
            self._step += 1
        self._last_t = t

    def _enter_layer(self, index: int, name: str):
        def hook(module, args):
            self._layer, self._calls = (index, name), 0
        return hook

    def _leave_layer(self, module, args, output):
        self._layer = None

    def _wanted(self) -> bool:
        if self._layer is None:
            return False
        step = max(self._step, 0)
        return (self.steps is None or step in self.steps) and (self.layers is None or self._layer[0] in self.layers)

    def _wrapped_sdpa(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                      **kwargs):
        if self._wanted() and query.ndim == 4:
            self._save(query, key, value, attn_mask, is_causal, scale)
        return self._sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                          scale=scale, **kwargs)

    def _save(self, q, k, v, attn_mask, is_causal, scale):
        index, name = self._layer
        step = max(self._step, 0)
        tensors = {n: t.detach().to(self.dtype).contiguous().cpu() for n, t in (("q", q), ("k", k), ("v", v))}
        if attn_mask is not None:
            km = _key_mask_of(attn_mask, q.shape[0], k.shape[-2])
            if km is not None:
                tensors["key_mask"] = km.cpu()
            else:
                tensors["attn_mask"] = attn_mask.detach().contiguous().cpu()
        meta = dict(model=self.model_name, layer=name, layer_index=str(index), step=str(step),
                    call=str(self._calls), shape="x".join(map(str, q.shape)), layout="BHSD",
                    scale="" if scale is None else repr(float(scale)), is_causal=str(bool(is_causal)))
        path = self.out_dir / f"{self.model_name}_s{step:03d}_l{index:03d}_c{self._calls}.safetensors"
        save_file(tensors, str(path), metadata=meta)
        self.files.append(path)
        self._calls += 1

    # context -----------------------------------------------------------------------------
    def __enter__(self) -> "Capture":
        self.out_dir.mkdir(parents=True, exist_ok=True)
        mods = attention_modules(self.model)
        if not mods:
            raise ValueError(f"{type(self.model).__name__} has no attention modules (modules with a processor)")
        self._handles.append(self.model.register_forward_pre_hook(self._on_transformer, with_kwargs=True))
        for i, (name, m) in enumerate(mods):
            self._handles.append(m.register_forward_pre_hook(self._enter_layer(i, name)))
            self._handles.append(m.register_forward_hook(self._leave_layer))
        self._sdpa = F.scaled_dot_product_attention
        torch.nn.functional.scaled_dot_product_attention = self._wrapped_sdpa
        return self

    def __exit__(self, *exc) -> None:
        torch.nn.functional.scaled_dot_product_attention = self._sdpa
        for h in self._handles:
            h.remove()
        self._handles.clear()


# ---------------------------------------------------------------------------------------------
# command line

def _tiny_module():
    sys.path.insert(0, str(ROOT / "workflows" / "diffusers"))
    import _sage_tiny

    return _sage_tiny


def _tiny(family: str):
    _sage_tiny = _tiny_module()
    model = _sage_tiny.tiny_transformer(family)
    return model, [_sage_tiny.tiny_inputs(family, model)]


def _random_real(name: str, quick: bool, device: str):
    from eval import bench_e2e

    spec = bench_e2e.MODELS[name]
    dtype = torch.bfloat16 if device != "cpu" else torch.float32
    model = bench_e2e.build_model(spec, torch.device(device), dtype)
    return model, [bench_e2e.build_inputs(spec, quick, torch.device(device), dtype)]


def check_args(args: argparse.Namespace) -> None:
    """Refuse what would fail once a model is built: unknown sources, a pipeline folder without its index.

    Raises
    ------
    eval._cli.InputError naming the option or file and what was expected.
    """
    if args.tiny is not None:
        families = [f.value for f in _tiny_module().Family]
        if args.tiny not in families:
            raise _cli.InputError(f"--tiny {args.tiny}: unknown family; known: {', '.join(families)}")
    if args.random_real is not None:
        from eval import bench_e2e

        if args.random_real not in bench_e2e.MODELS:
            raise _cli.InputError(f"--random-real {args.random_real}: unknown model; known: "
                                  f"{', '.join(bench_e2e.MODELS)}")
    if args.tiny is None and args.device.startswith("cuda") and not torch.cuda.is_available():
        raise _cli.InputError(f"--device {args.device}: CUDA is not available")
    if args.pipeline is None:
        for option, value in (("--pipeline-class", args.pipeline_class != PIPELINE_CLASS),
                              ("--num-steps", args.num_steps is not None)):
            if value:
                raise _cli.InputError(f"{option} is for --pipeline")
        return
    _cli.read_json(args.pipeline / "model_index.json", "pipeline index", keys=("_class_name",))
    import diffusers

    if not isinstance(getattr(diffusers, args.pipeline_class, None), type):
        raise _cli.InputError(f"--pipeline-class {args.pipeline_class}: not a class of diffusers "
                              f"{diffusers.__version__} (e.g. DiffusionPipeline, FluxPipeline)")


PIPELINE_CLASS = "DiffusionPipeline"


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description="Capture Q/K/V of a diffusers model's attention calls")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--tiny", metavar="FAMILY", help="tiny random transformer: cogvideox, hunyuanvideo, mochi, "
                                                      "flux, sd35 (one forward, CPU)")
    src.add_argument("--random-real", metavar="MODEL", help="real config with random weights, one forward "
                                                            "(names of eval/bench_e2e.py)")
    src.add_argument("--pipeline", type=_cli.existing_dir, help="local diffusers pipeline folder (from_pretrained)")
    ap.add_argument("--pipeline-class", default=PIPELINE_CLASS)
    ap.add_argument("--prompt", default="A red panda reading a newspaper in a sunlit cafe, cinematic lighting")
    ap.add_argument("--num-steps", type=_cli.positive_int, default=None, help="--pipeline: denoising steps")
    ap.add_argument("--quick", action="store_true", help="--random-real: fewer frames (bench_e2e --quick)")
    ap.add_argument("--steps", type=_cli.int_set, default=None, help="steps to keep, comma separated (default all)")
    ap.add_argument("--layers", type=_cli.int_set, default=None,
                    help="attention-module indices to keep, comma separated")
    ap.add_argument("--name", default=None, help="model name in the metadata")
    ap.add_argument("--device", type=_cli.device_argument, default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=_cli.nonnegative_int, default=0)
    ap.add_argument("--out", type=_cli.output_dir, required=True)
    args = ap.parse_args(argv)
    try:
        check_args(args)
    except _cli.InputError as e:
        ap.error(str(e))
    torch.manual_seed(args.seed)
    steps, layers = args.steps, args.layers
    if args.pipeline is not None:
        import diffusers

        pipe = getattr(diffusers, args.pipeline_class).from_pretrained(str(args.pipeline), torch_dtype=torch.bfloat16)
        pipe.to(args.device)
        name = args.name or args.pipeline.name
        call = dict(prompt=args.prompt, generator=torch.Generator(args.device).manual_seed(args.seed))
        if args.num_steps:
            call["num_inference_steps"] = args.num_steps
        with Capture(pipe.transformer, args.out, name, steps, layers) as cap, torch.no_grad():
            pipe(**call)
    else:
        model, inputs = _tiny(args.tiny) if args.tiny else _random_real(args.random_real, args.quick, args.device)
        name = args.name or (f"tiny-{args.tiny}" if args.tiny else args.random_real)
        with Capture(model, args.out, name, steps, layers) as cap, torch.no_grad():
            for kw in inputs:
                model(**kw, return_dict=False)
    print(f"captured {len(cap.files)} attention calls into {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

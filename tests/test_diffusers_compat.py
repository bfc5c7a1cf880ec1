"""A newer diffusers without an upper pin: what it lacks turns off only what needs it, with a message that says so.

Each case simulates a future release ("0.45.0") by taking one hook away from the installed diffusers before
``sage_diffusers`` is imported, in a fresh interpreter (the hooks are read at import, and the backends' enum members
and registrations are process-wide). It then checks that the package imports, that the error or the single warning
names the version and the missing piece, and that ``sage_diffusers.enable`` on a tiny model of a family that does
not need the hook still runs and matches diffusers' output (SDPA mode: the same maths). The context-parallel hooks
are read per call, so those cases run here with ``monkeypatch``.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "workflows" / "diffusers"))

import _sage_tiny  # noqa: E402
from _sage_tiny import Family  # noqa: E402

from sage_diffusers.options import Mode  # noqa: E402
from sage_diffusers.processors import PROCESSOR_FOR, PROCESSOR_FOR_MODULE  # noqa: E402
from sage_diffusers.processors import _diffusers_compat as compat  # noqa: E402
from sage_diffusers.processors.context_parallel import context_parallel_attention, context_parallel_plan  # noqa: E402

FUTURE = "0.45.0"

# ---------------------------------------------------------------------------------------------------------------
# The pin and the installed diffusers


def _pyproject() -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_diffusers_extra_has_a_lower_bound_and_no_upper_bound():
    extra = _pyproject()["project"]["optional-dependencies"]["diffusers"]
    (req,) = [Requirement(r) for r in extra if Requirement(r).name == "diffusers"]
    operators = {spec.operator for spec in req.specifier}
    assert operators == {">="}, f"diffusers must have a lower bound only, got {req}"


def test_installed_diffusers_has_every_hook():
    """With the diffusers installed here (CI: the newest release) nothing is turned off: a failure names the hook."""
    assert compat.backend_problem() is None, compat.backend_problem()
    assert len(PROCESSOR_FOR) == 13, sorted(cls.__name__ for cls in PROCESSOR_FOR)
    assert len(PROCESSOR_FOR_MODULE) == 6, sorted(cls.__name__ for cls in PROCESSOR_FOR_MODULE)
    for base in PROCESSOR_FOR:
        assert not compat.is_missing(base), compat.missing_what(base)
    inp, out = compat.context_parallel_io()
    assert inp.__name__ == "ContextParallelInput" and out.__name__ == "ContextParallelOutput"
    assert compat.model_cp_plan(_sage_tiny.tiny_transformer(Family.FLUX)) is not None


def test_diffusers_is_reached_only_through_the_compat_layer():
    """Only ``_diffusers_compat.py`` imports from diffusers or names its private hooks (docstrings aside)."""
    private = {
        "_AttentionBackendRegistry", "_member_map_", "_value2member_map_", "_member_names_", "_check_device",
        "_check_shape", "_cp_plan", "_ring_mesh", "_ulysses_mesh", "_flattened_mesh", "_modeling_parallel",
        "attention_dispatch", "_backends", "_supports_context_parallel",
    }
    offenders = []
    for path in sorted((ROOT / "sage_diffusers").rglob("*.py")):
        if path.name == "_diffusers_compat.py":
            continue
        tree = ast.parse(path.read_text())
        through_compat = {  # compat.cp_mesh(cp, "_ring_mesh"): the layer checks the name it is given
            id(arg) for call in ast.walk(tree) if isinstance(call, ast.Call)
            and isinstance(call.func, ast.Attribute) and getattr(call.func.value, "id", None) == "compat"
            for arg in call.args
        }
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "diffusers":
                names = [f"from {node.module} import"]
            elif isinstance(node, ast.Attribute):
                names = [node.attr]
            elif isinstance(node, ast.Name):
                names = [node.id]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in through_compat:
                names = [node.value]  # getattr(obj, "_cp_plan")
            offenders += [f"{path.relative_to(ROOT)}:{node.lineno}: {n}" for n in names
                          if n in private or n.startswith("from diffusers")]
    assert not offenders, offenders


# ---------------------------------------------------------------------------------------------------------------
# Simulated future diffusers, each in a fresh interpreter

_SCRIPT = """
import json, logging, sys
sys.path.insert(0, {workflows!r})
import torch
import diffusers
import _sage_tiny
from _sage_tiny import Family

records = []


class _Keep(logging.Handler):
    def emit(self, record):
        records.append([record.levelname, record.getMessage()])


logging.getLogger("sage_diffusers").addHandler(_Keep())
logging.getLogger("sage_diffusers").setLevel(logging.DEBUG)
diffusers.__version__ = {future!r}
# Built before the hook goes: diffusers' own constructors may use what the patch takes away.
models = {{f: _sage_tiny.tiny_transformer(f) for f in (Family.SD35, Family.FLUX)}}
inputs = {{f: _sage_tiny.tiny_inputs(f, m) for f, m in models.items()}}
with torch.no_grad():
    reference = {{f: m(**inputs[f], return_dict=False)[0] for f, m in models.items()}}

{patch}

import sage_diffusers as sd
from sage_diffusers import integration, processors
from sage_diffusers.processors import _diffusers_compat as compat
from sage_diffusers.processors import backend

result = {{"served": sorted(c.__name__ for c in processors.PROCESSOR_FOR),
          "modules": sorted(c.__name__ for c in processors.PROCESSOR_FOR_MODULE)}}


def attempt(key, fn):
    try:
        value = fn()
    except Exception as exc:
        result[key] = ["raised", type(exc).__name__, str(exc)]
    else:
        result[key] = ["ok", repr(value)]


def run(family):
    sd.enable(models[family], mode="sdpa")
    with torch.no_grad():
        out = models[family](**inputs[family], return_dict=False)[0]
    sd.disable(models[family])
    return float((out - reference[family]).abs().max())


attempt("run_sd35", lambda: run(Family.SD35))
attempt("run_flux", lambda: run(Family.FLUX))
attempt("register_backend", lambda: sorted(m.value for m in integration.register_backend().values()))
attempt("backend_member", lambda: backend.backend_member(sd.Mode.INT8))
attempt("flux_processor", lambda: processors.SageFluxAttnProcessor(mode="int8")._attention_backend)
{extra}
result["records"] = records
print("RESULT " + json.dumps(result))
"""


def _simulate(patch: str, extra: str = "") -> dict:
    script = _SCRIPT.format(workflows=str(ROOT / "workflows" / "diffusers"), future=FUTURE,
                            patch=textwrap.dedent(patch), extra=textwrap.dedent(extra))
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (line,) = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    return json.loads(line[len("RESULT "):])


def _warnings(result: dict) -> list[str]:
    return [message for level, message in result["records"] if level == "WARNING"]


def _ran_exactly(result: dict, key: str) -> None:
    status, *detail = result[key]
    assert status == "ok", detail
    assert float(detail[0]) <= 1e-5, f"{key}: sage SDPA mode differs from diffusers by {detail[0]}"


def _raised(result: dict, key: str, kind: str, *needles: str) -> str:
    status, *detail = result[key]
    assert status == "raised" and detail[0] == kind, result[key]
    for needle in needles:
        assert needle in detail[1], (needle, detail[1])
    return detail[1]


SDPA_FAMILIES = ["CogVideoXAttnProcessor2_0", "JointAttnProcessor2_0", "MochiAttnProcessor2_0"]

# Ways a release could take the dispatcher's private hooks away, and the name the message must give.
BACKEND_HOOKS = {
    "no_enum": ("del dispatch.AttentionBackendName", "AttentionBackendName"),
    "enum_not_an_enum": ("dispatch.AttentionBackendName = type('AttentionBackendName', (str,), {})",
                         "AttentionBackendName"),
    "no_registry": ("del dispatch._AttentionBackendRegistry", "_AttentionBackendRegistry.register"),
    "registry_without_register": ("dispatch._AttentionBackendRegistry = type('_AttentionBackendRegistry', (), {})",
                                  "_AttentionBackendRegistry.register"),
}


@pytest.mark.parametrize("hook", list(BACKEND_HOOKS))
def test_missing_backend_hook_turns_off_the_backends_with_one_warning(hook):
    patch, missing = BACKEND_HOOKS[hook]
    result = _simulate(f"from diffusers.models import attention_dispatch as dispatch\n{patch}")

    (warning,) = _warnings(result)  # import, enable and register_backend together: said once
    for needle in (f"diffusers {FUTURE}", missing, "sage_diffusers_*", "Still works: sage_diffusers.enable"):
        assert needle in warning, (needle, warning)
    assert result["served"] == SDPA_FAMILIES  # the processors that need no backend
    assert result["modules"] == ["MochiAttention"]
    _ran_exactly(result, "run_sd35")
    _raised(result, "run_flux", "ValueError", "no attention processor of a supported type")
    assert result["register_backend"] == ["ok", "[]"]
    assert warning.endswith(_raised(result, "backend_member", "DiffusersCompatError", f"diffusers {FUTURE}", missing))
    _raised(result, "flux_processor", "DiffusersCompatError", f"diffusers {FUTURE}", missing)


# A processor class a release could drop or rename: (patch, diffusers class gone, family whose model is then
# refused, family whose model still runs).
FAMILY_HOOKS = {
    "flux_processor_removed": (
        "from diffusers.models.transformers import transformer_flux\ndel transformer_flux.FluxAttnProcessor",
        "FluxAttnProcessor", "run_flux", "run_sd35",
    ),
    "sd3_processor_removed": (
        "from diffusers.models import attention_processor\ndel attention_processor.JointAttnProcessor2_0",
        "JointAttnProcessor2_0", "run_sd35", "run_flux",
    ),
    "flux_call_stops_reading_the_backend": (
        "from diffusers.models.transformers import transformer_flux\n"
        "transformer_flux.FluxAttnProcessor.__call__ = lambda self, attn, hidden_states, **kw: hidden_states",
        "_attention_backend read in FluxAttnProcessor.__call__", "run_flux", "run_sd35",
    ),
}


@pytest.mark.parametrize("hook", list(FAMILY_HOOKS))
def test_missing_processor_class_leaves_out_only_its_family(hook):
    patch, missing, refused, runs = FAMILY_HOOKS[hook]
    result = _simulate(patch)

    assert not _warnings(result), _warnings(result)
    debug = [message for level, message in result["records"] if level == "DEBUG" and missing in message]
    assert debug and f"diffusers {FUTURE}" in debug[0], result["records"]
    gone = missing.split()[-1].split(".")[0]  # the diffusers processor class
    assert gone not in result["served"] and len(result["served"]) == 12, result["served"]
    _raised(result, refused, "ValueError", "no attention processor of a supported type")
    _ran_exactly(result, runs)
    if hook == "flux_processor_removed":  # the sage class still imports; constructing it says why it cannot work
        _raised(result, "flux_processor", "DiffusersCompatError", f"diffusers {FUTURE}", "FluxAttnProcessor")
        assert "FluxAttention" not in result["modules"]


def test_missing_optional_backend_hooks_keep_the_backends():
    """No ``supports_context_parallel`` keyword: backends without context parallelism (one warning); no
    ``_check_device`` / ``_check_shape``: backends without those debug constraints (a debug log)."""
    patch = """
    from diffusers.models import attention_dispatch as dispatch
    original = dispatch._AttentionBackendRegistry.register.__func__
    dispatch._AttentionBackendRegistry.register = classmethod(
        lambda cls, backend, constraints=None: original(cls, backend, constraints))
    del dispatch._check_device, dispatch._check_shape
    """
    extra = """
    registry = dispatch._AttentionBackendRegistry
    member = dispatch.AttentionBackendName("sage_diffusers_int8")
    result["cp_backends"] = sorted(v for v in registry._supports_context_parallel if v.startswith("sage_diffusers"))
    result["constraints"] = len(registry._constraints[member])
    """
    result = _simulate(patch, extra)

    (warning,) = _warnings(result)
    for needle in (f"diffusers {FUTURE}", "supports_context_parallel", "context parallelism"):
        assert needle in warning, (needle, warning)
    assert any("_check_device" in message for level, message in result["records"] if level == "DEBUG")
    assert len(result["served"]) == 13
    _ran_exactly(result, "run_flux")
    _ran_exactly(result, "run_sd35")
    assert result["register_backend"][0] == "ok" and "sage_diffusers_int8" in result["register_backend"][1]
    assert result["cp_backends"] == [] and result["constraints"] == 0


# ---------------------------------------------------------------------------------------------------------------
# Context parallelism: the hooks are read per call


@pytest.fixture
def future(monkeypatch):
    import diffusers

    monkeypatch.setattr(diffusers, "__version__", FUTURE)


def test_missing_context_parallel_io_refuses_only_our_hunyuan_plan(future, monkeypatch):
    from diffusers.models import _modeling_parallel

    hunyuan, flux = _sage_tiny.tiny_transformer(Family.HUNYUANVIDEO), _sage_tiny.tiny_transformer(Family.FLUX)
    monkeypatch.delattr(_modeling_parallel, "ContextParallelInput")
    with pytest.raises(compat.DiffusersCompatError, match=rf"diffusers {FUTURE} has no ContextParallelInput"):
        context_parallel_plan(hunyuan)
    assert context_parallel_plan(flux) is flux._cp_plan  # a model's own plan needs no ContextParallelInput


def test_missing_cp_plan_attribute_names_the_version(future, monkeypatch):
    from diffusers import ModelMixin

    wan = _sage_tiny.tiny_transformer(Family.WAN21)
    monkeypatch.delattr(ModelMixin, "_cp_plan")
    with pytest.raises(compat.DiffusersCompatError, match=rf"diffusers {FUTURE} has no ModelMixin\._cp_plan.*cp_plan="):
        context_parallel_plan(wan)


@pytest.mark.parametrize("mesh, degrees", [("_ring_mesh", (2, 1)), ("_ulysses_mesh", (1, 2))])
def test_missing_device_mesh_names_the_version(future, mesh, degrees):
    cp = SimpleNamespace(ring_degree=degrees[0], ulysses_degree=degrees[1])  # a ContextParallelConfig without meshes
    config = SimpleNamespace(context_parallel_config=cp)
    q = torch.randn(1, 8, 2, 64)
    with pytest.raises(compat.DiffusersCompatError, match=rf"diffusers {FUTURE} has no {mesh}.*diffusers' own attention"):
        context_parallel_attention(q, q, q, mode=Mode.SDPA, parallel_config=config)

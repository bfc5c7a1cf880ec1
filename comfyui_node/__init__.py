"""ComfyUI custom node for sage_diffusers: a MODEL patch that routes attention to SageAttention.

Load it either way:
- as a folder in ``ComfyUI/custom_nodes/`` (a copy or a link of this folder): ComfyUI reads
  ``NODE_CLASS_MAPPINGS`` / ``NODE_DISPLAY_NAME_MAPPINGS`` (and ``comfy_entrypoint`` on V3-aware
  versions that find no mappings);
- as the module ``comfyui_node`` (``import comfyui_node`` with the checkout on ``sys.path``), e.g.
  from tests, without ComfyUI: the legacy node class and the pure logic work without ``comfy``
  importable. The sage_diffusers wheel does not install this package (a generic top-level name).

With ``comfy_api.latest`` available the mapping holds the V3 node (it also serves the V1 loader,
which is the path ComfyUI takes when ``NODE_CLASS_MAPPINGS`` exists); otherwise the legacy node.

One module identity: ComfyUI imports a ``custom_nodes`` folder under the folder's own name. Run
that way, this file only re-exports the package imported as ``comfyui_node`` (one already on
``sys.path``, else this folder under that name), so counters, the step state and the node classes
exist once per process however many copies of the folder ComfyUI loads.
"""
from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys

logger = logging.getLogger("sage_diffusers.comfyui")


def _ensure_sage_diffusers() -> None:
    """Import sage_diffusers; from a source checkout (this folder linked into custom_nodes) add the
    checkout to sys.path when the package is not installed."""
    try:
        import sage_diffusers  # noqa: F401
        return
    except ImportError as exc:
        checkout = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
        if not os.path.isfile(os.path.join(checkout, "sage_diffusers", "__init__.py")):
            raise ImportError(
                "the sage_diffusers ComfyUI node needs the sage_diffusers package: "
                "pip install it into ComfyUI's Python environment"
            ) from exc
    sys.path.append(checkout)
    import sage_diffusers  # noqa: F401,E402

    logger.info("sage_diffusers[comfyui] using sage_diffusers from the checkout %s", checkout)


_ensure_sage_diffusers()

CANONICAL_NAME = "comfyui_node"


def _canonical_package():
    """The package as ``comfyui_node``: installed (or on sys.path), else this folder under that name."""
    try:
        return importlib.import_module(CANONICAL_NAME)
    except ImportError:
        pass
    folder = os.path.dirname(os.path.abspath(__file__))
    spec = importlib.util.spec_from_file_location(CANONICAL_NAME, os.path.join(folder, "__init__.py"),
                                                  submodule_search_locations=[folder])
    module = importlib.util.module_from_spec(spec)
    sys.modules[CANONICAL_NAME] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[CANONICAL_NAME]
        raise
    return module


if __name__ != CANONICAL_NAME:
    # Loaded by ComfyUI from custom_nodes/<folder>: hand out the one canonical package's objects.
    _package = _canonical_package()
    if os.path.realpath(os.path.dirname(_package.__file__)) != os.path.realpath(os.path.dirname(__file__)):
        logger.info("sage_diffusers[comfyui] %s re-exports the installed comfyui_node from %s", __name__,
                    os.path.dirname(_package.__file__))
    globals().update({name: getattr(_package, name) for name in _package.__all__})
    __all__ = list(_package.__all__)
else:
    from ._package import *  # noqa: F401,F403,E402
    from ._package import __all__  # noqa: F401,E402

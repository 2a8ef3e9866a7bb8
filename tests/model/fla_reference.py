"""fla-core's pure-torch reference files, loaded without ``import fla`` (which pulls in triton, absent from
the CPU install): each ``fla/ops/<op>/naive.py`` needs only torch and einops."""
from __future__ import annotations

import importlib.util
import pathlib

import pytest


def load_fla_naive(op: str, needs: str):
    """The module ``fla/ops/{op}/naive.py`` (skips the test when fla-core, the file or ``needs`` is absent)."""
    pytest.importorskip("einops")
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("fla-core not installed")
    path = pathlib.Path(spec.submodule_search_locations[0]) / "ops" / op / "naive.py"
    if not path.exists():
        pytest.skip(f"fla-core has no ops/{op}/naive.py")
    mod_spec = importlib.util.spec_from_file_location(f"_fla_{op}_naive", path)
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    if not hasattr(mod, needs):
        pytest.skip(f"fla-core ops/{op}/naive.py has no {needs}")
    return mod

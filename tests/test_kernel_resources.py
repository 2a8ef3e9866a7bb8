"""``benchmarks/kernel_resources.py`` reads every scan / reduction of a TTGIR module with its layout spelled out
(aliases are numbered per module, so two builds compare only after resolving them), inline slice layouts
included. Runs without Triton: the TTGIR below is written by hand in the compiler's format."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from kernel_resources import reductions  # noqa: E402

BLOCKED = "#ttg.blocked<{sizePerThread = [1, 1], threadsPerWarp = [1, 32], warpsPerCTA = [2, 4], order = [1, 0]}>"
TTGIR = f"""#blocked1 = {BLOCKED}
#mma = #ttg.nvidia_mma<{{versionMajor = 2, versionMinor = 0, warpsPerCTA = [1, 8], instrShape = [16, 8]}}>
module {{
  tt.func @k() {{
    %gc = "tt.scan"(%g) <{{axis = 0 : i32, reverse = false}}> ({{
    ^bb0(%a: f32, %b: f32):
      tt.scan.return %c : f32
    }}) : (tensor<64x128xf32, #blocked1>) -> tensor<64x128xf32, #blocked1>
    %r = "tt.reduce"(%x) <{{axis = 0 : i32}}> ({{
    ^bb0(%a: f32, %b: f32):
      tt.reduce.return %c : f32
    }}) : (tensor<64xf32, #ttg.slice<{{dim = 1, parent = #blocked1}}>>) -> f32
    %t = "tt.reduce"(%y) <{{axis = 1 : i32}}> ({{
    ^bb0(%a: f32, %b: f32):
      tt.reduce.return %c : f32
    }}) : (tensor<64x64xf32, #mma>) -> tensor<64xf32, #ttg.slice<{{dim = 1, parent = #mma}}>>
  }}
}}
"""


def test_reductions_resolve_aliases_and_inline_layouts():
    got = reductions(TTGIR)
    assert [(r.op, r.axis, r.shape) for r in got] == [("scan", 0, "64x128xf32"), ("reduce", 0, "64xf32"),
                                                      ("reduce", 1, "64x64xf32")]
    assert got[0].layout == BLOCKED
    assert got[1].layout == "#ttg.slice<{dim = 1, parent = " + BLOCKED + "}>"
    assert got[2].layout.startswith("#ttg.nvidia_mma<{versionMajor = 2") and "#" not in got[2].layout[1:]


def test_renamed_aliases_compare_equal():
    """The same layouts under other alias names (another module's numbering) give the same report."""
    renamed = TTGIR.replace("#blocked1", "#blocked7").replace("#mma", "#mma3")
    assert reductions(renamed) == reductions(TTGIR)


def test_unreadable_op_is_an_error():
    """An op whose signature cannot be read is an error, not the next op's shape and layout."""
    with pytest.raises(ValueError, match="cannot read"):
        reductions('"tt.reduce"(%x) with no signature')
    broken = TTGIR.replace("}) : (tensor<64xf32, #ttg.slice<{dim = 1, parent = #blocked1}>>) -> f32", "}) -> f32")
    assert broken != TTGIR
    with pytest.raises(ValueError, match="cannot read the tt.reduce"):
        reductions(broken)

"""tools/gpu/kernel_sass.py's reading of nvdisasm's output: which instructions it counts as a loop's body.

The compile half needs Triton's NVIDIA backend, which CI's CPU install does not have; the parse is what turns its
output into the figures benchmarks/decode_h200_2026-12.md quotes, and runs here on text in nvdisasm's format.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "gpu" / "kernel_sass.py"

# nvdisasm -c -g: a prologue, a loop of four instructions (one predicated) closed by a backward branch, a forward
# branch that is no loop, the exit and the trap that branches to itself.
SASS = """
        .text._kernel:
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/               @P0 BRA `(.L_x_1) ;
.L_x_0:
        /*0020*/                   LDG.E.64 R2, desc[UR4][R4.64] ;
        /*0030*/                   HMMA.16816.F32 R8, R12, R16, R8 ;
        /*0040*/              @!P1 FMUL R3, R3, R5 ;
        /*0050*/              @!P2 BRA `(.L_x_0) ;
.L_x_1:
        /*0060*/                   STG.E desc[UR4][R6.64], R3 ;
        /*0070*/                   EXIT ;
.L_x_2:
        /*0080*/                   BRA `(.L_x_2);
"""


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kernel_sass", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_backward_branch_is_a_loop_and_its_body_is_counted_without_predicates() -> None:
    total, found = load_script().loops(SASS)
    assert total == 9
    assert found == [(".L_x_0", ["LDG.E.64", "HMMA.16816.F32", "FMUL", "BRA"])]

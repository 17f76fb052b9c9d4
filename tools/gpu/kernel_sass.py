"""A decode kernel's machine code for an NVIDIA GPU, built on this machine without one: each loop's instruction count.

    python3 tools/gpu/kernel_sass.py --kernel attention        # the 8-bit K-first decode attention (the default)
    python3 tools/gpu/kernel_sass.py --kernel sample_partial   # the sampler's pass over the logits
    python3 tools/gpu/kernel_sass.py --kernel attention --out /tmp/sass   # also keep the PTX and the SASS

Triton compiles the kernel of this tree (`hpcrl/engine/embedded/kernels/`) for `--arch` (default 90, the H200)
with the launch the engine makes at batch 256 with the Qwen3-0.6B shape: the same constexprs, warps and stages, and
the same 16-divisibility of pointers and strides that Triton's launcher would find (without it the loads are not
vectorised and the count means nothing). Triton's bundled `nvdisasm` prints the SASS. Needs Triton with its NVIDIA
backend (the CPU wheel has it); no GPU, no driver.

The counts say what a change does to a kernel bound by instruction issue before GPU time is spent on it. They
are not times: cutting attention's loop from 1,164 to 857 instructions a 32-token tile, made it run
0.0585 against 0.0594 ms a layer on an H200.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def _attention() -> tuple[Any, dict[str, str], dict[str, Any], tuple[int, ...], int, int]:
    from hpcrl.engine.embedded.kernels import attention, launch

    block_n, warps, stages, _ = launch.SETTINGS.attn_config_kv8
    signature = {
        "Q": "*bf16", "KC": "*fp8e4nv", "VC": "*fp8e4nv", "Out": "*bf16", "Pos": "*i64", "sm_scale": "fp32",
        "stride_qb": "i32", "stride_cb": "i32", "stride_ch": "i32", "stride_cn": "i32", "max_len": "i32",
    }  # fmt: skip
    constexprs = {
        "H": 16, "GROUP": 2, "BLOCK_H": 16, "D": 128, "BLOCK_N": block_n, "USE_DOT": True, "IEEE": False,
        "KV8": True, "K_FIRST": True, "PDL": True,
    }  # fmt: skip
    # Pointers and the cache's strides are multiples of 16 in the engine; max_len (prompt + new tokens) need not be.
    return attention._decode_attention_kernel, signature, constexprs, (0, 1, 2, 3, 4, 6, 7, 8, 9), warps, stages


def _sample_partial() -> tuple[Any, dict[str, str], dict[str, Any], tuple[int, ...], int, int]:
    from hpcrl.engine.embedded.kernels import launch, sampler
    from hpcrl.engine.embedded.sampling import SAMPLE_CHUNK_IDS

    block, warps, _, _ = launch.SETTINGS.sample_config
    signature = {"Logits": "*bf16", "stride_row": "i32", "V": "i32", "Temp": "*fp32", "Part": "*fp32", "PartI": "*i32"}
    chunks = -(-151_936 // SAMPLE_CHUNK_IDS)
    constexprs = {"NSPLIT": chunks, "CHUNK": SAMPLE_CHUNK_IDS, "BLOCK": block, "FAST_EXP": True, "PDL": True}
    # 151,936 = 16 x 9,496: the row stride is a multiple of 16, the vocabulary too.
    return sampler._sample_partial_kernel, signature, constexprs, (0, 1, 2, 3, 4, 5), warps, 3


KERNELS = {"attention": _attention, "sample_partial": _sample_partial}


def compile_sass(name: str, arch: int, out_dir: Path) -> tuple[str, int]:
    """(SASS text, shared memory bytes) of kernel `name`, built for compute capability `arch`."""
    from hpcrl.engine.embedded.kernels import launch

    if not launch.AVAILABLE:
        raise SystemExit("kernel_sass.py needs Triton (pip install triton)")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    if not nvdisasm.is_file():
        raise SystemExit(f"Triton's nvdisasm is not at {nvdisasm}: this Triton has no NVIDIA backend")
    fn, signature, constexprs, divisible, warps, stages = KERNELS[name]()
    missing = [arg for arg in fn.arg_names if arg not in signature and arg not in constexprs]
    if missing:
        raise SystemExit(f"{name}: this script does not know the kernel's arguments {missing}; add them to it")
    signature = {**signature, **{key: "constexpr" for key in constexprs}}
    attrs = {(i,): [["tt.divisibility", 16]] for i in divisible}
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(
        src, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps, "num_stages": stages}
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    cubin = out_dir / f"{name}.cubin"
    cubin.write_bytes(compiled.asm["cubin"])
    (out_dir / f"{name}.ptx").write_text(compiled.asm["ptx"])
    sass = subprocess.run([str(nvdisasm), "-c", "-g", str(cubin)], capture_output=True, text=True, check=True).stdout
    (out_dir / f"{name}.sass").write_text(sass)
    return sass, int(compiled.metadata.shared)


def loops(sass: str) -> tuple[int, list[tuple[str, list[str]]]]:
    """(instruction count, [(label, opcodes of the loop's body)]) of each backward branch in `sass`."""
    labels: dict[str, int] = {}
    ops: list[str] = []
    branches: list[tuple[int, str]] = []  # (index of the branch, its target label)
    for line in sass.splitlines():
        label = re.match(r"^(\.L_x_\d+):", line)
        if label:
            labels[label.group(1)] = len(ops)
        instruction = re.match(r"^\s*/\*[0-9a-f]+\*/\s+(.*?);", line)
        if instruction:
            target = re.search(r"BRA\s+`\((\.L_x_\d+)\)", instruction.group(1))
            if target:
                branches.append((len(ops), target.group(1)))
            ops.append(re.sub(r"^@!?U?P\w+\s+", "", instruction.group(1)).split()[0])
    # A branch back to a label before it closes a loop (a branch to itself is the trap after EXIT).
    found = [(target, ops[labels[target] : end + 1]) for end, target in branches if labels.get(target, end) < end]
    return len(ops), found


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernel", choices=sorted(KERNELS), default="attention")
    p.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: H100/H200)")
    p.add_argument("--out", type=Path, default=None, help="keep the cubin, PTX and SASS here (default: a temp dir)")
    p.add_argument("--top", type=int, default=16, help="opcodes listed a loop")
    ns = p.parse_args()
    os.environ.pop("TRITON_INTERPRET", None)  # the interpreter compiles nothing
    with tempfile.TemporaryDirectory() as tmp:
        sass, shared = compile_sass(ns.kernel, ns.arch, ns.out or Path(tmp))
    total, found = loops(sass)
    print(f"{ns.kernel} for sm_{ns.arch}: {total} instructions, {shared} bytes of shared memory")
    for label, body in found:
        counts = collections.Counter(body).most_common(ns.top)
        print(f"loop {label}: {len(body)} instructions; " + ", ".join(f"{op} {n}" for op, n in counts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

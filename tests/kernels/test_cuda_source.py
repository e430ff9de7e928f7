"""The CUDA path's device code compiles with NVIDIA's NVRTC, and the host passes what the kernels declare.

Needs no GPU: NVRTC (``pip install 'fusion[nvrtc]'``: cuda-bindings and the
NVRTC library wheel) compiles :data:`topk_cupy.CUDA_SOURCE` to PTX and to sm_80 /
sm_90 machine code exactly as CuPy does at first use. The PTX gives each
kernel's parameter sizes, checked against :data:`topk_cupy.SIGNATURES`, the
table the launches cast their scalars through (a RawKernel passes a scalar by
its NumPy size, so a mismatch would corrupt arguments silently on the GPU).
"""
from __future__ import annotations

import re

import numpy as np
import pytest

from fusion.kernels import topk_cupy

nvrtc = pytest.importorskip("cuda.bindings.nvrtc", reason="NVRTC bindings not installed (pip install 'fusion[nvrtc]')")


def _check(result) -> tuple:
    err, *rest = result if isinstance(result, tuple) else (result,)
    assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS, f"NVRTC: {err}"
    return tuple(rest)


def compile_source(source: str, arch: str) -> tuple[bytes, bytes, bytes | None]:
    """(ptx, log, cubin) of ``source`` for ``arch`` (``compute_XX``: PTX only; ``sm_XX``: also a cubin)."""
    try:
        (prog,) = _check(nvrtc.nvrtcCreateProgram(source.encode(), b"fusion_topk.cu", 0, [], []))
    except Exception as e:  # bindings present but no libnvrtc
        pytest.skip(f"NVRTC library not loadable: {e}")
    opts = [f"--gpu-architecture={arch}".encode()]
    (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    (size,) = _check(nvrtc.nvrtcGetProgramLogSize(prog))
    log = b" " * size
    _check(nvrtc.nvrtcGetProgramLog(prog, log))
    assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS, f"{arch}: compile failed:\n{log.decode(errors='replace')}"
    (size,) = _check(nvrtc.nvrtcGetPTXSize(prog))
    ptx = b" " * size
    _check(nvrtc.nvrtcGetPTX(prog, ptx))
    cubin = None
    if arch.startswith("sm_"):
        (size,) = _check(nvrtc.nvrtcGetCUBINSize(prog))
        cubin = b" " * size
        _check(nvrtc.nvrtcGetCUBIN(prog, cubin))
    _check(nvrtc.nvrtcDestroyProgram(prog))
    return ptx.rstrip(b"\0"), log.rstrip(b"\0").strip(), cubin


def ptx_entries(ptx: str) -> dict[str, list[int]]:
    """Kernel name -> parameter sizes in bytes, from the ``.entry`` declarations."""
    out = {}
    for name, params in re.findall(r"\.entry\s+(\w+)\s*\(([^)]*)\)", ptx):
        out[name] = [int(w) // 8 for w in re.findall(r"\.param\s+\.[a-z](\d+)\s", params)]
    return out


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_source_compiles_to_machine_code_without_warnings(arch):
    ptx, log, cubin = compile_source(topk_cupy.CUDA_SOURCE, arch)
    assert log == b"", f"NVRTC warnings for {arch}:\n{log.decode()}"
    assert cubin and cubin[:4] == b"\x7fELF", "NVRTC returned no ELF cubin"
    assert set(ptx_entries(ptx.decode())) == set(topk_cupy.SIGNATURES)


def test_signatures_match_the_compiled_parameters():
    ptx, _, _ = compile_source(topk_cupy.CUDA_SOURCE, "compute_90")
    entries = ptx_entries(ptx.decode())
    for name, sig in topk_cupy.SIGNATURES.items():
        host = [8 if t == "ptr" else np.dtype(t).itemsize for t in sig]
        assert entries[name] == host, f"{name}: kernel parameters {entries[name]} bytes, host passes {host}"


def test_a_broken_kernel_fails_to_compile():
    """The check above can fail: a type error in the source is reported with NVRTC's log."""
    broken = topk_cupy.CUDA_SOURCE.replace("keys[i] = (b > 0x7f800000u)", "keys[i] = (b > undefined_name)", 1)
    assert broken != topk_cupy.CUDA_SOURCE
    with pytest.raises(AssertionError, match="undefined_name"):
        compile_source(broken, "compute_90")


def test_signature_check_catches_a_width_mismatch():
    """A kernel declaring ``int n`` where the host passes int64 is caught by the PTX sizes."""
    changed = topk_cupy.CUDA_SOURCE.replace(
        "const float* __restrict__ x, unsigned int* __restrict__ keys, const long long n",
        "const float* __restrict__ x, unsigned int* __restrict__ keys, const int n", 1)
    assert changed != topk_cupy.CUDA_SOURCE
    ptx, _, _ = compile_source(changed, "compute_90")
    assert ptx_entries(ptx.decode())["fusion_topk_keys_f32"] == [8, 8, 4] != [8, 8, 8]


def test_fused_kernels_use_warp_votes_and_match():
    """The fused path's warp aggregation survives compilation: match.any and vote.ballot in its PTX."""
    ptx = compile_source(topk_cupy.CUDA_SOURCE, "compute_90")[0].decode()
    bodies = {m.group(1): m.group(0) for m in re.finditer(r"\.entry\s+(\w+)\s*\(.*?\n\}", ptx, flags=re.S)}
    for kind in topk_cupy.FUSED_KINDS:
        assert "match.any.sync.b32" in bodies[f"fusion_topk_pass_{kind}"], kind
        assert "vote.sync.ballot.b32" in bodies[f"fusion_topk_write_{kind}_i32"], kind
        assert "atom.shared.add" in bodies[f"fusion_topk_pass_{kind}"], kind

"""The optional CUDA extras agree on one CUDA major version (issue 13: ``cuda`` had CuPy for CUDA 12
while ``nvrtc`` was CUDA 13, so the kernels the tests compiled were not the ones CuPy would build)."""
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _majors(reqs: list[str]) -> set[int]:
    """CUDA majors a list of requirements pins: ``cupy-cudaNNx`` and ``>=N,<N+1`` bounds of CUDA packages."""
    out = set()
    for r in reqs:
        m = re.match(r"cupy-cuda(\d+)x", r)
        if m:
            out.add(int(m.group(1)))
            continue
        if r.startswith(("cuda-", "nvidia-cuda-")):
            lo = re.search(r">=\s*(\d+)", r)
            hi = re.search(r"<\s*(\d+)", r)
            assert lo and hi and int(hi.group(1)) == int(lo.group(1)) + 1, f"{r!r}: pin one CUDA major (>=N,<N+1)"
            out.add(int(lo.group(1)))
    return out


def test_the_cuda_and_nvrtc_extras_name_one_cuda_major():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    cuda, nvrtc = _majors(extras["cuda"]), _majors(extras["nvrtc"])
    assert len(cuda) == 1 and cuda == nvrtc, f"cuda extra: CUDA {sorted(cuda)}, nvrtc extra: CUDA {sorted(nvrtc)}"


def test_the_check_reads_majors_it_should_refuse():
    assert _majors(["cupy-cuda12x>=13"]) == {12} != _majors(["cuda-bindings>=13,<14"])

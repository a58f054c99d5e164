"""The CPU this process runs on: its model, its feature flags, and the
instruction-set variant the C kernels are built for.

Variants, best first:
  avx512    x86-64-v4 (AVX-512 F/BW/DQ/VL), 32 vector registers of 16 floats
  avx2      x86-64-v3 (AVX2, FMA, BMI2, F16C), 16 registers of 8 floats
  portable  the compiler's baseline for the machine (SSE2 on x86-64, NEON on
            aarch64), with no -march at all

Kernels are compiled with the variant's flags, never with `-march=native`,
so a library built here runs on any CPU that has the variant's features,
and the build cache is keyed by the CPU as well (kernels/cbuild.py).
`RAYVLLM_CPU_ISA` forces a lower variant than the CPU's best (to measure
the AVX2 kernels on an AVX-512 machine); asking for one the CPU cannot run
is an error, not a SIGILL.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

ISA_ENV = "RAYVLLM_CPU_ISA"
ISAS = ("avx512", "avx2", "portable")

# /proc/cpuinfo flags each variant needs (gcc's x86-64-v3 / -v4 levels).
_REQUIRED_FLAGS: dict[str, frozenset[str]] = {
    "avx512": frozenset({"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx2", "fma", "bmi2"}),
    "avx2": frozenset({"avx2", "fma", "bmi1", "bmi2", "f16c", "movbe"}),
    "portable": frozenset(),
}

# Compiler flags per variant. -mtune stays generic so the library's speed
# does not depend on which CPU of the family built it.
ISA_FLAGS: dict[str, list[str]] = {
    "avx512": ["-march=x86-64-v4", "-mtune=icelake-server", "-mprefer-vector-width=512"],
    "avx2": ["-march=x86-64-v3", "-mtune=znver3"],
    "portable": [],
}


@dataclass(frozen=True)
class CpuInfo:
    """What the kernels' choice and the build cache depend on."""

    model: str
    arch: str
    flags: frozenset[str]

    def supports(self, isa: str) -> bool:
        if isa == "portable":
            return True
        return self.arch == "x86_64" and _REQUIRED_FLAGS[isa] <= self.flags

    @property
    def supported_isas(self) -> tuple[str, ...]:
        """Variants this CPU can execute, best first."""
        return tuple(isa for isa in ISAS if self.supports(isa))

    @property
    def isa_summary(self) -> str:
        """The vector extensions a benchmark row should name, e.g. `AVX-512 (+AMX, +BF16)`."""
        if self.supports("avx512"):
            extras = [name for flag, name in (("amx_tile", "AMX"), ("avx512_bf16", "BF16"), ("avx512_vnni", "VNNI"))
                      if flag in self.flags]
            return "AVX-512" + "".join(f", +{e}" for e in extras)
        if self.supports("avx2"):
            return "AVX2+FMA (no AVX-512)"
        return f"{self.arch} baseline"


def parse_cpuinfo(text: str, arch: str) -> CpuInfo:
    """`/proc/cpuinfo` of Linux (x86 `model name`/`flags`, Arm `Features`)."""
    model, flags = "", ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("model name", "Model", "Hardware") and not model:
            model = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = value
    return CpuInfo(model=model or platform.processor() or arch, arch=arch, flags=frozenset(flags.split()))


@lru_cache(maxsize=1)
def cpu_info() -> CpuInfo:
    arch = platform.machine()
    arch = {"AMD64": "x86_64", "arm64": "aarch64"}.get(arch, arch)
    path = Path("/proc/cpuinfo")
    text = path.read_text() if path.exists() else ""
    return parse_cpuinfo(text, arch)


def selected_isa(info: CpuInfo | None = None) -> str:
    """The variant the kernels run: the CPU's best, or `RAYVLLM_CPU_ISA` when set."""
    info = info or cpu_info()
    forced = os.environ.get(ISA_ENV, "")
    if not forced:
        return info.supported_isas[0]
    if forced not in ISAS:
        raise ValueError(f"{ISA_ENV}={forced!r}: choose one of {', '.join(ISAS)}")
    if not info.supports(forced):
        runs = ", ".join(info.supported_isas)
        raise ValueError(f"{ISA_ENV}={forced}: this CPU ({info.model}) cannot run it; it runs {runs}")
    return forced

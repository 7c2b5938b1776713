"""The `numerics` section: which code paths CPU jobs compute with (stages.core.common.numerics)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .base import Strict


class Numerics(Strict):
    """How CPU jobs compute. Pinned to AVX2 (by default), the embedded default gives the same
    bits on the processors of one vendor; `native` lets each library take the processor's widest
    vector unit (faster where it has AVX-512 or AMX, and other numbers)."""

    cpu_isa: Literal["avx2", "native"] = Field(
        "avx2", description="avx2: ATEN_CPU_CAPABILITY=avx2 and MKL_CBWR=AVX2,STRICT "
        "in every job's environment, so that a CPU job computes the same "
        "bits on the x86-64 processors of one vendor (MKL honours MKL_CBWR on Intel's alone); "
        "native: none of them (each library's widest path). A result key of the jobs that "
        "compute on CPUs (a change reruns them)")

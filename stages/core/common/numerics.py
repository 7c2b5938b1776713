"""Which code paths a CPU computes with, and the record of them in every artifact's provenance.

PyTorch's own kernels, MKL (its matrix multiplies and, through VML, exp, log and tanh) and oneDNN
each pick the widest vector unit of the processor they run on: AVX2 on one machine, AVX-512 or
AMX on another. The same sums then come out in another order, and a CPU run's numbers differ from
processor to processor. Two settings, read by each library when it starts, pin the code paths
to AVX2, which every x86-64 processor since about 2015 has (config key numerics.cpu_isa):

- ATEN_CPU_CAPABILITY=avx2: PyTorch's vectorised kernels (its CPU dispatch);
- MKL_CBWR=AVX2,STRICT: MKL's conditional numerical reproducibility, the AVX2 code path (BLAS and
  VML: torch.exp on float32 gives other last bits under MKL_CBWR=AVX512, seen on an Intel Xeon),
  strict: without it a product's bits depend on its operands' alignment in memory (the chunked
  head's statistics then differed from the same logits' read whole, seen on the Xeon);
oneDNN is left alone: it is not on the float32 path (on the Xeon no product, softmax, attention
or exp changed with ONEDNN_MAX_CPU_ISA; bfloat16 products, which it computes, stay the
processor's), and ONEDNN_MAX_CPU_ISA=AVX2 made vLLM's CPU build abort
in bfloat16 on a processor with AMX (its kernels choose AMX by the hardware, then PyTorch's brgemm
finds oneDNN without it).

The workflow puts them into the environment of every job (workflow/rules/common.smk), before any
of these libraries starts; a stage run by hand that finds them missing starts itself again with
them (`apply`). `record` says, in each artifact's provenance, which processor computed it and how.

What they pin: PyTorch's own kernels on every processor; MKL (the sgemm behind every
linear layer, and VML) on Intel processors only. oneMKL documents MKL_CBWR branches other than
AUTO and COMPATIBLE as Intel-only: elsewhere it runs its AUTO branch. So an Intel processor and an
AMD one still compute different bits (seen: the default's base model on an Intel Xeon and an AMD
EPYC Zen 4, both pinned), while an AMD Zen 4 pinned gave an AMD Zen 3's tables but for one method
(docs/results.md). MKL_CBWR=COMPATIBLE is the branch oneMKL documents as the same on Intel and
compatible processors; it computes the matrix products with SSE2 alone, 4.7 times slower on the
Xeon, which the embedded default's time cannot afford.
"""

from __future__ import annotations

import functools
import os
import sys

PINNED = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2,STRICT"}
"""The environment of numerics.cpu_isa 'avx2'."""

CPU_ISAS = {"avx2": PINNED, "native": {}}
"""numerics.cpu_isa -> the settings it sets ('native': none, every library on its widest path)."""

EXTENSIONS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
              "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")
"""The vector extensions a record names, where the processor has them."""

REEXEC_MARK = "ICT_RLVR_NUMERICS_APPLIED"


def settings(cpu_isa: str) -> dict[str, str]:
    """The environment variables numerics.cpu_isa sets."""
    return dict(CPU_ISAS[cpu_isa])


def environment(cpu_isa: str, env: dict[str, str] | os._Environ) -> dict[str, str]:
    """`env` with numerics.cpu_isa's settings: the three set, or (native) removed."""
    out = {k: v for k, v in env.items() if k not in PINNED}
    return {**out, **settings(cpu_isa)}


def in_effect(env=os.environ) -> dict[str, str | None]:
    """The settings as `env` has them (None: not set)."""
    return {var: env.get(var) for var in PINNED}


def apply(cpu_isa: str) -> None:
    """Start this process again with numerics.cpu_isa's settings where its environment lacks them
    (a stage run by hand): the libraries read them at their start, so setting them now would be
    too late. Under the workflow the job's environment has them already, and nothing happens."""
    want = {var: settings(cpu_isa).get(var) for var in PINNED}
    if in_effect() == want:
        return
    if os.environ.get(REEXEC_MARK):
        raise RuntimeError(f"numerics.cpu_isa {cpu_isa!r}: the environment still has "
                           f"{in_effect()} after starting again with {want}")
    env = {**environment(cpu_isa, os.environ), REEXEC_MARK: "1"}
    sys.stderr.write(f"numerics.cpu_isa {cpu_isa!r}: starting again with {settings(cpu_isa) or 'none of'} "
                     f"{'' if settings(cpu_isa) else ', '.join(PINNED)}\n")
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


@functools.cache
def processor() -> dict:
    """The processor's vendor, model name and vector extensions (/proc/cpuinfo; {} where there is
    none)."""
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return {}
    fields = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
        if not line.strip() and fields:
            break
    flags = set(fields.get("flags", "").split())
    return {"vendor": fields.get("vendor_id"), "model": fields.get("model name"),
            "extensions": [e for e in EXTENSIONS if e in flags]}


def record() -> dict:
    """Which processor computed, with which of the settings, PyTorch's CPU code path and
    threads (where torch is loaded): the `numerics` of every provenance record."""
    out = {"processor": processor(), "settings": in_effect()}
    torch = sys.modules.get("torch")
    if torch is not None:
        out["torch_cpu_capability"] = torch.backends.cpu.get_cpu_capability()
        out["threads"] = torch.get_num_threads()
    return out

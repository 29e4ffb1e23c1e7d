"""isa.cpu_family: the microarchitecture name of the benchmark lines, from cpuinfo
texts."""

from __future__ import annotations

import pytest

from fucina_course.quant.isa import cpu_family, cpu_flags, cpu_name


def cpuinfo(vendor: str, family: int, model: int, flags: str = "fpu sse2 avx2",
            stepping: int = 1, name: str = "Some CPU") -> str:
    block = (f"processor\t: 0\nvendor_id\t: {vendor}\ncpu family\t: {family}\n"
             f"model\t\t: {model}\nmodel name\t: {name}\nstepping\t: {stepping}\n"
             f"flags\t\t: {flags}\n")
    # a second processor that disagrees: only the first block is read
    return block + "\n" + block.replace(f"model\t\t: {model}", "model\t\t: 1") + "\n"


@pytest.mark.parametrize("text, expected", [
    (cpuinfo("GenuineIntel", 6, 143), "Intel Sapphire Rapids"),
    (cpuinfo("GenuineIntel", 6, 207), "Intel Emerald Rapids"),
    (cpuinfo("GenuineIntel", 6, 106), "Intel Ice Lake-SP"),
    (cpuinfo("GenuineIntel", 6, 167), "Intel Rocket Lake"),
    # a VM's model number that its flags contradict (seen 2026-12-02: Rocket Lake's
    # number beside AMX, which Rocket Lake never had)
    (cpuinfo("GenuineIntel", 6, 167, "avx512f amx_tile amx_int8"),
     "Intel Sapphire Rapids+ (AMX; reported model 167)"),
    (cpuinfo("GenuineIntel", 6, 207, "avx512f amx_tile"), "Intel Emerald Rapids"),
    (cpuinfo("GenuineIntel", 6, 85, stepping=7), "Intel Cascade Lake"),
    (cpuinfo("GenuineIntel", 6, 85, stepping=4), "Intel Skylake-SP"),
    (cpuinfo("GenuineIntel", 6, 250), "Intel (family 6 model 250)"),
    (cpuinfo("GenuineIntel", 19, 1), "Intel (family 19 model 1)"),
    (cpuinfo("AuthenticAMD", 25, 17, "avx2 avx512f avx512_vnni"), "AMD Zen 4"),
    (cpuinfo("AuthenticAMD", 25, 1), "AMD Zen 3"),
    (cpuinfo("AuthenticAMD", 23, 49), "AMD Zen 2"),
    (cpuinfo("AuthenticAMD", 23, 1), "AMD Zen 1"),
    (cpuinfo("AuthenticAMD", 26, 2, "avx512f"), "AMD Zen 5"),
    (cpuinfo("AuthenticAMD", 21, 2), "AMD (family 21 model 2)"),
    ("processor\t: 0\nBogoMIPS\t: 50.00\nCPU implementer\t: 0x41\nCPU part\t: 0xd0c\n",
     "Apple/ARM"),
    ("", "unknown"),
    ("vendor_id : GenuineIntel\ncpu family : six\n", "unknown"),
    ("garbage without colons\n\x00\xff", "unknown"),
])
def test_cpu_family_from_cpuinfo(text, expected):
    assert cpu_family(text) == expected


def test_cpu_family_of_this_machine_is_a_short_string():
    name = cpu_family()
    assert isinstance(name, str) and 0 < len(name) < 60


def test_cpu_name_and_flags_from_cpuinfo():
    # the first processor's block only, as cpu_family reads it
    text = cpuinfo("AuthenticAMD", 23, 49, "fpu avx2 fma", name="AMD EPYC 7B12")
    assert cpu_name(text) == "AMD EPYC 7B12"
    assert cpu_flags(text) == {"fpu", "avx2", "fma"}
    assert cpu_name("") == "?" and cpu_flags("") == frozenset()
    assert cpu_name("garbage\x00") == "?"
    # 64-bit ARM Linux calls them Features (a Raspberry Pi 5's, shortened)
    arm = "processor\t: 0\nBogoMIPS\t: 108.00\nFeatures\t: fp asimd aes asimddp\n\n"
    assert cpu_flags(arm) == {"fp", "asimd", "aes", "asimddp"}
    # this machine: whatever it is, a non-empty name, and flags on x86 Linux
    assert cpu_name() and isinstance(cpu_flags(), frozenset)

"""trainloop.observe.hardware and the doctor: real nvidia-smi outputs and NVML readings, and this machine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers import launch
from trainloop.config.compose import compose_config
from trainloop.tools.doctor import main as doctor
from trainloop.tools import doctor as doctor_module
from trainloop.observe.hardware import (GpuReading, GpuReport, direct_io_works, gpu_warnings, host_facts, parse_link,
                                parse_smi_csv, parse_topology, throttle_reasons, topology_warnings)

DATA = Path(__file__).resolve().parent / "data"


def topology(name: str):
    return parse_topology((DATA / name).read_text())


# NVML's clocks event reason bits, as nvml.h defines them (nvmlClocksEventReason*).
GPU_IDLE, SW_POWER_CAP, HW_SLOWDOWN, SW_THERMAL, HW_THERMAL = 0x1, 0x4, 0x8, 0x20, 0x40


def test_the_guides_nvlink_pair():
    topo = topology("topo_guide_nv2.txt")
    assert topo.gpus == ["GPU0", "GPU1"] and topo.nics == []
    link = topo.link("GPU0", "GPU1")
    assert (link.kind, link.nvlinks, link.crosses_host_bridge) == ("nvlink", 2, False)
    assert topo.link("GPU1", "GPU0") == link and topo.link("GPU0", "GPU0").kind == "self"
    assert topo.cpu_affinity == {"GPU0": "0-23", "GPU1": "0-23"}
    assert topology_warnings(topo, zero_stage=3, env={}) == []


def test_the_guides_pcie_pair_warns_only_under_zero():
    topo = topology("topo_guide_phb.txt")
    link = topo.link("GPU0", "GPU1")
    assert (link.code, link.kind, link.nvlinks, link.crosses_host_bridge) == ("PHB", "pcie", 0, True)
    assert "host bridge" in link.description
    assert topology_warnings(topo, zero_stage=0, env={}) == []
    [warning] = topology_warnings(topo, zero_stage=3, env={})
    assert "ZeRO stage 3" in warning and "GPU0-GPU1 (PHB)" in warning


def test_a_dgx_a100_matrix_with_colour_codes_and_nics():
    topo = topology("topo_dgx_a100.txt")
    assert topo.gpus == [f"GPU{i}" for i in range(8)]
    assert topo.nics == [f"mlx5_{i}" for i in range(10)]
    assert {link.code for _, _, link in topo.gpu_pairs()} == {"NV12"} and len(topo.gpu_pairs()) == 28
    assert topo.link("GPU0", "mlx5_0").path == "PXB" and topo.link("GPU0", "mlx5_2").path == "SYS"
    assert topo.link("mlx5_8", "mlx5_9").path == "PIX"
    assert topo.numa_affinity["GPU4"] == "7" and topo.cpu_affinity["GPU2"] == "16-31,144-159"
    assert topology_warnings(topo, zero_stage=3, env={}) == []  # NVSwitch: every pair on NVLink


def test_a_dgx_h100_matrix_with_the_nic_legend():
    topo = topology("topo_dgx_h100.txt")
    assert all(link.nvlinks == 18 for _, _, link in topo.gpu_pairs())
    assert topo.nic_names["NIC3"] == "mlx5_3" and len(topo.nics) == 12
    assert topo.link("GPU1", "NIC3").path == "PIX"  # each GPU's own NIC, behind its PCIe switch
    assert topo.link("GPU0", "NIC1").path == "NODE" and topo.link("GPU0", "NIC6").path == "SYS"
    assert topo.numa_affinity == {**{f"GPU{i}": "0" for i in range(4)}, **{f"GPU{i}": "1" for i in range(4, 8)}}


def test_a_pcie_server_names_the_slow_pairs():
    topo = topology("topo_pcie_4gpu.txt")
    codes = {(a, b): link.code for a, b, link in topo.gpu_pairs()}
    assert codes[("GPU0", "GPU1")] == "PIX" and codes[("GPU2", "GPU3")] == "PXB"
    assert codes[("GPU0", "GPU2")] == "SYS"
    [warning] = topology_warnings(topo, zero_stage=2, env={})
    assert "GPU0-GPU2 (SYS)" in warning
    assert "GPU0-GPU1" not in warning and "GPU2-GPU3" not in warning  # PIX, PXB: no host bridge


@pytest.mark.parametrize("name", sorted(p.name for p in DATA.glob("topo_*.txt")))
def test_every_matrix_is_symmetric_with_self_on_the_diagonal(name):
    topo = topology(name)
    for a in topo.devices:
        assert topo.link(a, a).kind == "self"
        for b in topo.devices:
            assert topo.link(a, b) == topo.link(b, a)


def test_nccl_p2p_disabled_over_nvlink_is_warned():
    [warning] = topology_warnings(topology("topo_guide_nv2.txt"), zero_stage=0, env={"NCCL_P2P_DISABLE": "1"})
    assert "NCCL_P2P_DISABLE" in warning


def test_links_and_matrices_that_are_not_nvidia_smi_are_refused():
    assert parse_link("SOC").path == "SYS" and parse_link("NV4").nvlinks == 4
    with pytest.raises(ValueError, match="unknown link code"):
        parse_link("QPI")
    with pytest.raises(ValueError, match="no header"):
        parse_topology("No devices were found\n")
    with pytest.raises(ValueError, match="row GPU0 has 1 links for 2 devices"):
        parse_topology("\tGPU0\tGPU1\tCPU Affinity\nGPU0\t X \n")
    with pytest.raises(ValueError, match="no row for GPU1"):
        parse_topology("\tGPU0\tGPU1\tCPU Affinity\nGPU0\t X \tNV2\t0-23\n")


def test_throttle_reason_bits():
    assert throttle_reasons(0) == [] and throttle_reasons(None) == []
    assert throttle_reasons(GPU_IDLE) == ["gpu_idle"]
    assert throttle_reasons(SW_POWER_CAP | SW_THERMAL) == ["sw_power_cap", "sw_thermal_slowdown"]
    assert throttle_reasons(HW_SLOWDOWN | HW_THERMAL | 0x8000) == ["hw_slowdown", "hw_thermal_slowdown",
                                                                   "unknown_0x8000"]


def reading(**values) -> GpuReading:
    return GpuReading(index=0, name="NVIDIA A100-SXM4-80GB", **values)


def test_a_cool_idle_gpu_has_no_warnings():
    assert gpu_warnings(reading(temperature_c=45, throttle_mask=GPU_IDLE, power_w=60, power_limit_w=400,
                                power_default_limit_w=400)) == []
    assert gpu_warnings(reading(temperature_c=80, throttle_mask=0)) == []  # 80 C itself is fine


def test_a_hot_gpu_is_warned_above_80_c():
    [warning] = gpu_warnings(reading(temperature_c=86, throttle_mask=0))
    assert "86 C" in warning and "above 80 C" in warning and "cooling" in warning


@pytest.mark.parametrize("mask, words", [(HW_THERMAL, "thermal slowdown by the hardware"),
                                         (SW_THERMAL, "thermal slowdown by the driver"),
                                         (HW_SLOWDOWN, "hardware slowdown")])
def test_thermal_and_hardware_throttling_is_warned(mask, words):
    [warning] = gpu_warnings(reading(temperature_c=79, throttle_mask=mask, sm_clock_mhz=1005,
                                     max_sm_clock_mhz=1410))
    assert "GPU0" in warning and "throttling" in warning and words in warning
    assert "SM clock 1005 of 1410 MHz" in warning


def test_a_power_capped_gpu_is_told_about_its_cables():
    warnings = gpu_warnings(reading(temperature_c=70, throttle_mask=SW_POWER_CAP, power_w=398, power_limit_w=400))
    assert any("power limit" in w and "throttling" in w for w in warnings)
    assert any("398 W of its 400 W" in w and "pigtail" in w for w in warnings)


def test_a_lowered_power_limit_is_warned():
    [warning] = gpu_warnings(reading(power_limit_w=250, power_default_limit_w=400, throttle_mask=0))
    assert "lowered to 250 W" in warning


SMI_FIELDS = ["index", "name", "uuid", "pci.bus_id", "memory.total", "memory.used", "temperature.gpu",
              "power.draw", "power.limit", "power.default_limit", "clocks.sm", "clocks.max.sm",
              "utilization.gpu", "compute_cap", "clocks_throttle_reasons.active"]


def smi_readings() -> list[GpuReading]:
    return parse_smi_csv((DATA / "smi_query_h100_3090.csv").read_text(), SMI_FIELDS)


def test_nvidia_smi_query_rows_become_readings():
    h100, rtx, t4 = smi_readings()
    assert (h100.name, h100.memory_total, h100.compute_capability, h100.bf16) == \
        ("NVIDIA H100 80GB HBM3", 81559 * 1024**2, (9, 0), True)
    assert h100.throttle_mask == GPU_IDLE and gpu_warnings(h100) == []
    assert rtx.temperature_c == 86 and throttle_reasons(rtx.throttle_mask) == ["sw_power_cap", "sw_thermal_slowdown"]
    warnings = gpu_warnings(rtx)
    assert any("86 C" in w for w in warnings) and any("throttling" in w for w in warnings)
    assert t4.power_w is None and t4.compute_capability == (7, 5) and t4.bf16 is False
    assert any("lowered to 60 W" in w for w in gpu_warnings(t4))


def test_this_machines_host_facts():
    facts = host_facts({"here": "."})
    assert facts["usable_cores"] >= 1 and facts["logical_cores"] >= facts["usable_cores"]
    assert facts["ram_total"] >= facts["ram_available"] > 0
    assert facts["disks"]["here"]["free"] > 0 and facts["disks"]["here"]["filesystem"]


def test_direct_io_probe(tmp_path):
    ok, why = direct_io_works(str(tmp_path))
    if host_facts({"tmp": str(tmp_path)})["disks"]["tmp"]["filesystem"] in ("ext4", "xfs", "btrfs"):
        assert ok, why
    assert direct_io_works(str(tmp_path / "missing")) == (False, f"{tmp_path / 'missing'} is not a directory")


def test_doctor_reports_this_machine(capsys):
    """Acceptance 1: text and --json, no GPU said so, CPU, RAM, disk and versions reported."""
    text = launch(["python", "-m", "trainloop.doctor"], timeout=300).stdout
    assert doctor(["--json"]) == 0
    facts = json.loads(capsys.readouterr().out)
    for section in ("versions", "gpus", "host", "warnings"):
        assert f"\n{section}\n" in text
    assert f"torch {torch.__version__}" in text
    assert facts["versions"]["torch"]["version"] == torch.__version__
    for lib in ("accelerate", "transformers"):
        assert facts["versions"][lib]
    assert facts["versions"]["deepspeed"]["ops"]["cpu_adam"]["compatible"] in (True, False)
    assert facts["versions"]["bitsandbytes"]["backend"]
    assert facts["host"]["logical_cores"] >= 1 and facts["host"]["ram_total"] > 0
    assert facts["host"]["disks"]["run dir (cwd)"]["free"] > 0
    if not torch.cuda.is_available():
        assert facts["gpu"]["gpus"] == [] and facts["gpu"]["source"] is None
        assert "no GPU found" in text and "RAM:" in text and "disk:" in text


def test_doctor_checks_the_nvme_path_of_the_config(tmp_path, capsys):
    missing = tmp_path / "not_there"
    assert doctor(["--json", "+preset=zero3_nvme", f"deepspeed.nvme_path={missing}"]) == 0
    facts = json.loads(capsys.readouterr().out)
    assert facts["config"]["deepspeed.stage"] == 3
    assert facts["async_io"]["direct_io"] is False
    assert any("cannot do O_DIRECT" in w and str(missing) in w for w in facts["warnings"])


def test_doctor_reports_missing_libraries_instead_of_failing():
    """With deepspeed, bitsandbytes and NVML unimportable, it still reports everything else."""
    code = ("import sys; sys.modules.update(deepspeed=None, bitsandbytes=None, pynvml=None); "
            "from trainloop.tools.doctor import main; sys.exit(main(['--json']))")
    facts = json.loads(launch(["python", "-c", code], timeout=300).stdout)
    assert facts["versions"]["deepspeed"]["error"].startswith("import failed")
    assert facts["versions"]["bitsandbytes"]["error"].startswith("import failed")
    assert facts["host"]["ram_total"] > 0


def test_doctor_refuses_bad_overrides(capsys):
    assert doctor(["deepspeed.stage=7"]) == 2
    assert "deepspeed.stage=7" in capsys.readouterr().err


def test_doctor_report_for_a_pcie_gpu_server_under_zero3(capsys):
    """The doctor's GPU sections and warnings, from real-format readings of another machine."""
    cfg = compose_config(["+preset=zero3"])
    facts = doctor_module.examine(["+preset=zero3"])
    gpus = GpuReport(smi_readings()[:2] + [GpuReading(index=2, name="NVIDIA GeForce RTX 3090"),
                                           GpuReading(index=3, name="NVIDIA GeForce RTX 3090")],
                     "nvidia-smi", topology("topo_pcie_4gpu.txt"), "nvidia-smi topo -m")
    facts["gpu"] = gpus.to_dict()
    facts["warnings"] = doctor_module.warnings(facts, gpus, cfg)
    text = doctor_module.render(facts)
    assert "GPU1 NVIDIA GeForce RTX 3090: 24.0 GiB" in text and "compute 8.6, bf16 yes" in text
    assert "throttle: sw_power_cap, sw_thermal_slowdown" in text
    assert "interconnect (from nvidia-smi topo -m)" in text and "PIX: at most a single PCIe bridge" in text
    assert any("ZeRO stage 3" in w and "GPU0-GPU2 (SYS)" in w for w in facts["warnings"])
    assert any("86 C" in w for w in facts["warnings"])
    json.dumps(facts)  # --json prints the same data

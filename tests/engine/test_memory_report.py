"""engine/llama.py's memory report: the offload devices' free memory (none on a CPU build) and the
host's available memory, with a container's limit counted (cgroup v1 and v2 trees in a folder)."""

from __future__ import annotations

from pathlib import Path

import pytest

llama = pytest.importorskip("ringserve.engine.llama")

GIB = 1 << 30


def tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def meminfo(available_kib: int) -> str:
    return f"MemTotal:       65000000 kB\nMemFree:         1000000 kB\nMemAvailable:   {available_kib} kB\n"


def test_mem_available_without_a_limit(tmp_path: Path) -> None:
    proc = tree(tmp_path / "proc", {"meminfo": meminfo(8 * 1024 * 1024), "self/cgroup": "0::/\n"})
    cgroup = tree(tmp_path / "cg", {"memory.max": "max\n", "memory.current": "123\n"})
    assert llama.host_available(proc, cgroup) == 8 * GIB


def test_a_cgroup_v2_limit_lower_than_mem_available_wins(tmp_path: Path) -> None:
    # memory.max 4 GiB, 3 GiB used of which 1 GiB inactive page cache: 2 GiB left
    proc = tree(tmp_path / "proc", {"meminfo": meminfo(32 * 1024 * 1024), "self/cgroup": "0::/box/app\n"})
    cgroup = tree(
        tmp_path / "cg",
        {
            "box/app/memory.max": f"{4 * GIB}\n",
            "box/app/memory.current": f"{3 * GIB}\n",
            "box/app/memory.stat": f"anon 1\ninactive_file {GIB}\nactive_file 5\n",
        },
    )
    assert llama.host_available(proc, cgroup) == 2 * GIB


def test_a_cgroup_v1_limit(tmp_path: Path) -> None:
    proc = tree(
        tmp_path / "proc",
        {"meminfo": meminfo(32 * 1024 * 1024), "self/cgroup": "5:devices:/\n4:memory:/job/1\n0::/\n"},
    )
    cgroup = tree(
        tmp_path / "cg",
        {
            "memory/memory.limit_in_bytes": "9223372036854771712\n",
            "memory/memory.usage_in_bytes": "1\n",
            "memory/job/1/memory.limit_in_bytes": f"{6 * GIB}\n",
            "memory/job/1/memory.usage_in_bytes": f"{GIB}\n",
            "memory/job/1/memory.stat": "total_inactive_file 0\n",
        },
    )
    assert llama.host_available(proc, cgroup) == 5 * GIB


def test_no_meminfo_counts_nothing_available(tmp_path: Path) -> None:
    assert llama.host_available(tmp_path / "none", tmp_path / "none") == 0


def test_memory_report_of_this_machine() -> None:
    report = llama.memory_report()
    assert report.host_available > 0
    assert tuple(g.name for g in report.gpus) == llama.gpu_devices()
    assert all(0 < g.free <= g.total for g in report.gpus)

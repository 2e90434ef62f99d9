"""What memory a process may use: the machine's RAM, or its cgroup's limit if lower."""

from __future__ import annotations

from pathlib import Path

from shoal.runtime._memory import (
    cgroup_limit,
    container_limit_bytes,
    limit_files,
    physical_memory_bytes,
    usable_memory_bytes,
)

V1_NO_LIMIT = "9223372036854771712\n"  # what cgroup v1 writes for "no limit"


def test_limit_texts_of_both_cgroup_versions() -> None:
    assert cgroup_limit("536870912\n") == 512 * 2**20
    assert cgroup_limit("max\n") is None  # v2: no limit
    assert cgroup_limit(V1_NO_LIMIT) is None
    assert cgroup_limit("") is None
    assert cgroup_limit("garbage") is None


def test_the_files_that_may_hold_the_limit_follow_proc_self_cgroup(tmp_path: Path) -> None:
    v2 = limit_files("0::/kubepods/pod1/c1\n", tmp_path)
    assert v2[0] == tmp_path / "kubepods/pod1/c1/memory.max"
    v1 = limit_files("4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n0::/\n", tmp_path)
    assert tmp_path / "memory/docker/abc/memory.limit_in_bytes" in v1
    assert tmp_path / "memory.max" in v1
    assert v1[-1] == tmp_path / "memory/memory.limit_in_bytes"  # a container's own mount


def test_a_container_limit_is_read_and_the_lowest_taken(tmp_path: Path) -> None:
    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text("0::/pod\n4:memory:/pod\n")
    assert container_limit_bytes(root, proc) is None  # no file: no limit known
    (root / "pod").mkdir(parents=True)
    (root / "pod" / "memory.max").write_text("max\n")
    (root / "memory" / "pod").mkdir(parents=True)
    (root / "memory" / "pod" / "memory.limit_in_bytes").write_text(V1_NO_LIMIT)
    assert container_limit_bytes(root, proc) is None  # both say "no limit"
    (root / "pod" / "memory.max").write_text("2147483648\n")
    (root / "memory" / "memory.limit_in_bytes").write_text("1073741824\n")
    assert container_limit_bytes(root, proc) == 2**30


def test_this_machine_has_a_known_amount_of_memory() -> None:
    ram = physical_memory_bytes()
    assert ram is not None
    assert ram > 2**27
    usable = usable_memory_bytes()
    assert usable is not None
    assert usable <= ram

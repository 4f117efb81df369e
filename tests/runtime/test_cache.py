"""The on-disk cubin cache (no GPU needed: ptxas is faked unless a test needs the real one)."""
import os

import pytest

from tessera.runtime import cache, ptxas
from tessera.runtime.cache import CubinCache


def fake_cubin(payload: bytes = b"code") -> bytes:
    """A minimal well-formed ELF64 file: header, then `payload`, then one section header."""
    shoff = 64 + len(payload)
    header = (b"\x7fELF\x02\x01\x01" + bytes(9) + (2).to_bytes(2, "little") + (190).to_bytes(2, "little")
              + (1).to_bytes(4, "little") + bytes(8) + (0).to_bytes(8, "little") + shoff.to_bytes(8, "little")
              + bytes(4) + (64).to_bytes(2, "little") + (56).to_bytes(2, "little") + (0).to_bytes(2, "little")
              + (64).to_bytes(2, "little") + (1).to_bytes(2, "little") + bytes(2))
    assert len(header) == 64
    return header + payload + bytes(64)


#: ptxas -v's report of one kernel, as FakeAssembler logs it
LOG = ("ptxas info    : Compiling entry function 'k' for 'sm_90a'\n"
       "ptxas info    : Used 40 registers, 1024 bytes smem, 384 bytes cmem[0]\n")


class FakeAssembler:
    """Counts assemble() calls; each returns a distinct well-formed cubin."""

    def __init__(self):
        self.calls = []

    def __call__(self, ptx, arch, opt_level):
        self.calls.append((ptx, arch, opt_level))
        cubin = fake_cubin(f"{ptx}|{arch}|{opt_level}".encode())
        return ptxas.Assembled(cubin, arch, opt_level, ptxas.parse_resources(LOG), LOG)


@pytest.fixture
def fake():
    return FakeAssembler()


@pytest.fixture
def store(tmp_path, fake):
    return CubinCache(tmp_path / "cubin", assemble=fake, ptxas_version=lambda: "ptxas 13.0")


def test_elf_check_accepts_whole_files_only():
    cubin = fake_cubin()
    assert cache.is_complete_elf(cubin)
    assert not cache.is_complete_elf(cubin[:-1])          # truncated: section headers cut
    assert not cache.is_complete_elf(b"\x00ELF" + cubin[4:])  # bad magic
    assert not cache.is_complete_elf(b"")


def test_second_request_is_served_from_disk(store, fake):
    first = store.cubin("ptx", "sm_90a", 3)
    assert store.cubin("ptx", "sm_90a", 3) == first
    assert len(fake.calls) == 1
    assert store.path(store.key("ptx", "sm_90a", 3)).read_bytes() == first


def test_a_cached_entry_keeps_ptxas_report(store, fake):
    first = store.assembled("ptx", "sm_90a", 3)
    again = store.assembled("ptx", "sm_90a", 3)
    assert len(fake.calls) == 1
    assert (again.cubin, again.arch, again.opt_level, again.log) == (first.cubin, "sm_90a", 3, LOG)
    assert again.resources == first.resources == {"k": ptxas.Resources(registers=40, shared_bytes=1024)}


def test_an_entry_without_its_log_is_rebuilt(store, fake):
    """A cubin cached without ptxas's log (as before logs were kept) has no report: assembled again."""
    key = store.key("ptx", "sm_90a", 3)
    store.put(key, fake_cubin(b"old"))
    assert store.assembled("ptx", "sm_90a", 3).resources == {"k": ptxas.Resources(registers=40, shared_bytes=1024)}
    assert len(fake.calls) == 1 and store.get_log(key) == LOG


def test_a_new_store_on_the_same_directory_finds_the_entry(store, fake, tmp_path):
    store.cubin("ptx", "sm_90a", 3)
    again = CubinCache(tmp_path / "cubin", assemble=fake, ptxas_version=lambda: "ptxas 13.0")
    again.cubin("ptx", "sm_90a", 3)
    assert len(fake.calls) == 1


@pytest.mark.parametrize("change", [
    {"ptx": "ptx2"}, {"arch": "sm_80"}, {"opt_level": 2}, {"ptxas_version": "ptxas 13.1"},
])
def test_key_changes_with_every_input(change):
    base = {"ptx": "ptx", "arch": "sm_90a", "opt_level": 3, "ptxas_version": "ptxas 13.0"}
    assert cache.cache_key(**base) != cache.cache_key(**{**base, **change})
    assert cache.cache_key(**base) == cache.cache_key(**base)


def test_key_fields_cannot_run_together():
    assert cache.cache_key("ab", "c", 3, "v") != cache.cache_key("a", "bc", 3, "v")


def test_arch_and_opt_level_get_their_own_entries(store, fake):
    store.cubin("ptx", "sm_90a", 3)
    store.cubin("ptx", "sm_80", 3)
    store.cubin("ptx", "sm_90a", 0)
    assert len(fake.calls) == 3
    assert len(list(store.directory.glob("*.cubin"))) == 3


@pytest.mark.parametrize("damage", [
    lambda data: data[: len(data) // 2],   # truncated by a crash mid-write (of a non-atomic writer)
    lambda data: b"garbage" + data[7:],    # overwritten
    lambda data: b"",                      # empty
    lambda data: data[:-1] + bytes([data[-1] ^ 1]),   # one flipped bit, still a whole ELF file
])
def test_corrupt_entry_is_removed_and_rebuilt(store, fake, damage):
    """Damage the ELF check sees, and a flipped byte it does not (the digest does)."""
    good = store.cubin("ptx", "sm_90a", 3)
    path = store.path(store.key("ptx", "sm_90a", 3))
    path.write_bytes(damage(good))
    assert store.get(store.key("ptx", "sm_90a", 3)) is None
    assert not path.exists()
    assert store.cubin("ptx", "sm_90a", 3) == good
    assert len(fake.calls) == 2 and path.read_bytes() == good


def test_put_is_atomic_when_the_write_fails(store, monkeypatch):
    key = store.key("ptx", "sm_90a", 3)
    old = fake_cubin(b"old")
    store.put(key, old)

    def crash(fd):
        raise OSError("disk full")
    monkeypatch.setattr(os, "fsync", crash)
    with pytest.raises(OSError, match="disk full"):
        store.put(key, fake_cubin(b"new"))
    assert store.path(key).read_bytes() == old           # the old entry is untouched
    assert store.get(key) == old                          # and still whole: its digest too
    assert sorted(p.name for p in store.directory.iterdir()) == [f"{key}.cubin", f"{key}.sha256"]  # no temp file


def test_put_writes_through_a_temp_file_in_the_same_directory(store, monkeypatch):
    replaced = []
    real_replace = os.replace

    def spy(src, dst):
        replaced.append((os.path.dirname(src), os.path.dirname(dst)))
        real_replace(src, dst)
    monkeypatch.setattr(os, "replace", spy)
    store.put("k" * 64, fake_cubin())
    assert replaced == [(str(store.directory), str(store.directory))] * 2   # the digest, then the cubin


def test_put_refuses_non_cubins(store):
    with pytest.raises(ValueError, match="not a complete ELF cubin"):
        store.put("k" * 64, b"not elf")


def test_directory_comes_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("TESSERA_CACHE_DIR", str(tmp_path / "elsewhere"))
    assert CubinCache().directory == tmp_path / "elsewhere"
    monkeypatch.delenv("TESSERA_CACHE_DIR")
    assert cache.default_directory() == cache.Path.home() / ".cache" / "tessera" / "cubin"


EMPTY_KERNEL = ".version 8.0\n.target sm_80\n.address_size 64\n.visible .entry nothing()\n{\n    ret;\n}\n"


@pytest.mark.skipif(not ptxas.available(), reason="ptxas not installed")
def test_real_cubins_pass_the_elf_check(tmp_path):
    store = CubinCache(tmp_path)
    cubin = store.cubin(EMPTY_KERNEL, "sm_80")
    assert cache.is_complete_elf(cubin)
    assert not cache.is_complete_elf(cubin[:-1])
    assert store.get(store.key(EMPTY_KERNEL, "sm_80")) == cubin

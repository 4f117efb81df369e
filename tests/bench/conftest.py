import pytest


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    """Default result files, and the cubin cache, land in the test's own folder."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TESSERA_CACHE_DIR", str(tmp_path / "cubin-cache"))
    monkeypatch.delenv("OUT", raising=False)

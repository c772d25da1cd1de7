"""The opt-in on-disk kernel cache (``dspark_cute.runtime.disk_cache``) on a
CPU: a compile writes its object, another process loads it instead of
compiling, other settings miss, untrusted and torn files are refused and
compiled over, and without ``DSPARK_KERNEL_CACHE`` nothing touches the disk.
(That a loaded kernel launches with the compiled one's bits is
``test_gpu_disk_cache.py``.)"""

from __future__ import annotations

import hashlib
import os
import random
import subprocess
import sys
import textwrap

import pytest

from dspark_core.contracts.constants import MlpActivationConstants
from dspark_cute.runtime import disk_cache, host

pytestmark = pytest.mark.compile


@pytest.fixture(scope="module")
def full_compiles():
    """Skip where this CuTe DSL cannot finish a compile without a CUDA driver
    (4.3.5 on a CPU machine compiles PTX only; 4.8 compiles and loads)."""
    from dspark_cute.cutedsl.gating.mlp_activation import compile_mlp_activation

    try:
        host.compile_kernel(*_built(compile_mlp_activation.build(MlpActivationConstants(512), False)))
    except Exception as error:
        if "driver" not in str(error).lower():
            raise
        pytest.skip(f"this CuTe DSL needs a CUDA driver to finish a compile ({type(error).__name__})")


def _built(pair):
    obj, fake_args = pair
    return (obj, *fake_args)


@pytest.fixture
def fresh(monkeypatch, tmp_path, full_compiles):
    """The cache in ``tmp_path/kernels``; the activation's in-memory cache
    empty; compiles counted."""
    from dspark_cute.cutedsl.gating.mlp_activation import compile_mlp_activation

    monkeypatch.setenv("DSPARK_KERNEL_CACHE", str(tmp_path / "kernels"))
    monkeypatch.setattr(disk_cache, "_warned", set())
    compiles = []
    real = host.compile_kernel

    def counted(obj, *args, **kwargs):
        compiles.append(type(obj).__name__)
        return real(obj, *args, **kwargs)

    monkeypatch.setattr(host, "compile_kernel", counted)
    compile_mlp_activation.cache_clear()
    yield compile_mlp_activation, compiles, tmp_path / "kernels"
    compile_mlp_activation.cache_clear()


def _objects(root):
    return sorted(p.name for p in root.iterdir() if p.suffix == ".o")


def test_a_compile_is_stored_and_loaded_instead_of_compiled(fresh):
    compile_act, compiles, root = fresh
    first = compile_act(MlpActivationConstants(1024), False)
    assert compiles == ["MlpActivationKernel"] and len(_objects(root)) == 1
    assert (root / _objects(root)[0]).stat().st_mode & 0o077 == 0
    compile_act.cache_clear()
    loaded = compile_act(MlpActivationConstants(1024), False)
    assert compiles == ["MlpActivationKernel"]  # no second compile
    assert loaded is not first and type(loaded) is type(first)
    assert loaded.kernel_info == first.kernel_info
    # Other settings are other keys.
    compile_act(MlpActivationConstants(1024), True)
    compile_act(MlpActivationConstants(2048), False)
    assert len(compiles) == 3 and len(_objects(root)) == 3


def test_another_process_loads_without_compiling(fresh):
    compile_act, compiles, root = fresh
    compile_act(MlpActivationConstants(3072), False)
    script = textwrap.dedent("""
        from dspark_core.contracts.constants import MlpActivationConstants
        from dspark_cute.runtime import host

        def refuse(*args, **kwargs):
            raise SystemExit("compiled although the cache holds the variant")

        host.compile_kernel = refuse
        from dspark_cute.cutedsl.gating.mlp_activation import compile_mlp_activation

        kernel = compile_mlp_activation(MlpActivationConstants(3072), False)
        print("loaded", type(kernel).__name__)
    """)
    env = dict(os.environ, CUTE_DSL_ARCH=os.environ.get("CUTE_DSL_ARCH", "sm_90a"))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:] + done.stdout[-2000:]
    assert "loaded CudaDialectJitCompiledFunction" in done.stdout


def _one(root, suffix):
    (path,) = [p for p in root.iterdir() if p.suffix == suffix]
    return path


def test_untrusted_and_torn_files_are_compiled_over(fresh, caplog):
    compile_act, compiles, root = fresh
    compile_act(MlpActivationConstants(1024), False)
    path, digest = _one(root, ".o"), _one(root, ".sha256")
    assert digest.stat().st_mode & 0o077 == 0
    compile_act.cache_clear()
    path.chmod(0o666)  # others may write it: never loaded
    compile_act(MlpActivationConstants(1024), False)
    assert len(compiles) == 2 and "group or others may write" in caplog.text
    compile_act.cache_clear()
    path.chmod(0o600)
    path.write_bytes(b"not an object file")  # torn: its digest no longer matches
    compile_act(MlpActivationConstants(1024), False)
    assert len(compiles) == 3 and "does not match its SHA-256" in caplog.text
    compile_act.cache_clear()
    compile_act(MlpActivationConstants(1024), False)  # the torn file was written over
    assert len(compiles) == 3
    # A file whose digest matches but which is no object: the load fails, compiled over.
    compile_act.cache_clear()
    path.write_bytes(b"not an object file")
    digest.write_text(hashlib.sha256(b"not an object file").hexdigest())
    compile_act(MlpActivationConstants(1024), False)
    assert len(compiles) == 4 and "did not load" in caplog.text


def test_a_flipped_byte_is_refused_logged_once_and_compiled_over(fresh, caplog, monkeypatch, seed):
    import cutlass.cute as cute

    compile_act, compiles, root = fresh
    compile_act(MlpActivationConstants(2048), False)
    path = _one(root, ".o")
    flipped = bytearray(path.read_bytes())
    rng = random.Random(seed)
    at = rng.randrange(len(flipped))
    flipped[at] ^= 1 << rng.randrange(8)
    print(f"flipped a bit of byte {at} of {len(flipped)}")
    loads = []
    original = cute.runtime.load_module
    monkeypatch.setattr(cute.runtime, "load_module", lambda *a, **k: loads.append(a) or original(*a, **k))
    for attempt in range(2):
        path.write_bytes(bytes(flipped))
        compile_act.cache_clear()
        compile_act(MlpActivationConstants(2048), False)
        assert len(compiles) == 2 + attempt and not loads  # never loaded: compiled instead
        assert path.read_bytes() != bytes(flipped)  # and written over
    refusals = [r for r in caplog.records if "does not match its SHA-256" in r.getMessage()]
    assert len(refusals) == 1, [r.getMessage() for r in refusals]
    compile_act.cache_clear()
    compile_act(MlpActivationConstants(2048), False)  # the rewritten object loads
    assert len(compiles) == 3 and len(loads) == 1


def test_a_writable_directory_is_refused(fresh, caplog):
    compile_act, compiles, root = fresh
    root.mkdir()
    root.chmod(0o777)
    compile_act(MlpActivationConstants(1024), False)
    assert compiles and not _objects(root) and "group or others may write" in caplog.text


@pytest.mark.parametrize("mode, trusted", [(0o777, False), (0o775, False), (0o1777, True), (0o755, True)])
def test_a_parent_others_may_write_is_refused_unless_sticky(fresh, monkeypatch, caplog, mode, trusted):
    compile_act, compiles, root = fresh
    parent = root.parent / "shared"
    parent.mkdir()
    parent.chmod(mode)
    inner = parent / "kernels"
    inner.mkdir(mode=0o700)  # private itself: only its parent is open
    monkeypatch.setenv("DSPARK_KERNEL_CACHE", str(inner))
    compile_act(MlpActivationConstants(1024), False)
    assert bool(_objects(inner)) is trusted
    assert ("above the cache (and it is not sticky)" in caplog.text) is not trusted


def test_off_without_the_variable(fresh, monkeypatch):
    compile_act, compiles, root = fresh
    monkeypatch.delenv("DSPARK_KERNEL_CACHE")
    compile_act(MlpActivationConstants(1024), False)
    assert compiles and not root.exists()


def test_the_variable_is_parsed_strictly(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    for value in ("", " ", "0", "false", "OFF", "no"):
        monkeypatch.setenv("DSPARK_KERNEL_CACHE", value)
        assert disk_cache.directory() is None, value
    for value in ("1", "true", "On", "yes"):
        monkeypatch.setenv("DSPARK_KERNEL_CACHE", value)
        assert disk_cache.directory() == tmp_path / "xdg" / "dspark" / "kernels", value
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")  # ignored, as XDG says
    assert disk_cache.directory() == tmp_path / "home" / ".cache" / "dspark" / "kernels"
    monkeypatch.setenv("DSPARK_KERNEL_CACHE", "~/k")
    assert disk_cache.directory() == tmp_path / "home" / "k"
    monkeypatch.setenv("DSPARK_KERNEL_CACHE", str(tmp_path / "a" / ".." / "b"))
    assert disk_cache.directory() == tmp_path / "b"
    for value in ("~", "~/", "~/.", "/", str(tmp_path / "home"), "kernels", "./kernels", "2", "~other/k"):
        monkeypatch.setenv("DSPARK_KERNEL_CACHE", value)
        with pytest.raises(ValueError, match="DSPARK_KERNEL_CACHE"):
            disk_cache.directory()


def test_keys_are_stable_and_refuse_what_prints_its_address(monkeypatch):
    monkeypatch.setattr(disk_cache, "_warned", set())

    def fn():
        pass

    a = disk_cache.key(fn, (MlpActivationConstants(1024), False, 0.0))
    assert a == disk_cache.key(fn, (MlpActivationConstants(1024), False, 0.0))
    assert a != disk_cache.key(fn, (MlpActivationConstants(1024), False, -0.0))
    assert a != disk_cache.key(fn, (MlpActivationConstants(1024), True, 0.0))
    assert disk_cache.key(fn, (object(),)) is None

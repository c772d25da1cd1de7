"""The opt-in on-disk kernel cache (``dspark_cute.runtime.disk_cache``) on a
CPU: a compile writes its object, another process loads it instead of
compiling, other settings miss, untrusted and torn files are refused and
compiled over, and without ``DSPARK_KERNEL_CACHE`` nothing touches the disk.
(That a loaded kernel launches with the compiled one's bits is
``test_gpu_disk_cache.py``.)"""

from __future__ import annotations

import os
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


def test_untrusted_and_torn_files_are_compiled_over(fresh, caplog):
    compile_act, compiles, root = fresh
    compile_act(MlpActivationConstants(1024), False)
    (path,) = [root / name for name in _objects(root)]
    compile_act.cache_clear()
    path.chmod(0o666)  # others may write it: never loaded
    compile_act(MlpActivationConstants(1024), False)
    assert len(compiles) == 2 and "group or others may write" in caplog.text
    compile_act.cache_clear()
    path.chmod(0o600)
    path.write_bytes(b"not an object file")
    compile_act(MlpActivationConstants(1024), False)
    assert len(compiles) == 3 and "did not load" in caplog.text
    compile_act.cache_clear()
    compile_act(MlpActivationConstants(1024), False)  # the torn file was written over
    assert len(compiles) == 3


def test_a_writable_directory_is_refused(fresh, caplog):
    compile_act, compiles, root = fresh
    root.mkdir()
    root.chmod(0o777)
    compile_act(MlpActivationConstants(1024), False)
    assert compiles and not _objects(root) and "group or others may write" in caplog.text


def test_off_without_the_variable(fresh, monkeypatch):
    compile_act, compiles, root = fresh
    for value in ("", "0"):
        monkeypatch.setenv("DSPARK_KERNEL_CACHE", value)
        assert disk_cache.directory() is None
    monkeypatch.delenv("DSPARK_KERNEL_CACHE")
    compile_act(MlpActivationConstants(1024), False)
    assert compiles and not root.exists()
    monkeypatch.setenv("DSPARK_KERNEL_CACHE", "1")
    monkeypatch.setenv("XDG_CACHE_HOME", str(root.parent / "xdg"))
    assert disk_cache.directory() == root.parent / "xdg" / "dspark" / "kernels"


def test_keys_are_stable_and_refuse_what_prints_its_address(monkeypatch):
    monkeypatch.setattr(disk_cache, "_warned", set())

    def fn():
        pass

    a = disk_cache.key(fn, (MlpActivationConstants(1024), False, 0.0))
    assert a == disk_cache.key(fn, (MlpActivationConstants(1024), False, 0.0))
    assert a != disk_cache.key(fn, (MlpActivationConstants(1024), False, -0.0))
    assert a != disk_cache.key(fn, (MlpActivationConstants(1024), True, 0.0))
    assert disk_cache.key(fn, (object(),)) is None

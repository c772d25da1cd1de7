"""Switches mean what they say (``dspark_core.switches``): a Python switch is
a bool or a TypeError, an environment switch one of the accepted words or a
ValueError naming them, and ``DSPARK_KERNEL_CACHE``-style settings off, the
default directory, an absolute directory, or a ValueError."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark_core import switches
from dspark_core.planner import policy
from dspark_core.reference.adapter import describe
from dspark_core.reference.config import small_config
from dspark_core.reference.model import DraftModel
from dspark_core.runtime.build import build_draft_decode

WORDS = {w for w in switches.ON + switches.OFF}
# Strings that are no switch word in any case (stripped), including the near misses.
NOT_WORDS = st.text(max_size=12).filter(lambda t: t.strip() and t.strip().lower() not in WORDS)
NOT_BOOLS = st.one_of(st.integers(), st.floats(allow_nan=True), st.text(), st.none(), st.lists(st.booleans()),
                      st.sampled_from(["0", "no", "false", "off", "", 0, 1, 0.0]))


@settings(max_examples=80, deadline=None)
@given(value=NOT_BOOLS.filter(lambda v: v is not None))
def test_a_python_switch_that_is_not_a_bool_is_a_type_error(value):
    with pytest.raises(TypeError, match="gemv must be True or False"):
        switches.flag(value, "gemv")
    with pytest.raises(TypeError, match="must be True or False"):
        policy.asked_opt_ins(gemv=value)
    assert switches.flag(True, "gemv") is True and switches.flag(False, "gemv") is False


@pytest.mark.parametrize("name, value", [("gemv", "0"), ("gemv", "no"), ("package_gemm", 1),
                                         ("package_gemm", "False")])
def test_build_draft_decode_refuses_a_truthy_string_for_a_switch(name, value):
    draft = describe(DraftModel(small_config(num_layers=1), device="meta"))
    with pytest.raises(TypeError, match=f"{name} must be True or False"):
        build_draft_decode(draft, **{name: value})
    with pytest.raises(TypeError, match="prefetch must be None, True, False or a dict"):
        build_draft_decode(draft, prefetch="0")


@settings(max_examples=60, deadline=None)
@given(word=st.sampled_from(sorted(WORDS)), upper=st.booleans(), pad=st.sampled_from(["", " ", "\t"]))
def test_every_accepted_word_in_any_case(word, upper, pad):
    text = pad + (word.upper() if upper else word) + pad
    assert switches.env_flag("DSPARK_X", default=None, environ={"DSPARK_X": text}) is (word in switches.ON)


@settings(max_examples=100, deadline=None)
@given(text=NOT_WORDS)
def test_any_other_environment_value_is_a_value_error_naming_the_words(text):
    with pytest.raises(ValueError, match=r"DSPARK_GEMV must be one of 1, true, on, yes \(on\) or 0, false"):
        switches.env_flag("DSPARK_GEMV", False, {"DSPARK_GEMV": text})
    with pytest.raises(ValueError, match="DSPARK_GEMV must be one of"):
        switches.switch(None, "DSPARK_GEMV", environ={"DSPARK_GEMV": text})


def test_unset_or_empty_keeps_the_default_and_a_caller_value_wins():
    for environ in ({}, {"DSPARK_GEMV": ""}, {"DSPARK_GEMV": "  "}):
        assert switches.env_flag("DSPARK_GEMV", True, environ) is True
        assert switches.switch(None, "DSPARK_GEMV", environ=environ) is False
    assert switches.switch(True, "DSPARK_GEMV", environ={"DSPARK_GEMV": "off"}) is True
    with pytest.raises(TypeError, match="gemv must be True or False"):
        switches.switch("1", "DSPARK_GEMV", environ={})


def test_an_environment_choice_is_one_of_its_values():
    names = ("staged", "direct")
    assert switches.env_choice("DSPARK_ATTENTION", names, "staged", {}) == "staged"
    assert switches.env_choice("DSPARK_ATTENTION", names, "staged", {"DSPARK_ATTENTION": " direct "}) == "direct"
    for bad in ("Direct", "fast", "0"):
        with pytest.raises(ValueError, match="DSPARK_ATTENTION must be one of staged, direct"):
            switches.env_choice("DSPARK_ATTENTION", names, "staged", {"DSPARK_ATTENTION": bad})


def test_build_draft_decode_reads_the_environment_strictly(monkeypatch):
    draft = describe(DraftModel(small_config(num_layers=1), device="meta"))
    for name in ("DSPARK_GEMV", "DSPARK_PACKAGE_GEMM", "DSPARK_PREFETCH"):
        monkeypatch.setenv(name, "maybe")
        with pytest.raises(ValueError, match=f"{name} must be one of"):
            build_draft_decode(draft)
        monkeypatch.setenv(name, "off")
    monkeypatch.setenv("DSPARK_ATTENTION", "Staged")
    with pytest.raises(ValueError, match="DSPARK_ATTENTION must be one of staged, direct"):
        build_draft_decode(draft)
    monkeypatch.setenv("DSPARK_ATTENTION", "staged")
    assert build_draft_decode(draft) is None  # a CPU: the whole draft stays stock, the switches parsed


HOME = Path("/home/someone")


@pytest.fixture
def home(monkeypatch):
    monkeypatch.setenv("HOME", str(HOME))


@pytest.mark.parametrize("text, expected", [
    ("0", None), ("false", None), ("OFF", None), ("no", None), ("", None),
    ("1", "default"), ("true", "default"), ("On", "default"),
    ("/var/cache/k", Path("/var/cache/k")), ("/var/cache/../k/", Path("/var/k")),
    ("~/k", HOME / "k"), ("~/.cache/dspark", HOME / ".cache/dspark"),
    ("//var/cache/k", Path("/var/cache/k")), ("~//k", HOME / "k"), ("~//var/./k//", HOME / "var/k"),
])
def test_a_cache_setting_is_off_the_default_or_a_directory(home, text, expected):
    default = Path("/default/dir")
    got = switches.cache_setting("DSPARK_KERNEL_CACHE", default, {"DSPARK_KERNEL_CACHE": text})
    assert got == (default if expected == "default" else expected)


@pytest.mark.parametrize("text", ["~", "~/", "~/.", "~/..", "/", "/home", str(HOME), "kernels", "./kernels",
                                  "k/../", "2", "enabled", "~other/k", "//", "///", "~//", "//home/", "~//..",
                                  "/var/k/../../", "/var/\0k"])
def test_a_cache_setting_refuses_the_home_directory_relative_paths_and_other_words(home, text):
    with pytest.raises(ValueError, match="DSPARK_KERNEL_CACHE"):
        switches.cache_setting("DSPARK_KERNEL_CACHE", Path("/d"), {"DSPARK_KERNEL_CACHE": text})


def test_a_cache_setting_resolves_links_before_the_home_rule(tmp_path, monkeypatch):
    """A link to ``/`` or to a directory above the home directory is that
    directory: refused, naming both; a link to a directory of its own is
    kept as written (the cache itself refuses a linked directory)."""
    home = tmp_path / "home" / "someone"
    home.mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    (tmp_path / "root").symlink_to("/")
    (tmp_path / "up").symlink_to(tmp_path / "home")
    (tmp_path / "own").symlink_to(tmp_path / "elsewhere")
    for link, real in (("root", "/"), ("up", tmp_path / "home")):
        with pytest.raises(ValueError, match=f"names {tmp_path / link} \\(really {real}\\), the home directory"):
            switches.cache_setting("DSPARK_KERNEL_CACHE", Path("/d"), {"DSPARK_KERNEL_CACHE": str(tmp_path / link)})
    got = switches.cache_setting("DSPARK_KERNEL_CACHE", Path("/d"), {"DSPARK_KERNEL_CACHE": f"{tmp_path}//own/."})
    assert got == tmp_path / "own"


def test_a_cache_setting_reads_dot_dot_after_a_link_as_the_system_does(tmp_path, monkeypatch):
    """``link/..`` is the parent of the link's target (what ``open`` would
    reach), not the link's folder: a link to the home directory followed by
    ``..`` names the directory above home, refused; ``..`` without links is
    the lexical parent."""
    home = tmp_path / "home" / "someone"
    home.mkdir(parents=True)
    (tmp_path / "deep" / "er").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    (tmp_path / "deep" / "tohome").symlink_to(home)
    with pytest.raises(ValueError, match="the home directory or one above it"):
        switches.cache_setting("DSPARK_KERNEL_CACHE", Path("/d"),
                               {"DSPARK_KERNEL_CACHE": f"{tmp_path}/deep/tohome/.."})
    got = switches.cache_setting("DSPARK_KERNEL_CACHE", Path("/d"),
                                 {"DSPARK_KERNEL_CACHE": f"{tmp_path}/deep/tohome/../cache"})
    assert got == tmp_path / "home" / "cache"
    got = switches.cache_setting("DSPARK_KERNEL_CACHE", Path("/d"), {"DSPARK_KERNEL_CACHE": f"{tmp_path}/deep/er/../k"})
    assert got == tmp_path / "deep" / "k"
    # Only the part up to the last ".." is resolved: a link after it stays a link (the cache refuses it).
    (tmp_path / "deep" / "last").symlink_to(tmp_path / "elsewhere")
    got = switches.cache_setting("DSPARK_KERNEL_CACHE", Path("/d"),
                                 {"DSPARK_KERNEL_CACHE": f"{tmp_path}/deep/er/../last"})
    assert got == tmp_path / "deep" / "last"

import os

from testlib import CPU_COMPILE

# Multi-device code is tested on 8 fake CPU devices; this must happen before jax is imported.
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8 {CPU_COMPILE}"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache for the session and the `olmax` processes it starts, kept between runs and
# clones (the user's cache directory): most tests train the same tiny model, and a cached executable is the
# same executable (results stay bitwise the same; JAX keys entries by program, version and flags).
CACHE_HOME = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(CACHE_HOME, "olmax", "jax-tests"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# Ahead-of-time compiles (olmax compile, plan, tune) are kept by their program in a cache of the suite's own.
os.environ.setdefault("OLMAX_COMPILE_CACHE", os.path.join(CACHE_HOME, "olmax", "compiles-tests"))
# `olmax train` run in-process (olmax.cli.main) must not restart the test process with glibc's huge pages.
os.environ["OLMAX_HUGE_PAGES"] = "0"


import json  # noqa: E402

import pytest  # noqa: E402
from suite_budget import PROFILE, Budget, record_events  # noqa: E402

# What the tests cost, counted in every process of the session, for the budget's check at its end.
record_events()


def pytest_configure(config):
    if not hasattr(config, "workerinput"):
        config.pluginmanager.register(Budget(), "suite_budget")
    # pytest-xdist hands out whole files (--dist loadfile) and by default orders them by their number of tests,
    # which starts the end-to-end files (one or two tests of minutes each) last: at the end of the run one of
    # them ran alone on one core. The order is this file's (below) instead.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items):
    """The longest test files first, by their seconds in the suite's profile, so the short ones fill in at the end;
    a file the profile does not know yet goes first (it may be long)."""
    seconds = {path: row.get("wall", 0.0) for path, row in json.loads(PROFILE.read_text())["files"].items()}
    items.sort(key=lambda item: -seconds.get(item.nodeid.split("::")[0], float("inf")))


@pytest.fixture(scope="module")
def cfg():
    """The tiny preset (its model is what the eval tests score)."""
    from olmax.config import load_config

    return load_config("tiny")


@pytest.fixture(scope="module")
def params(cfg):
    """Randomly initialised tiny-model params on the host."""
    import jax

    from olmax.model import families

    return jax.device_get(families.init_params(cfg.model, jax.random.key(0)))


def synth_data(root, token_dtype: str):
    from olmax.data.synthetic import write_synthetic_shards

    write_synthetic_shards(root, vocab_size=512, eos_id=0, n_tokens=100_000, n_shards=2, seed=0,
                           token_dtype=token_dtype)
    return root / "mix.txt"


@pytest.fixture(scope="session")
def synth_mix(tmp_path_factory):
    """The mix file of two shards of the generated language in tiny's uint16, as `olmax synth-data` writes
    them (with their shards record). Shared: copy before changing."""
    return synth_data(tmp_path_factory.mktemp("synth") / "data", "uint16")


@pytest.fixture(scope="session")
def synth_mix32(tmp_path_factory):
    """The same tokens as synth_mix, written as uint32."""
    return synth_data(tmp_path_factory.mktemp("synth32") / "data32", "uint32")


@pytest.fixture(scope="session")
def shards(tmp_path_factory):
    """The paths of two shards of the generated language (200,000 tokens, uint16), what most training tests read.
    Shared: read only."""
    from olmax.data.synthetic import write_synthetic_shards

    return write_synthetic_shards(tmp_path_factory.mktemp("shards"), vocab_size=512, eos_id=0, n_tokens=200_000,
                                  n_shards=2, seed=0, token_dtype="uint16")


TRAIN_BASE = ("train", "tiny", "mesh.fsdp=1", "train.steps=6", "checkpoint.every=2")


@pytest.fixture(scope="session")
def base_run(tmp_path_factory, synth_mix):
    """`olmax train tiny` for 6 steps with a checkpoint every 2, on synth_mix, run in-process: its run
    directory. Shared: copy before changing."""
    from olmax.cli import main

    run = tmp_path_factory.mktemp("base") / "run"
    assert main([*TRAIN_BASE, f"data.mix_file={synth_mix}", f"output_dir={run}"]) == 0
    return run

"""The mesh and layout come from the config: axis sizes, and the rules table placing logical axes on them."""

import re

import jax
import pytest
from jax.sharding import PartitionSpec as P

from olmax.config import ConfigError, load_config
from olmax.model import families
from olmax.parallel.mesh import make_layout


def _layout(*overrides):
    return make_layout(load_config("tiny", list(overrides)).mesh)


def test_batch_spans_data_fsdp_and_expert():
    layout = _layout("mesh.data=2", "mesh.fsdp=2", "mesh.expert=2")
    assert dict(layout.mesh.shape) == {"data": 2, "stage": 1, "fsdp": 2, "expert": 2, "tensor": 1}
    assert layout.data_parallel_size == 8
    assert layout.spec(("batch", "length"), (16, 64)) == P(("data", "fsdp", "expert"), None)
    assert layout.spec(("embed", "mlp"), (64, 192)) == P("fsdp", None)  # params: FSDP only on fsdp


def test_rules_from_config_place_layers_on_stages_and_can_be_partial():
    """Rules given in the config replace those entries of the default table (here: the vocabulary on fsdp, the
    embedding dimension nowhere); the rest stay the defaults (the layers on the stages, the MLP on tensor)."""
    cfg = load_config("tiny", ["model.n_layers=8", "mesh.stage=2", "mesh.fsdp=4", "mesh.rules.vocab=[fsdp]", "mesh.rules.embed=[]"])
    assert cfg.mesh.rules["vocab"] == ["fsdp"] and cfg.mesh.rules["embed"] == []
    assert cfg.mesh.rules["layers"] == ["stage"] and cfg.mesh.rules["mlp"] == ["tensor"]  # the rest: defaults
    layout = make_layout(cfg.mesh)
    shardings = layout.shardings(families.param_axes(cfg.model), families.param_shapes(cfg.model))
    assert shardings["blocks"]["w1"].spec == P("stage", None, None)  # the default puts embed on fsdp
    assert shardings["embed"].spec == P("fsdp", None)  # the default: P(None, "fsdp")
    default = make_layout(load_config("tiny", ["model.n_layers=8", "mesh.stage=2", "mesh.fsdp=4"]).mesh)
    assert default.sharding(("vocab", "embed"), (512, 64)).spec == P(None, "fsdp")


def test_explicit_devices_and_bad_sizes():
    layout = make_layout(load_config("tiny", ["mesh.fsdp=2"]).mesh, devices=jax.devices()[6:])
    assert list(layout.mesh.devices.flat) == jax.devices()[6:8]
    with pytest.raises(ConfigError, match="only 8 devices"):
        _layout("mesh.fsdp=4", "mesh.tensor=4")
    with pytest.raises(ConfigError, match="not mesh axes"):
        load_config("tiny", ["mesh.rules.mlp=[model]"])


def test_a_layout_larger_than_this_cpu_says_how_to_try_it_on_more_cpu_devices():
    """A layout `olmax tune` wrote for 16 devices, refused here: how to get 16 CPU devices was nowhere said."""
    with pytest.raises(ConfigError, match=re.escape("there are only 8 devices; shrink the mesh or set one of "
                                                    "mesh.data/mesh.fsdp to -1; or, to try this layout on this CPU, "
                                                    "give it 16 devices: run with "
                                                    "XLA_FLAGS=--xla_force_host_platform_device_count=16")):
        _layout("mesh.fsdp=4", "mesh.tensor=4")

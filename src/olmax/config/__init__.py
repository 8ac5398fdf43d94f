"""The run config: one typed, validated object that fully describes a run.

A config is a YAML preset (a name under `olmax/configs/` or a path) plus
`key=value` overrides on dotted paths. Unknown keys, wrong types and
inconsistent shapes are errors that name the field and the fix, raised before
anything is compiled or written.

The schema: model.py (the architecture, which a resume checks), impl.py (how it
runs on the devices), run.py (the other sections and RunConfig), on section.py's
base; load.py reads presets, files and overrides into a RunConfig. Their public
names are this package's, where every caller takes them from.
"""

from olmax.config.impl import (REMAT_NAMES, AttentionImplConfig, ImplConfig, MoEImplConfig, PipelineConfig,
                               SplashConfig)
from olmax.config.load import (dump, load_config, preset_path, presets, target_layout, upgrade, validate,
                               writable_dir)
from olmax.config.model import ModelConfig, MoEConfig, RopeConfig
from olmax.config.run import (MESH_AXES, CheckpointConfig, DataConfig, EvalConfig, EvalSetConfig, LaunchConfig,
                              LossConfig, MeshConfig, OptimConfig, RepetitionFilterConfig, RunConfig, ScheduleConfig,
                              SkipStepConfig, SlurmConfig, SourceConfig, StorageConfig, TrainConfig, WandbConfig)
from olmax.errors import ConfigError

__all__ = [
    "REMAT_NAMES", "AttentionImplConfig", "ImplConfig", "MoEImplConfig", "PipelineConfig", "SplashConfig",
    "dump", "load_config", "preset_path", "presets", "target_layout", "upgrade", "validate", "writable_dir",
    "ModelConfig", "MoEConfig", "RopeConfig",
    "MESH_AXES", "CheckpointConfig", "DataConfig", "EvalConfig", "EvalSetConfig", "LaunchConfig", "LossConfig",
    "MeshConfig", "OptimConfig", "RepetitionFilterConfig", "RunConfig", "ScheduleConfig", "SkipStepConfig",
    "SlurmConfig", "SourceConfig", "StorageConfig", "TrainConfig", "WandbConfig",
    "ConfigError",
]

"""The whole run's config: one section per component, each in its own module."""

from __future__ import annotations

from pydantic import Field

from mmyatt.config.algorithm import AlgorithmConfig, OptimConfig
from mmyatt.config.data import DataConfig
from mmyatt.config.engines import DistributedConfig, RolloutConfig, TrainConfig
from mmyatt.config.model import ModelConfig
from mmyatt.config.placement import PlacementConfig
from mmyatt.config.reward import RewardConfig
from mmyatt.config.sampling import SamplingConfig
from mmyatt.config.section import Section, Str
from mmyatt.config.trainer import CheckpointConfig, LoggingConfig, SFTConfig, TrainerConfig


class RunConfig(Section):
    name: Str = "run"
    """the run's name; its directory is runs/<name> unless --run-dir says otherwise"""
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    sft: SFTConfig = Field(default_factory=SFTConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    placement: PlacementConfig = Field(default_factory=PlacementConfig)

"""hcw engine: runs hybrid-attention models on token ids (never text)."""

from engine.config import ConfigError, EngineConfig, ModelConfig
from engine.model.loader import WeightsError, load_model

__all__ = ["ConfigError", "EngineConfig", "ModelConfig", "WeightsError", "load_model"]

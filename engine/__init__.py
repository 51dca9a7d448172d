"""hcw engine: runs hybrid-attention models on token ids (never text)."""

from engine.config import ConfigError, ModelConfig
from engine.engine_config import EngineConfig
from engine.model.loader import WeightsError, load_model

__all__ = ["ConfigError", "EngineConfig", "ModelConfig", "WeightsError", "load_model"]

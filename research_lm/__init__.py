"""research_lm: a small, fast PyTorch research framework for LLM inference systems."""

from research_lm.api.config import EngineConfig
from research_lm.api.llm import LLM
from research_lm.api.outputs import CompletionOutput, RequestOutput
from research_lm.api.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "EngineConfig", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"

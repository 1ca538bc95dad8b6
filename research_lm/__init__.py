"""research_lm: a small, fast PyTorch research framework for LLM inference systems."""

from research_lm.config import EngineConfig
from research_lm.llm import LLM
from research_lm.outputs import CompletionOutput, RequestOutput
from research_lm.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "EngineConfig", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"

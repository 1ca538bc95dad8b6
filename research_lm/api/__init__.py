"""What users hold: `LLM`, `SamplingParams`, `EngineConfig` and the request outputs (re-exported by `research_lm`)."""

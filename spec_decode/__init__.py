"""Speculative-decoding proposers (ngram, draft model, EAGLE, EAGLE-3, Medusa) and draft-head loading: a plugin of
research_lm, which finds them through the "research_lm.proposers" entry point (spec_decode/proposers.py)."""

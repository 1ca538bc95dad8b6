"""Interchangeable attention backends behind one interface (see `base.py`) and one registry."""

from attention_zoo.base import AttentionBackend, AttentionImpl, AttentionSpec, BackendCapabilities
from attention_zoo.layer import Attention, CacheLayer
from attention_zoo.metadata import CommonAttentionMetadata
from attention_zoo.registry import available_backends, get_backend, register_backend, select_backend

__all__ = [
    "Attention",
    "AttentionBackend",
    "AttentionImpl",
    "AttentionSpec",
    "BackendCapabilities",
    "CacheLayer",
    "CommonAttentionMetadata",
    "available_backends",
    "get_backend",
    "register_backend",
    "select_backend",
]

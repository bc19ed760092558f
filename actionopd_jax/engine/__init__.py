"""Continuous-batching rollout engine: decode slots over a paged KV cache, prompts shared by
page, a prefix cache across a trajectory's states, a host scheduler between fixed-shape segments."""

from actionopd_jax.engine.engine import Engine
from actionopd_jax.engine.pages import OutOfPages, PagePool, PrefixIndex, page_keys
from actionopd_jax.engine.requests import EngineStats, Request
from actionopd_jax.engine.sizing import EngineConfig, pool_pages

__all__ = ["Engine", "EngineConfig", "EngineStats", "OutOfPages", "PagePool", "PrefixIndex", "Request", "page_keys",
           "pool_pages"]

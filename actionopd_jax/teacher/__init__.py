"""Teachers: the `Teacher` protocol (base.py), providers (OpenAI-compatible, Vertex AI,
local in-process), transport retries (transport.py), the persistent cache (cache.py) and
the caching, single-flight wrapper (cached.py)."""

from actionopd_jax.teacher.base import MAX_REGENERATIONS, Teacher, TeacherBatch, UsageReport
from actionopd_jax.teacher.cache import PROTOCOL_VERSION, PersistentCache, teacher_cache_key
from actionopd_jax.teacher.cached import CachedTeacher
from actionopd_jax.teacher.transport import PermanentRequestError, RetryPolicy, TransportGaveUp

__all__ = [
    "MAX_REGENERATIONS", "Teacher", "TeacherBatch", "UsageReport", "PROTOCOL_VERSION", "PersistentCache",
    "teacher_cache_key", "CachedTeacher", "PermanentRequestError", "RetryPolicy", "TransportGaveUp",
]

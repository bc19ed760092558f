"""Tool-use environments: BFCL multi-turn, tau2 airline/retail/telecom, the task pipeline,
the context budget and reference policies. See base.py for the `Environment` protocol."""

from loguru import logger as _logger

# tau2 logs every tool response at DEBUG and warns about a missing .env on import; keep
# benchmark internals out of our logs (re-enable with loguru's logger.enable("tau2")).
_logger.disable("tau2")

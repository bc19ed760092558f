"""Tool-use environments: BFCL multi-turn, tau2 airline/retail/telecom, the task pipeline,
the context budget and reference policies. See base.py for the `Environment` protocol."""

# tau2 logs every tool response at DEBUG and warns about a missing .env on import; keep
# benchmark internals out of our logs (re-enable with loguru's logger.enable("tau2")).
try:
    from loguru import logger as _logger
except ModuleNotFoundError:  # then tau2, which logs through loguru, is not installed either (a device host)
    pass
else:
    _logger.disable("tau2")

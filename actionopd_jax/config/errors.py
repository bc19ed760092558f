"""The one error of the config layer. A leaf: any module that refuses a setting raises it
(`raise ConfigError("section.key ...: what to do")`) without importing the config front end."""

from __future__ import annotations


class ConfigError(ValueError):
    """A config file or override is wrong; the message says which key and what to do."""

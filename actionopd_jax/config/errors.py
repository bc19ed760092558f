"""The one error of the config layer. A leaf: any module that refuses a setting raises it
(`raise ConfigError("section.key ...: what to do")`) without importing the config front end.
`ConfigProblems` is the same error naming several problems at once, one numbered line each
(unknown keys, type errors and value errors of one config all come in one list)."""

from __future__ import annotations


class ConfigError(ValueError):
    """A config file or override is wrong; the message says which key and what to do."""


class ConfigProblems(ConfigError):
    """Several problems of one config, each on its own numbered line."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__(f"{len(problems)} problems in the config:\n" +
                         "\n".join(f"  {i}. {p}" for i, p in enumerate(problems, 1)))


def problems_of(error: ConfigError) -> list[str]:
    """The problems one ConfigError names: its list, or its message."""
    return list(error.problems) if isinstance(error, ConfigProblems) else [str(error)]


def raise_all(problems: list[str]) -> None:
    """Nothing when `problems` is empty; a plain ConfigError for one (its message as it always
    read); ConfigProblems naming each for several."""
    if len(problems) == 1:
        raise ConfigError(problems[0])
    if problems:
        raise ConfigProblems(problems)

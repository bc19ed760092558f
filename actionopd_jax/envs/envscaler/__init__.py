"""EnvScaler pools in the published layout: `layout` reads the environment metadata (each
environment's Python class code and tool schemas) and the scenario metadata (initial state,
task, checklist with check functions) into records and Tasks; `check` scores a final state by
the scenario's check functions through a Sandbox. docs/formats.md describes the files."""

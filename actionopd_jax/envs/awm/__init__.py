"""Agent World Model (AWM) pools in the published layout: `layout` reads a directory of
gen_*.jsonl files into scenarios and Tasks, `db` builds each scenario's initial SQLite database
once and hands episodes file copies, `verify` runs a task's verifier (through a Sandbox) on an
episode's initial and final databases. docs/formats.md describes the files."""

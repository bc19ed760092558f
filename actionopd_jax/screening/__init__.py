"""Static feasibility screening of AWM / EnvScaler tasks by an LLM judge (paper B.1): the prompt
and reply format (`prompt.py`), the judge endpoint (`judge.py`), the verdict cache that makes
screening resumable (`cache.py`) and the run over a pool's tasks (`run.py`). The manifest side
(records in, admitted ids out) is `envs/screen_manifest.py`; the command is `actionopd envs screen`."""

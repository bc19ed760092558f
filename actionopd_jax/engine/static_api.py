"""`Sampler.sample` through the engine: the same arguments, keys and result type, so any
caller of the static sampler (eval's model backend, the benchmark) can run the engine."""

from __future__ import annotations

import jax

from actionopd_jax.sampling.sampler import SampleResult, _as_typed_key, _per_prompt


def sample_all(engine, prompts, *, n=1, max_new_tokens, temperature=1.0, top_p=1.0, top_k=0, key) -> SampleResult:
    """Submit every prompt (prompt i's key: key[i], or fold_in(key, i) for one key, as the
    static sampler) and step the engine until all are done."""
    count = len(prompts)
    if count == 0:
        return SampleResult(generations=[])
    if isinstance(key, (list, tuple)):
        if len(key) != count:
            raise ValueError(f"got {len(key)} keys for {count} prompts")
        keys = list(key)
    else:
        base = _as_typed_key(key)
        keys = [jax.random.fold_in(base, i) for i in range(count)]
    per = {name: _per_prompt(v, count, name) for name, v in
           (("n", n), ("max_new_tokens", max_new_tokens), ("temperature", temperature), ("top_p", top_p),
            ("top_k", top_k))}
    st = engine.stats
    before = (engine.compile_count, st.prefill_s, st.decode_s, st.generated_tokens, st.decode_row_steps,
              st.head_fallback_steps)
    reqs = [engine.submit(p, key=keys[i], **{name: per[name][i] for name in per}) for i, p in enumerate(prompts)]
    while any(not r.done for r in reqs):
        engine.step(run_ahead=True)       # nothing is submitted while this loop runs
    return SampleResult(generations=[r.generations for r in reqs], compiled_programs=engine.compile_count - before[0],
                        prefill_s=st.prefill_s - before[1], decode_s=st.decode_s - before[2],
                        generated_tokens=st.generated_tokens - before[3], row_steps=st.decode_row_steps - before[4],
                        head_fallback_steps=st.head_fallback_steps - before[5],
                        decode_steps=max((len(t) for r in reqs for t in r.tokens), default=0))


__all__ = ["sample_all"]

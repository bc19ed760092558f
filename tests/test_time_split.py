"""train/time_split.py: an op's kind from the compiled program's HLO text (collectives by
opcode, the code's name scopes, cuDNN/cuBLAS targets, dots, the rest), and the per-step time
by kind from profiler events (device tracks only where the trace has them; control flow is not
counted, other programs' ops are not counted). The whole path on a real profile of a train
step runs in tests/test_device_check.py (the dry run's first train step)."""

from actionopd_jax.train.time_split import CATEGORIES, category, parse_hlo, split_events

HLO = """HloModule jit_step, is_scheduled=true

%fused_dot (param_0: f32[4,4], param_1: f32[4,4]) -> f32[4,4] {
  %param_0 = f32[4,4]{1,0} parameter(0)
  %param_1 = f32[4,4]{1,0} parameter(1)
  ROOT %dot.1 = f32[4,4]{1,0} dot(%param_0, %param_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_add (param_0.1: f32[4,4]) -> f32[4,4] {
  %param_0.1 = f32[4,4]{1,0} parameter(0)
  ROOT %add.1 = f32[4,4]{1,0} add(%param_0.1, %param_0.1)
}

ENTRY %main.9 (Arg_0.1: f32[4,4], /*index=1*/Arg_1.2: f32[4,4]) -> (f32[4,4], /*index=1*/f32[4,4]) {
  %Arg_0.1 = f32[4,4]{1,0} parameter(0)
  %Arg_1.2 = f32[4,4]{1,0} parameter(1)
  %mlp = f32[4,4]{1,0} fusion(%Arg_0.1, %Arg_1.2), kind=kOutput, calls=%fused_dot, metadata={op_name="jit(step)/mlp/dot_general"}
  %mlp_grad = f32[4,4]{1,0} fusion(%mlp, %Arg_1.2), kind=kOutput, calls=%fused_dot, metadata={op_name="jit(step)/transpose(jvp(mlp))/dot_general"}
  %scores = f32[4,4]{1,0} fusion(%mlp, %mlp), kind=kOutput, calls=%fused_dot, metadata={op_name="jit(step)/while/body/attention/dot_general"}
  %fmha = (f32[4,4], u8[0]{0}) custom-call(%mlp, %mlp), custom_call_target="__cudnn$fmhaSoftmaxBackward", metadata={op_name="jit(step)/x"}
  %head = f32[4,4]{1,0} fusion(%mlp), kind=kLoop, calls=%fused_add, metadata={op_name="jit(step)/transpose(jvp(lm_head))/add"}
  %head_bwd = f32[4,4]{1,0} fusion(%mlp), kind=kLoop, calls=%fused_add, metadata={op_name="jit(step)/lm_head_bwd/add"}
  %adam = f32[4,4]{1,0} fusion(%mlp), kind=kLoop, calls=%fused_add, metadata={op_name="jit(step)/optimizer/mul"}
  %ar = f32[4,4]{1,0} all-reduce-start(%mlp), replica_groups={}, to_apply=%fused_add, metadata={op_name="jit(step)/optimizer/psum"}
  %norm = f32[4,4]{1,0} fusion(%mlp), kind=kLoop, calls=%fused_add, metadata={op_name="jit(step)/rms_norm/mul"}
  %gemm = f32[4,4]{1,0} custom-call(%mlp, %mlp), custom_call_target="__cublas$lt$matmul"
  %loop = (f32[4,4], f32[4,4]) while(%mlp), condition=%fused_add, body=%fused_add
  ROOT %out = (f32[4,4], /*index=1*/f32[4,4]) tuple(%mlp, %norm)
}
"""

WANT = {"mlp": "matmuls forward", "mlp_grad": "matmuls backward", "scores": "attention forward",
        "fmha": "attention backward", "head": "LM head", "head_bwd": "LM head", "adam": "optimizer",
        "ar": "collectives", "norm": "other", "gemm": "matmuls forward", "loop": None, "out": None}


def test_each_instruction_gets_its_kind():
    instrs = parse_hlo(HLO)
    assert instrs["Arg_1.2"]["opcode"] == "parameter" and instrs["fmha"]["opcode"] == "custom-call"
    assert {name: category(instrs[name]) for name in WANT} == WANT


def _event(op, dur_us, pid=2, module="jit_step"):
    return {"ph": "X", "pid": pid, "name": op, "dur": dur_us, "args": {"hlo_op": op, "hlo_module": module}}


def test_device_tracks_are_summed_per_step_by_kind():
    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
            {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/device:GPU:0"}}]
    events = meta + [_event("mlp", 300), _event("mlp", 100), _event("fmha", 500), _event("adam", 200),
                     _event("loop", 5000),                          # control flow: its body's ops are counted
                     _event("mlp", 9000, pid=1),                    # the host's launch, not the kernel
                     _event("mlp", 7000, module="jit_other"),       # another program's op
                     _event("not_in_hlo", 50)]
    out = split_events(events, HLO, steps=2)
    assert list(out["categories"]) == list(CATEGORIES)
    assert out["categories"]["matmuls forward"] == 0.0002 and out["categories"]["attention backward"] == 0.00025
    assert out["categories"]["optimizer"] == 0.0001 and out["ops_s"] == 0.00055
    assert out["tracks"] == "device" and out["unmatched_events"] == 1 and out["scoped_instructions"] == 5
    assert [t["op"] for t in out["top"]] == ["fmha", "mlp", "adam"]


def test_without_device_tracks_the_host_ops_count():
    out = split_events([_event("norm", 1000, pid=7)], HLO)
    assert out["tracks"] == "host" and out["categories"]["other"] == 0.001

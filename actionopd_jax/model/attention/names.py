"""Names shared by the attention kernels and the model's remat policies."""

# checkpoint name of what the attention backward needs (remat policies "attn" / "offload" keep
# it): splash's residuals (output, log-sum-exp), the attention output of the other kernels
ATTENTION_OUT = "attention_out"

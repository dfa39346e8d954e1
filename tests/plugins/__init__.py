"""The plug-ins: FSDP2, HSDP, DDP, Hugging Face Accelerate."""

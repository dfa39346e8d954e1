"""The examples under torchrun across emulated nodes."""

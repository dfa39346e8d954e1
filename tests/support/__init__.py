"""The one support package of the tests, the benchmarks and the examples: the independent
reference (reference.py), gloo ranks (distributed.py), test data (values.py), the CUDA case
list (cuda_cases.py, cuda_emu.py), the small GPT and its language (gpt.py), FSDP2 set-up
(fsdp_training.py), ZeRO helpers and models, checkpoint helpers."""

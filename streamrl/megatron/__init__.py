"""The megatron-core trainer backend: a `GPTModel` built from a Hugging Face Qwen2 / Llama config,
weights converted between the two layouts, tensor parallel through `megatron.core.parallel_state`.
Importing this package imports nothing heavy; `model` and `parallel` import megatron-core."""

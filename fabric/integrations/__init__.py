"""Inference engines that take their weights from the fabric natively.

One subpackage per engine (`vllm`: a backend of vLLM's weight-transfer API). Each is
loaded through the engine's own plugin mechanism or imported by the user; ``import
weightfabric`` loads none of them (`wf.vllm` imports that one on first use).
"""

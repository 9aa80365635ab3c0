"""Expert-parallel communication for decoding (DeepEP's low-latency mode): a dispatch that
quantizes each token to FP8 and writes it straight into its experts' ranks' buffers, in
the masked layout the grouped GEMM reads, and the combine that returns the expert outputs
and sums them per token. Every size is fixed by ``max_tokens``: no host synchronisation,
CUDA-graph capturable. The host side is ``ptxforge.ep.low_latency``."""

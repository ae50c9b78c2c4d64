"""The device side: a Batch to tensors to logits, sampling, CUDA graphs, block tables, threads."""

"""DeepSeek-V4 attention over a sliding window and compressed entries (CSA's top-k, HCA's all):
the Triton kernel on CUDA, the torch reference on CPU or with HCW_KERNELS=reference."""

from kernels.dispatch import use_triton
from kernels.compressed_attention import reference


def attend(q, q_start, keys, key_start, window, entries, rate, selected, sink, scale):
    tensors = [x for x in (q, keys, entries, selected, sink) if x is not None]
    if use_triton(*tensors):
        from kernels.compressed_attention.triton_attend import attend as kernel

        dense = [None if x is None else x.contiguous() for x in (q, keys, entries, selected)]
        return kernel(dense[0], q_start, dense[1], key_start, window, dense[2], rate, dense[3],
                      sink.float().contiguous(), scale)
    return reference.attend(q, q_start, keys, key_start, window, entries, rate, selected, sink, scale)


# a batched decode step's rows, each over its own keys: torch only (on CUDA the rows take `attend`)
attend_rows = reference.attend_rows

__all__ = ["attend", "attend_rows"]

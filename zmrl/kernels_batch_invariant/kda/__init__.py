"""KDA (Kimi Delta Attention) ops: the chunked, batch-invariant forward and float64 references."""
from .chunk import CHUNK_SIZE, kda_chunk, kda_chunk_step
from .decode import KDADecodeCache, kda_decode_prime, kda_decode_step
from .naive import kda_chunk_ref, kda_recurrent_ref

__all__ = ["CHUNK_SIZE", "KDADecodeCache", "kda_chunk", "kda_chunk_step", "kda_decode_prime", "kda_decode_step", "kda_chunk_ref", "kda_recurrent_ref"]

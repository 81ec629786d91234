"""Engine settings (the CLI's and the server's flags). Importing this module does not import torch:
the CLI builds its flags from these defaults, and `minillm --help` should answer at once."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.errors import InvalidRequestError

if TYPE_CHECKING:
    import torch

_DTYPES = ("float32", "bfloat16", "float16")  # --dtype's names: torch dtypes of the same name
# Formats a float checkpoint can be quantized into as it loads (--quantization).
LOAD_TIME_QUANTIZATION = ("fp8",)
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B)?\s*$", re.IGNORECASE)


def parse_bytes(value: str | int) -> int:
    """'2GiB', '512MB', '1e9' or an int → bytes (binary units either way: memory is sized in GiB)."""
    if isinstance(value, int):
        return value
    m = _SIZE.match(value)
    if not m:
        try:
            return int(float(value))
        except ValueError:
            raise InvalidRequestError(f"Not a size in bytes: {value!r}", param="kv_cache_memory") from None
    return int(float(m.group(1)) * 1024 ** " KMGT".index((m.group(2) or " ").upper()))


@dataclass
class EngineConfig:
    model: str = "default"  # "default", a Hugging Face directory, or "random:<shape>"
    tokenizer: str | None = None  # a directory with the tokenizer, if not the model's (random models have none)
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on CPU
    device: str = "auto"  # auto: cuda if available
    weights_seed: int = 0  # seed of the weights of random:<shape> models
    quantization: str | None = None  # "fp8": quantize a float checkpoint's linear weights to FP8 as it loads
    block_size: int = 16
    kv_cache_memory: int | str | None = None  # bytes for KV blocks; None: 1 GiB on CPU, profiled on GPU
    gpu_memory_utilization: float = 0.9  # share of the GPU's memory for weights, activations and KV
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # None: 8192 on a GPU of 70 GiB or more, else 2048 (as vLLM)
    max_model_len: int | None = None  # None: the model's, capped by what the KV budget holds
    enable_prefix_caching: bool = True
    cuda_graphs: bool = True  # capture decode steps on CUDA (off: every step eager, for debugging)
    tensor_parallel_size: int = 1  # devices (processes) each layer is split over: GPUs, or CPU ranks with gloo
    speculative_method: str | None = None  # ngram, suffix or draft: decode steps carry draft tokens (engine/speculative.py)
    speculative_model: str | None = None  # the draft model of --speculative-method draft, named as `model` is
    num_speculative_tokens: int = 4  # most draft tokens a sequence carries in one step
    speculative_max_batch: int | None = None  # running sequences up to which steps draft; None: by device
    speculative_gate: bool = True  # pause drafting beside a batch where it measures slower (speculative.SpeedGate)
    # Launch steps before the step with drafts in flight is read, as if its drafts were all accepted
    # (LLMEngine.step, speculative.Lookahead). Off until measured on a GPU (docs/performance.md).
    speculative_overlap: bool = False

    def torch_device(self) -> torch.device:
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def batched_tokens(self) -> int:
        """--max-num-batched-tokens, or its default for the device: big GPUs prefill faster in big
        chunks; small ones and CPUs keep decodes beside a chunk from stalling (a CPU step of 2048
        tokens takes seconds, which every other request waits out)."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        import torch

        device = self.torch_device()
        big = device.type == "cuda" and torch.cuda.get_device_properties(device).total_memory >= 70 * 2**30
        return 8192 if big else 2048 if device.type == "cuda" else 512

    def check_dtype(self) -> None:
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise InvalidRequestError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {self.dtype!r}")

    def torch_dtype(self) -> torch.dtype:
        import torch

        self.check_dtype()
        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device().type == "cuda" else torch.float32
        return getattr(torch, self.dtype)

"""The decoder's linear layers: float, AWQ int4 and FP8 weights behind one forward and one load().

A layer may be several checkpoint projections merged along its output features (QKV, gate/up);
`load` copies one projection's tensor into the slice [start, start + size) of those features, in
whatever layout its format keeps them. Under tensor parallelism `shard` first cuts a checkpoint
tensor to this rank's output features (column-parallel) or input features (row-parallel).
"""
from __future__ import annotations

import torch
from torch import nn

from engine.errors import ModelLoadError
from engine.models.config import QuantConfig
from kernels.attention_projection import fp8_merge_o_add_norm, int4_merge_o_add_norm, merge_o_add_norm, merges_splits
from kernels.decode_attention import AttentionSplits
from kernels.dispatch import folds_norms, use_triton
from kernels.float_linear import PackedWeight, float_linear, float_linear_add_norm, float_linear_rope_kv, fused_rows
from kernels.fp8_linear import FP8, fp8_linear, fp8_linear_add_norm, fp8_linear_rope_kv, quantize_fp8
from kernels.int4_layout import dequantize_int4, repack_awq
from kernels.int4_linear import int4_linear, int4_linear_add_norm, int4_linear_rope_kv
from kernels.rmsnorm import NormScale, rms_norm
from kernels.rope import RopeKV, rope_store_qkv
from kernels.split_k import few_rows


def _frozen(shape: tuple[int, ...], dtype: torch.dtype) -> nn.Parameter:
    # Parameters (not buffers) so that parameters() counts every weight byte; integer and FP8
    # tensors cannot require grad.
    return nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)


class Projection(nn.Module):
    """What the decoder calls on a linear layer of any format: forward(x, silu_mul=False,
    norm_in=None), where norm_in (a NormScale) means x's rows are still to be normalized by their
    factors, add_norm and rope_store_kv. Where fuses(x) (decode batches of a few rows) the format's
    own kernels take the norm after the projection, or RoPE and the KV write, into their epilogues."""

    def fuses(self, x: torch.Tensor) -> bool:
        """Whether x's rows go through the format's epilogue kernels: on Triton, up to
        kernels/split_k.py's FUSED_ROWS."""
        return use_triton(x) and few_rows(x)

    def add_norm(self, x: torch.Tensor | AttentionSplits, residual: torch.Tensor, norm_weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor, NormScale | None]:
        """self(x), then the residual add and the RMSNorm after it: (normalized, new residual, None);
        or, where fuses(x) and norms fold (kernels/dispatch.py's folds_norms), the format's
        kernel with the norm in its epilogue, the rows left for the next projection to finish
        (kernels/rmsnorm.py's add_norm_ref): (h * norm_weight, h, NormScale). x may be decode
        attention's unmerged splits: merged by the format's kernel where merges(x), else first."""
        if isinstance(x, AttentionSplits):
            if folds_norms(x.part_out) and self.merges(x):
                return self.merged_add_norm(x, residual, norm_weight, eps)
            x = x.merged()
        if folds_norms(x) and self.fuses(x):
            return self.folded_add_norm(x, residual, norm_weight, eps)
        return (*rms_norm(self(x), norm_weight, eps, residual), None)  # self(x): forward hooks see it

    def folded_add_norm(self, x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float
                        ) -> tuple[torch.Tensor, torch.Tensor, NormScale | None]:
        raise NotImplementedError

    def merges(self, splits: AttentionSplits) -> bool:
        """Whether this format's kernel merges decode attention's splits itself (add_norm)."""
        return False

    def merged_add_norm(self, splits: AttentionSplits, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float
                        ) -> tuple[torch.Tensor, torch.Tensor, NormScale | None]:
        raise NotImplementedError

    def rope_store_kv(self, x: torch.Tensor, norm_in: NormScale | None, rope: RopeKV) -> torch.Tensor:
        """This merged QKV projection of x, then RoPE and the KV write (kernels/rope.py): the rotated
        q [tokens, heads, head_dim]; where fuses(x), the format's kernel with both in its epilogue."""
        if self.fuses(x):
            return self.fused_rope_kv(x, norm_in, rope)
        return rope_store_qkv(self(x, norm_in=norm_in), rope)  # self(x): forward hooks see it

    def fused_rope_kv(self, x: torch.Tensor, norm_in: NormScale | None, rope: RopeKV) -> torch.Tensor:
        raise NotImplementedError


class Linear(Projection):
    """y = x W^T + b with W [out_features, in_features] in the model's dtype."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None
        self.packed: PackedWeight | None = None  # CPU verify steps' copy (DecoderModel.pack_weights)

    def forward(self, x: torch.Tensor, silu_mul: bool = False, norm_in: NormScale | None = None) -> torch.Tensor:
        """x W^T + b; with silu_mul (a merged gate/up layer), SiLU(gate) * up over its two halves."""
        return float_linear(x, self.weight, self.bias, silu_mul, norm_in, self.packed)

    def fuses(self, x: torch.Tensor) -> bool:
        return fused_rows(x, self.weight)  # up to kernels/float_linear.py's FLOAT_FUSED_ROWS

    def folded_add_norm(self, x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float
                        ) -> tuple[torch.Tensor, torch.Tensor, NormScale | None]:
        return float_linear_add_norm(x, self.weight, self.bias, residual, norm_weight, eps)

    def merges(self, splits: AttentionSplits) -> bool:
        return merges_splits(splits, self.out_features, self.weight)

    def merged_add_norm(self, splits: AttentionSplits, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float
                        ) -> tuple[torch.Tensor, torch.Tensor, NormScale | None]:
        return merge_o_add_norm(splits, self.weight, self.bias, residual, norm_weight, eps)

    def fused_rope_kv(self, x: torch.Tensor, norm_in: NormScale | None, rope: RopeKV) -> torch.Tensor:
        return float_linear_rope_kv(x, self.weight, self.bias, norm_in, rope)

    def load(self, leaf: str, tensor: torch.Tensor, start: int, size: int) -> None:
        getattr(self, leaf).narrow(0, start, size).copy_(tensor)

    def shard(self, leaf: str, tensor: torch.Tensor, dim: int, first: int, count: int) -> torch.Tensor:
        """This rank's part of a checkpoint tensor: features [first, first + count) of dim 0 (output)
        or 1 (input) of the projection's [out, in] weight. Row-parallel layers have no bias."""
        return tensor.narrow(dim, first, count) if leaf == "weight" or dim == 0 else tensor

    @staticmethod
    def checkpoint_shapes(in_features: int, out_features: int, bias: bool, quant: QuantConfig | None = None
                          ) -> dict[str, tuple[int, ...]]:
        """The tensors (by leaf name) a checkpoint holds for one projection of this format."""
        return {"weight": (out_features, in_features)} | ({"bias": (out_features,)} if bias else {})


class Int4Linear(Projection):
    """4-bit weights (see kernels/int4_linear.py), loaded in AutoAWQ's GEMM layout (qweight [K, N/8],
    qzeros [K/G, N/8], fp16 scales [K/G, N]) and served, after repack(), in the kernels' runtime
    layout: weight int32 [N, K/8], fp16 weight_zeros and weight_scales [N, K/G]. The bias stays in
    the model's dtype."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, group_size: int) -> None:
        super().__init__()
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        self.qweight = _frozen((in_features, out_features // 8), torch.int32)
        self.qzeros = _frozen((in_features // group_size, out_features // 8), torch.int32)
        self.scales = _frozen((in_features // group_size, out_features), torch.float16)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None
        self.weight: nn.Parameter | None = None  # the runtime layout, from repack()
        self.weight_zeros: nn.Parameter | None = None
        self.weight_scales: nn.Parameter | None = None

    def repack(self) -> None:
        """Once every slice is loaded: the AWQ tensors become the runtime layout and are freed (one
        copy of the weights at run time)."""
        weight, zeros, scales = repack_awq(self.qweight, self.qzeros, self.scales)
        del self.qweight, self.qzeros, self.scales
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight_zeros = nn.Parameter(zeros, requires_grad=False)
        self.weight_scales = nn.Parameter(scales, requires_grad=False)

    def dequantize(self) -> torch.Tensor:
        """W [N, K] in float16 (for tests and tools), from the runtime layout."""
        return dequantize_int4(self._runtime_weight(), self.weight_zeros, self.weight_scales, self.group_size)

    def forward(self, x: torch.Tensor, silu_mul: bool = False, norm_in: NormScale | None = None) -> torch.Tensor:
        return int4_linear(x, self._runtime_weight(), self.weight_zeros, self.weight_scales, self.group_size, self.bias,
                           silu_mul, norm_in)

    def folded_add_norm(self, x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float
                        ) -> tuple[torch.Tensor, torch.Tensor, NormScale | None]:
        return int4_linear_add_norm(x, self._runtime_weight(), self.weight_zeros, self.weight_scales, self.group_size,
                                    self.bias, residual, norm_weight, eps)

    def merges(self, splits: AttentionSplits) -> bool:
        return merges_splits(splits, self.out_features, self._runtime_weight())

    def merged_add_norm(self, splits: AttentionSplits, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float
                        ) -> tuple[torch.Tensor, torch.Tensor, NormScale | None]:
        return int4_merge_o_add_norm(splits, self._runtime_weight(), self.weight_zeros, self.weight_scales,
                                     self.group_size, self.bias, residual, norm_weight, eps)

    def fused_rope_kv(self, x: torch.Tensor, norm_in: NormScale | None, rope: RopeKV) -> torch.Tensor:
        return int4_linear_rope_kv(x, self._runtime_weight(), self.weight_zeros, self.weight_scales, self.group_size,
                                   self.bias, norm_in, rope)

    def _runtime_weight(self) -> nn.Parameter:
        if self.weight is None:
            raise RuntimeError("Int4Linear is still in AWQ's checkpoint layout: call repack() once it is loaded.")
        return self.weight

    def load(self, leaf: str, tensor: torch.Tensor, start: int, size: int) -> None:
        if leaf in ("qweight", "qzeros"):  # eight output features per int32: the slice is in packs
            if tensor.dtype != torch.int32:
                raise ModelLoadError(f"AWQ {leaf} must be int32, got {tensor.dtype}.")
            getattr(self, leaf).narrow(1, start // 8, size // 8).copy_(tensor)
        elif leaf == "scales":
            self.scales.narrow(1, start, size).copy_(tensor)
        else:
            self.bias.narrow(0, start, size).copy_(tensor)

    def shard(self, leaf: str, tensor: torch.Tensor, dim: int, first: int, count: int) -> torch.Tensor:
        # qweight [K, N/8], qzeros [K/G, N/8], scales [K/G, N]: input features are rows (in groups
        # for zeros and scales), output features columns (in packs of 8 for the int32 tensors).
        if leaf == "bias":
            return tensor.narrow(0, first, count) if dim == 0 else tensor
        if dim == 0:
            pack = 8 if leaf in ("qweight", "qzeros") else 1
            return tensor.narrow(1, first // pack, count // pack)
        group = 1 if leaf == "qweight" else self.group_size
        return tensor.narrow(0, first // group, count // group)

    @staticmethod
    def checkpoint_shapes(in_features: int, out_features: int, bias: bool, quant: QuantConfig | None = None
                          ) -> dict[str, tuple[int, ...]]:
        groups = in_features // quant.group_size
        shapes = {"qweight": (in_features, out_features // 8), "qzeros": (groups, out_features // 8),
                  "scales": (groups, out_features)}
        return shapes | ({"bias": (out_features,)} if bias else {})


class Fp8Linear(Projection):
    """float8_e4m3fn weights [N, K] with a float32 scale per output feature. A float checkpoint's
    weights are quantized per output feature as they load (--quantization fp8); an FP8 checkpoint's
    per-tensor scale becomes the scale of each of its rows."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = _frozen((out_features, in_features), FP8)
        self.weight_scale = _frozen((out_features,), torch.float32)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None

    def forward(self, x: torch.Tensor, silu_mul: bool = False, norm_in: NormScale | None = None) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.weight_scale, self.bias, silu_mul, norm_in)

    def folded_add_norm(self, x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float
                        ) -> tuple[torch.Tensor, torch.Tensor, NormScale | None]:
        return fp8_linear_add_norm(x, self.weight, self.weight_scale, self.bias, residual, norm_weight, eps)

    def merges(self, splits: AttentionSplits) -> bool:
        return merges_splits(splits, self.out_features, self.weight)

    def merged_add_norm(self, splits: AttentionSplits, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float
                        ) -> tuple[torch.Tensor, torch.Tensor, NormScale | None]:
        return fp8_merge_o_add_norm(splits, self.weight, self.weight_scale, self.bias, residual, norm_weight, eps)

    def fused_rope_kv(self, x: torch.Tensor, norm_in: NormScale | None, rope: RopeKV) -> torch.Tensor:
        return fp8_linear_rope_kv(x, self.weight, self.weight_scale, self.bias, norm_in, rope)

    def load(self, leaf: str, tensor: torch.Tensor, start: int, size: int) -> None:
        if leaf == "weight" and tensor.dtype != FP8:  # a float checkpoint, quantized as it loads
            tensor, scale = quantize_fp8(tensor.to(self.weight.device))
            self.weight_scale.narrow(0, start, size).copy_(scale)
        elif leaf == "weight_scale":
            tensor = tensor.float().reshape(-1).expand(size)  # per-tensor: the same for each of its rows
        getattr(self, leaf).narrow(0, start, size).copy_(tensor)

    def shard(self, leaf: str, tensor: torch.Tensor, dim: int, first: int, count: int) -> torch.Tensor:
        if leaf == "weight":
            return tensor.narrow(dim, first, count)
        if dim == 1 or tensor.numel() == 1:  # scales and bias are per output feature, or per tensor
            return tensor
        return tensor.reshape(-1).narrow(0, first, count)

    @staticmethod
    def checkpoint_shapes(in_features: int, out_features: int, bias: bool, quant: QuantConfig | None = None
                          ) -> dict[str, tuple[int, ...]]:
        # weight_scale may also come as one value per tensor, or [N, 1]; the loader accepts those.
        return {"weight": (out_features, in_features), "weight_scale": (out_features,)} | (
            {"bias": (out_features,)} if bias else {})


def linear_class(quant: QuantConfig | None) -> type[Linear] | type[Int4Linear] | type[Fp8Linear]:
    return {None: Linear, "awq": Int4Linear, "fp8": Fp8Linear}[quant.method if quant else None]


def make_linear(in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                quant: QuantConfig | None) -> Projection:
    """The linear layer for a format: float when `quant` is None."""
    if quant is None:
        return Linear(in_features, out_features, bias, dtype)
    if quant.method == "awq":
        return Int4Linear(in_features, out_features, bias, dtype, quant.group_size)
    return Fp8Linear(in_features, out_features, bias, dtype)

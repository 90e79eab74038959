"""The CPU kernels of cpu_kernels.c (fp32, and bf16 decode): built once per machine, loaded with ctypes,
torch otherwise.

Why a compiled kernel at all (issue 12, measured on a 2-core AMD EPYC without AVX-512): torch's fp32
`linear` at 1-16 rows read the weights at about half the memory bandwidth (the 49,152-row output
matrix at ~7 GB/s for one row), and no pure-torch decode attention avoided copying each sequence's
blocks out of the pool at every layer. The C file is small, has no dependency beyond the system's
gcc, and compiles in about a second, so it is built on first use into the build cache under a key
of its source, the compiler and this CPU's flags (-march=native), and shared by every process.

In fp32 every linear layer is re-laid for gemm_packed (prefill too). In bf16 (issue 25) the weights
keep torch's layout, and where the CPU has bf16 dot products a copy packed for them (pack_vnni);
FusedDecode and the logits read the bf16 weights through gemm_bf16_vnni (or gemv_bf16) and a bf16
K/V pool, with fp32 activations (each matmul's input rounded to bf16 where the CPU's bf16 dot
products serve, as torch's would round it). In both dtypes a prompt's rows go through FusedDecode
too, each as a decode row whose context ends at its own token (llama.LlamaModel.row_wise_prefill):
one function computes every token, whatever its step holds (batch invariance). In bf16 that needs
the CPU's bf16 dot products; without them prompts stay on torch's bf16 matmuls. The weights the
kernels read are placed in one region, in the order a step reads them, on huge pages where the kernel
gives them (streamed_memory), and so is a colocated engine's KV pool (engine/runner.py).

When anything is missing (no gcc, no AVX2/FMA, a failed build, a model shape the kernels don't cover,
fp16, a GPU) the engine runs the torch paths of kvhandoff.model.llama, which stay the reference the
tests compare against; `status()` says which and why.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import mmap
import os
import platform
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from kvhandoff.model import paired_kv
from kvhandoff.model.build_cache import cached_build

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.c")
COMPILE = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-c"]
PANEL = 16                              # output columns per packed panel (PANEL in cpu_kernels.c)
DISABLE_ENV = "KVHANDOFF_CPU_KERNELS"   # "0": never use them (A/B against the torch paths)

_P, _L = ctypes.c_void_p, ctypes.c_long
_SIGNATURES = {
    "gemm_packed": [_P, _L, _L, _L, _P, _L, _P, _L, ctypes.c_int],
    "gemv_bf16": [_P, _L, _L, _L, _P, _L, _L, _P, _L, ctypes.c_int],
    "gemv_bf16_native_for": [_L],
    "gemm_bf16_vnni": [_P, _L, _L, _L, _P, _L, _P, _L, ctypes.c_int],     # (_OPTIONAL)
    "pack_bf16_vnni": [_P, _L, _L, _L, _P],
    "bf16_vnni_elements": [_L, _L],
    "paged_attention": [_P, _P, _L, _L, _L, _L, _P, _P, _L, _L, _L, _P, _L, _P, _P, ctypes.c_int],
    "paged_attention_supports": [_L, _L, _L],
    "rms_norm": [_P, _P, _L, _L, _L, _L, _P, ctypes.c_float, _P],
    "rope_store_kv": [_P, _L, _L, _L, _L, _L, _P, _P, _P, _P, _L, _L, _P, _P],
    "decode_layer": [_P, _P, _P, _P],
    "embed_rows": [_P, _L, _L, _L, _P, _L, _P],
    "argmax_rows": [_P, _L, _L, _L, _P],
    "core_handoff_ns": [_L],
}
_OPTIONAL = {"gemm_bf16_vnni"}           # built only where the CPU has bf16 dot products


class _Packed(ctypes.Structure):                # struct packed
    _fields_ = [("panels", _P), ("rows", _P), ("cols", _L), ("n", _L), ("bias", _P), ("vnni", _P)]


class _LayerWeights(ctypes.Structure):          # struct decode_layer_weights
    _fields_ = [("norm1", _P), ("norm2", _P), ("eps1", ctypes.c_float), ("eps2", ctypes.c_float),
                ("qkv", _Packed), ("o", _Packed), ("gate_up", _Packed), ("down", _Packed),
                ("hidden", _L), ("heads", _L), ("kv_heads", _L), ("head_dim", _L), ("intermediate", _L),
                ("k_base", _P), ("v_base", _P), ("kv_item", _L), ("block_stride", _L), ("block_size", _L),
                ("next_k_base", _P), ("layer_index", _L)]


class _Batch(ctypes.Structure):                 # struct decode_batch
    _fields_ = [("rows", _L), ("cos", _P), ("sin", _P), ("table_rows", _L), ("positions", _P), ("slot_block", _P),
                ("slot_offset", _P), ("block_tables", _P), ("max_blocks", _L), ("lens", _P), ("scale", ctypes.c_float),
                ("num_threads", ctypes.c_int)]


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (/proc/cpuinfo), empty where they cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            return frozenset(next((line for line in f if line.startswith("flags")), "").split()[2:])
    except OSError:
        return frozenset()


def _compile(folder: Path) -> None:
    obj, lib = folder / "cpu_kernels.o", folder / "cpu_kernels.so"
    # Compile and link apart: linking with the math-relaxing flags some gccs add for -O3 builds could
    # pull in crtfastmath.o, which would flush denormals for the whole process (torch included).
    for cmd in (["gcc", *COMPILE, str(SOURCE), "-o", str(obj)], ["gcc", "-shared", "-fopenmp", str(obj), "-o", str(lib)]):
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd[:2])} failed: {done.stderr.strip()[-400:]}")


@functools.cache
def _load() -> tuple[ctypes.CDLL | None, str]:
    """(library, how it stands): the library is None when the torch paths must serve."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return None, f"off ({DISABLE_ENV}=0)"
    if platform.machine() not in ("x86_64", "AMD64"):
        return None, f"off (no kernels for {platform.machine()})"
    gcc = shutil.which("gcc")
    if gcc is None:
        return None, "off (no gcc to build them)"
    try:
        version = subprocess.run([gcc, "--version"], capture_output=True, text=True, timeout=30).stdout
        key = hashlib.sha256(SOURCE.read_bytes() + " ".join(COMPILE).encode() + version.encode()
                             + " ".join(sorted(cpu_flags())).encode()).hexdigest()[:12]
        folder = cached_build(f"cpu-kernels-{key}", _compile)
        lib = ctypes.CDLL(str(folder / "cpu_kernels.so"))
    except (OSError, RuntimeError, subprocess.SubprocessError) as err:
        log.warning("CPU kernels unavailable, using torch's paths: %s", err)
        return None, f"off (build failed: {str(err)[:200]})"
    for name, argtypes in _SIGNATURES.items():
        if name not in _OPTIONAL or hasattr(lib, name):
            getattr(lib, name).argtypes = argtypes
    lib.bf16_vnni_elements.restype = lib.decode_layer.restype = lib.embed_rows.restype = _L
    lib.core_handoff_ns.restype = ctypes.c_double
    return lib, "on (gcc -march=native)"


def status() -> str:
    return _load()[1]


def available() -> bool:
    return _load()[0] is not None


def _threads() -> int:
    # Passed on every call: OpenMP's thread count is per calling thread (the engine's forward pass runs
    # on EngineLoop's thread, which sets its own).
    return torch.get_num_threads()


class PackedLinear(nn.Module):
    """A bias-optional nn.Linear whose weight is re-laid as [N/16, K, 16] panels for gemm_packed.
    N is padded to the panel width; the padding columns are computed and dropped."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        assert weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.dim() == 2
        self.out_features, self.in_features = weight.shape
        pad = -self.out_features % PANEL
        if pad:
            weight = torch.cat([weight, weight.new_zeros(pad, self.in_features)])
        self.register_buffer("panels", weight.reshape(-1, PANEL, self.in_features).transpose(1, 2).contiguous())
        self.bias = bias

    @classmethod
    def of(cls, linear: nn.Linear) -> PackedLinear:
        return cls(linear.weight.detach(), None if linear.bias is None else linear.bias.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lib = _load()[0]
        lead, K = x.shape[:-1], self.in_features
        x = x.reshape(-1, K)
        if x.stride(-1) != 1 or x.dtype != torch.float32:
            x = x.contiguous().float()
        padded = self.panels.shape[0] * PANEL
        y = torch.empty(x.shape[0], padded, dtype=torch.float32)
        lib.gemm_packed(x.data_ptr(), x.shape[0], K, x.stride(0), self.panels.data_ptr(), padded,
                        y.data_ptr(), padded, _threads())
        if padded != self.out_features:
            y = y[:, :self.out_features]
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the weight (a tied embedding looked up from the packed copy: one copy of it)."""
        return self.panels[ids // PANEL, :, ids % PANEL]


def place_together(linears: list[PackedLinear]) -> None:
    """Move the packed weights of `linears` into one region (streamed_memory), one after another in the
    order given (the order a step reads them), as pack_vnni_together does for bf16. SmolLM2 in fp32,
    one thread, two engines alternated step by step in one process: single-stream steps 9-12% faster,
    16 sequences 8%."""
    sizes = [linear.panels.numel() for linear in linears]
    region = streamed_memory(sum(sizes), torch.float32)
    for linear, part in zip(linears, region.split(sizes)):
        linear.panels = part.view(linear.panels.shape).copy_(linear.panels)


def bf16_supported(hidden: int, q_size: int, intermediate: int) -> bool:
    """gemv_bf16 reads 8 values of k at a time: every linear's input width must be a multiple of 8."""
    return hidden % 8 == 0 and q_size % 8 == 0 and intermediate % 8 == 0


def native_bf16(in_features: int) -> bool:
    """Do bf16 linears of this input width use the CPU's bf16 dot products (AVX512-BF16, on weights
    packed by pack_vnni)? Then x is rounded to bf16 first, as torch's bf16 matmuls do; otherwise
    gemv_bf16 widens the weights (torch's layout) to fp32."""
    return bool(_load()[0].gemv_bf16_native_for(in_features))


HUGE_PAGE = 2 << 20


def streamed_memory(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed 1-D tensor on anonymous memory the kernel is asked to back with 2 MiB pages (madvise
    MADV_HUGEPAGE: in THP's common 'madvise' mode nothing is huge unless asked), for what each step
    streams through: with 4 KiB pages every 4 KiB read of weights or K/V may cost a TLB miss and
    ends the hardware prefetcher's run. Where the kernel has no THP it is plain memory, and either
    way its pages come on first touch (a KV pool populates its own: engine/runner.py)."""
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError):       # no transparent huge pages here: 4 KiB pages, as before
        pass
    raw = np.frombuffer(region, dtype=np.uint8)
    start = -raw.ctypes.data % HUGE_PAGE
    return torch.from_numpy(raw[start:start + nbytes]).view(dtype)


def pack_vnni(weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """A bf16 weight [N, K] re-laid for gemm_bf16_vnni: panels of 16 outputs, each [K/2][16][2] (a copy:
    torch's layout stays for the paths that read it), into `out` if given."""
    lib = _load()[0]
    assert weight.dtype == torch.bfloat16 and weight.dim() == 2 and weight.stride(1) == 1 and weight.shape[1] % 2 == 0
    numel = lib.bf16_vnni_elements(*weight.shape)
    out = torch.empty(numel, dtype=torch.bfloat16) if out is None else out
    assert out.dtype == torch.bfloat16 and out.is_contiguous() and out.numel() == numel
    lib.pack_bf16_vnni(weight.data_ptr(), weight.shape[0], weight.shape[1], weight.stride(0), out.data_ptr())
    return out


def interleave_panels(gate_up: torch.Tensor) -> torch.Tensor:
    """An MLP's [gate; up] weight [2I, K] with its rows reordered by panels of 16: gate's first 16,
    up's first 16, gate's next 16, ... (a copy; I % 16 == 0)."""
    rows, width = gate_up.shape
    assert rows % (2 * PANEL) == 0
    return gate_up.view(2, rows // (2 * PANEL), PANEL, width).transpose(0, 1).reshape(rows, width)


def pack_vnni_together(weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """pack_vnni of each, one after another in one region (streamed_memory), in the order given: the
    order a step reads them, so that a step streams its weights from one end to the other. SmolLM2,
    one thread, alternated step by step in one process against separate allocations: single-stream
    steps 3-4% faster, 16 sequences 4-11%."""
    lib = _load()[0]
    sizes = [lib.bf16_vnni_elements(*w.shape) for w in weights]
    region = streamed_memory(sum(sizes), torch.bfloat16)
    return [pack_vnni(w, part) for w, part in zip(weights, region.split(sizes))]


def linear_bf16(x: torch.Tensor, weight: torch.Tensor, vnni: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (fp32) @ weight^T, weight bf16 [N, K] in torch's layout: fp32 [M, N] (the logits of
    decode rows, read from the bf16 head as the layers read theirs). With bf16 dot products the
    product is gemm_bf16_vnni's, on `vnni` (pack_vnni(weight); packed here if not given)."""
    lib = _load()[0]
    assert weight.dtype == torch.bfloat16 and weight.is_contiguous() and x.shape[-1] == weight.shape[1]
    if x.dtype != torch.float32 or not x.is_contiguous():
        x = x.float().contiguous()
    y = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)
    if native_bf16(weight.shape[1]):
        vnni = pack_vnni(weight) if vnni is None else vnni
        lib.gemm_bf16_vnni(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), vnni.data_ptr(), weight.shape[0],
                           y.data_ptr(), y.stride(0), _threads())
    else:
        lib.gemv_bf16(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), weight.data_ptr(), weight.shape[0],
                      weight.stride(0), y.data_ptr(), y.stride(0), _threads())
    return y


@functools.cache
def attention_supported(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> bool:
    lib = _load()[0]
    return (lib is not None and num_heads % num_kv_heads == 0
            and bool(lib.paged_attention_supports(num_heads // num_kv_heads, head_dim, block_size)))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    row_seq: torch.Tensor | None, row_len: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of q [rows, heads, D] (fp32) over the blocks of one layer's K/V (fp32, or bf16 in the
    paired layout of paired_kv), read in place; fp32 out. (The bf16 pool is read this way only inside
    FusedDecode; this entry serves tests.)

    k_cache, v_cache: one layer's views [num_blocks, kv_heads, block_size, D] of the layer-major pool
    (a block's stride spans its K and V); block_tables: int64 [seqs, max_blocks]; row r attends to the
    first row_len[r] tokens of sequence row_seq[r] (of sequence r when row_seq is None)."""
    lib = _load()[0]
    rows, heads, D = q.shape
    _, kv_heads, block_size, _ = k_cache.shape
    assert k_cache.stride()[1:] == (block_size * D, D, 1) and v_cache.stride() == k_cache.stride()
    assert block_tables.dtype == row_len.dtype == torch.int64 and block_tables.is_contiguous()
    assert row_seq is None or row_seq.dtype == torch.int64
    q, row_len = (q * scale).contiguous(), row_len.contiguous()      # held across the call
    row_seq = None if row_seq is None else row_seq.contiguous()
    out = torch.empty_like(q)
    assert k_cache.dtype == v_cache.dtype and k_cache.dtype in (torch.float32, torch.bfloat16)
    paired_kv.check_block_size(k_cache.dtype, block_size)
    lib.paged_attention(q.data_ptr(), out.data_ptr(), rows, heads, kv_heads, D, k_cache.data_ptr(), v_cache.data_ptr(),
                        k_cache.element_size(), k_cache.stride(0), block_size, block_tables.data_ptr(), block_tables.shape[1],
                        None if row_seq is None else row_seq.data_ptr(), row_len.data_ptr(), _threads())
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, delta: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of the rows of x [T, dim] (fp32). With `delta`, x += delta first, in place (the
    residual add before the norm), so the caller's x holds the sum afterwards."""
    lib = _load()[0]
    rows, dim = x.shape
    assert x.stride(1) == 1 and weight.is_contiguous() and (delta is None or delta.stride(1) == 1)
    out = torch.empty(rows, dim, dtype=torch.float32)
    lib.rms_norm(x.data_ptr(), None if delta is None else delta.data_ptr(), rows, dim, x.stride(0),
                 0 if delta is None else delta.stride(0), weight.data_ptr(), eps, out.data_ptr())
    return out


def rope_store_kv(qkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int, rope: tuple[torch.Tensor, torch.Tensor],
                  k_cache: torch.Tensor, v_cache: torch.Tensor, slot_block: torch.Tensor, slot_offset: torch.Tensor) -> None:
    """Rotate q and k of qkv [T, (heads + 2 kv_heads) * D] in place (rope: the rows' cos, sin, each
    [T, 1, D/2]) and store K and V at (slot_block, slot_offset) of one layer's pool views."""
    lib = _load()[0]
    cos, sin = (t.contiguous() for t in rope)
    assert cos.dtype == sin.dtype == qkv.dtype == torch.float32
    _, _, block_size, _ = k_cache.shape
    assert qkv.stride(1) == 1 and qkv.shape[1] == (heads + 2 * kv_heads) * head_dim
    assert slot_block.dtype == slot_offset.dtype == torch.int64 and slot_block.is_contiguous() and slot_offset.is_contiguous()
    assert k_cache.stride()[1:] == (block_size * head_dim, head_dim, 1) and v_cache.stride() == k_cache.stride()
    lib.rope_store_kv(qkv.data_ptr(), qkv.shape[0], qkv.stride(0), heads, kv_heads, head_dim, cos.data_ptr(),
                      sin.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0), block_size,
                      slot_block.data_ptr(), slot_offset.data_ptr())


@dataclass
class DecoderWeights:
    """What decode_layer needs of one decoder layer: the model's own linears (fp32 PackedLinear, or
    nn.Linear with a bf16 weight, read in place) and its norms' weights in fp32 (a copy if bf16)."""
    norm1: torch.Tensor
    eps1: float
    norm2: torch.Tensor
    eps2: float
    qkv: PackedLinear | nn.Linear
    o: PackedLinear | nn.Linear
    gate_up: PackedLinear | nn.Linear
    down: PackedLinear | nn.Linear

    def __post_init__(self):
        self.norm1, self.norm2 = self.norm1.float().contiguous(), self.norm2.float().contiguous()


class FusedDecode:
    """A decode-only step's layers through decode_layer of cpu_kernels.c: one C call per layer
    instead of about twenty torch operations (norms, matmuls, RoPE and K/V store, attention, SiLU,
    residual adds), then the model's final norm. Rows are decoding sequences, one new token each.

    Why so few torch operations around it: a step streams the weights (~270 MB in bf16 for SmolLM2)
    through every cache level, so each distinct torch operation after it runs from cold caches: in a
    single-stream step the Python and torch around the kernels took 0.8 ms against 0.18 ms warm.
    RoPE's angles are therefore looked up by position in C, and the final norm is C's too."""

    def __init__(self, layers: list[DecoderWeights], heads: int, kv_heads: int, head_dim: int, scale: float,
                 rope: tuple[torch.Tensor, torch.Tensor], final_norm: tuple[torch.Tensor, float]):
        """rope: cos and sin of every position, each [positions, head_dim / 2] (fp32); final_norm: the
        model's last RMSNorm (weight, eps)."""
        self.layers, self.heads, self.kv_heads, self.head_dim, self.scale = layers, heads, kv_heads, head_dim, scale
        first = layers[0]
        self.hidden, self.intermediate = first.qkv.in_features, first.down.in_features
        self.cos, self.sin = (t.float().contiguous() for t in rope)
        assert self.cos.shape == self.sin.shape and self.cos.shape[1] == head_dim // 2
        self.norm_weight, self.norm_eps = final_norm[0].detach().float().contiguous(), final_norm[1]
        self.biases: list[torch.Tensor] = []          # fp32 copies the structs point at
        # bf16 weights packed for gemm_bf16_vnni (by id of their nn.Linear), once, at load, in one region;
        # gate_up with its gate and up panels interleaved (decode_layer computes SiLU pair by pair), so
        # only where the intermediate width is whole panels and there is no bias (added in torch's order)
        assert first.gate_up.out_features == 2 * self.intermediate and first.o.in_features == heads * head_dim
        gate_ups = {id(layer.gate_up) for layer in layers if layer.gate_up.bias is None} \
            if self.intermediate % PANEL == 0 else set()
        native = [linear for layer in layers for linear in (layer.qkv, layer.o, layer.gate_up, layer.down)
                  if not isinstance(linear, PackedLinear) and linear.weight.dtype == torch.bfloat16
                  and native_bf16(linear.in_features) and (linear is not layer.gate_up or id(linear) in gate_ups)]
        weights = [interleave_panels(linear.weight.detach()) if id(linear) in gate_ups else linear.weight.detach()
                   for linear in native]
        self.vnni = dict(zip(map(id, native), pack_vnni_together(weights)))
        assert first.qkv.out_features == (heads + 2 * kv_heads) * head_dim
        self._structs: list[_LayerWeights] = []
        self._pool = None               # the pool the structs point into (data_ptr, shape)

    def _weights_for(self, kv_cache: torch.Tensor) -> list[_LayerWeights]:
        """The layers' C structs, pointing into `kv_cache` ([layers, blocks, 2, kv_heads, block, D])."""
        pool = (kv_cache.data_ptr(), tuple(kv_cache.shape), tuple(kv_cache.stride()))
        if pool == self._pool:
            return self._structs
        assert kv_cache.dtype in (torch.float32, torch.bfloat16)
        assert kv_cache.stride()[2:] == kv_cache[0, 0].contiguous().stride()
        block_size, item = kv_cache.shape[4], kv_cache.element_size()

        def packed(linear: PackedLinear | nn.Linear) -> _Packed:
            bias = None if linear.bias is None else linear.bias.detach().float().contiguous()
            if bias is not None:
                self.biases.append(bias)                # the struct points at this tensor: keep it alive
            if isinstance(linear, PackedLinear):
                return _Packed(linear.panels.data_ptr(), None, linear.panels.shape[0] * PANEL, linear.out_features,
                               None if bias is None else bias.data_ptr())
            weight = linear.weight
            assert weight.dtype == torch.bfloat16 and weight.is_contiguous()
            vnni = self.vnni.get(id(linear))
            return _Packed(None, weight.data_ptr(), linear.out_features, linear.out_features,
                           None if bias is None else bias.data_ptr(), None if vnni is None else vnni.data_ptr())

        structs, self.biases = [], []
        for index, w in enumerate(self.layers):
            k_base = kv_cache.data_ptr() + index * kv_cache.stride(0) * item
            next_k_base = k_base + kv_cache.stride(0) * item if index + 1 < len(self.layers) else None
            structs.append(_LayerWeights(
                w.norm1.data_ptr(), w.norm2.data_ptr(), w.eps1, w.eps2, packed(w.qkv), packed(w.o),
                packed(w.gate_up), packed(w.down), self.hidden, self.heads, self.kv_heads, self.head_dim,
                self.intermediate, k_base, k_base + kv_cache.stride(2) * item, item, kv_cache.stride(1), block_size,
                next_k_base, index))
        self._structs, self._pool = structs, pool
        return structs

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, slot_block: torch.Tensor, slot_offset: torch.Tensor,
                 block_ids: torch.Tensor, lens: torch.Tensor, kv_cache: torch.Tensor, on_layer=None) -> torch.Tensor:
        """x [rows, hidden] (fp32) through every layer (in place) and the final norm (returned, a new
        tensor). positions: each row's (int64); block_ids: the rows' block tables, flat
        [rows * max_blocks]; lens: tokens each row attends to, its own included."""
        lib = _load()[0]
        rows = x.shape[0]
        assert x.dtype == torch.float32 and x.is_contiguous()
        assert positions.dtype == lens.dtype == block_ids.dtype == torch.int64
        held = [t.contiguous() for t in (positions, slot_block, slot_offset, block_ids, lens)]   # alive across the calls
        batch = _Batch(rows, self.cos.data_ptr(), self.sin.data_ptr(), self.cos.shape[0], held[0].data_ptr(),
                       held[1].data_ptr(), held[2].data_ptr(), held[3].data_ptr(), block_ids.numel() // rows,
                       held[4].data_ptr(), self.scale, _threads())
        structs = self._weights_for(kv_cache)
        first = structs[0]
        width = (self.hidden + first.qkv.cols + self.heads * self.head_dim + first.o.cols + first.gate_up.cols
                 + self.intermediate + first.down.cols)
        scratch = torch.empty(rows * width, dtype=torch.float32)
        batch_ref, scratch_ptr, x_ptr = ctypes.byref(batch), scratch.data_ptr(), x.data_ptr()
        for index, weights in enumerate(structs):
            bad_row = lib.decode_layer(ctypes.byref(weights), batch_ref, x_ptr, scratch_ptr)
            if bad_row:
                raise IndexError(f"position {int(held[0][bad_row - 1])} is beyond RoPE's table of {self.cos.shape[0]}")
            if on_layer is not None:
                on_layer(index)
        out = scratch[:rows * self.hidden].view(rows, self.hidden)      # (the scratch's first part, free now)
        lib.rms_norm(x_ptr, None, rows, self.hidden, self.hidden, 0, self.norm_weight.data_ptr(), self.norm_eps,
                     out.data_ptr())
        return out


def embed_rows(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` (int64) of an embedding table [vocab, hidden] (bf16 or fp32) in fp32, in one C call
    (a decode step's torch operations run from cold caches: see FusedDecode)."""
    lib = _load()[0]
    assert table.dtype in (torch.bfloat16, torch.float32) and table.is_contiguous() and ids.dtype == torch.int64
    ids = ids.contiguous()
    out = torch.empty(ids.numel(), table.shape[1], dtype=torch.float32)
    bad_row = lib.embed_rows(table.data_ptr(), table.element_size(), table.shape[0], table.shape[1], ids.data_ptr(),
                             ids.numel(), out.data_ptr())
    if bad_row:
        raise IndexError(f"token id {int(ids[bad_row - 1])} is out of range for a vocabulary of {table.shape[0]}")
    return out


def argmax_rows(x: torch.Tensor) -> list[int]:
    """The index of each row's maximum of x [rows, n] (fp32, CPU), as torch's and numpy's argmax give
    it (the first; a NaN counts as the maximum), in one C call: a decode step's sampling runs from
    cold caches (see FusedDecode), where numpy's argmax of one SmolLM2 row took ~55 us against 5 warm."""
    lib = _load()[0]
    assert x.dtype == torch.float32 and x.dim() == 2 and x.stride(1) == 1 and x.is_cpu
    out = torch.empty(x.shape[0], dtype=torch.int64)
    lib.argmax_rows(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out.data_ptr())
    return out.tolist()


def core_handoff_ns(handoffs: int = 2000) -> float | None:
    """How long a cache line takes from one of two threads to the other, ns one way (see
    core_handoff_ns in cpu_kernels.c); None without the kernels or a second core."""
    lib = _load()[0]
    if lib is None or (os.cpu_count() or 1) < 2:
        return None
    ns = lib.core_handoff_ns(handoffs)
    return None if ns < 0 else ns
